"""Logging: the agent's own events at `--log-level`, every other library's (HTTP/2 frames, gRPC streams, the API
client's requests) at `--library-log-level`, warning unless asked, so that a debug log is the agent's."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from mpsagent.base.logs import configure_logging, get_logger
from mpsagent.base.settings import SETTINGS
from mpsagent.base.values import LogFormat, LogLevel


@pytest.fixture(autouse=True)
def restored_logging() -> Iterator[None]:
    """What `configure_logging` changes, put back: the root logger, the agent's logger, structlog's set-up."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    own = logging.getLogger("mpsagent").level
    config = structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("mpsagent").setLevel(own)
    structlog.configure(**config)


def logged(capsys: pytest.CaptureFixture[str], level: str, *library_level: str) -> str:
    """What one of each kind of event leaves on stderr."""
    configure_logging(LogFormat.JSON, level, *library_level)
    logging.getLogger("hpack.hpack").debug("hpack header decoded")
    logging.getLogger("h2").debug("h2 frame received")
    logging.getLogger("grpclib.protocol").info("grpclib stream cancelled")
    logging.getLogger("httpcore2").warning("httpcore2 connection lost")
    logging.getLogger("mpsagent.x").debug("stdlib event of the agent")
    get_logger("mpsagent.x").debug("event of the agent")
    return capsys.readouterr().err


def test_at_debug_the_libraries_stay_at_warning(capsys: pytest.CaptureFixture[str]) -> None:
    err = logged(capsys, "debug")
    assert "event of the agent" in err
    assert "stdlib event of the agent" in err
    assert "httpcore2 connection lost" in err  # a library's warning is still the operator's business
    for chatter in ("hpack header decoded", "h2 frame received", "grpclib stream cancelled"):
        assert chatter not in err


def test_the_libraries_log_at_debug_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    err = logged(capsys, "debug", "debug")
    for line in ("hpack header decoded", "h2 frame received", "grpclib stream cancelled", "event of the agent"):
        assert line in err


def test_the_library_level_does_not_lower_the_agents(capsys: pytest.CaptureFixture[str]) -> None:
    err = logged(capsys, "info", "debug")
    assert "hpack header decoded" in err
    assert "event of the agent" not in err


def test_the_library_level_is_a_setting_warning_by_default() -> None:
    entry = SETTINGS["library_log_level"]
    assert (entry.flag, entry.env, entry.key) == ("--library-log-level", "LIBRARY_LOG_LEVEL", "libraryLogLevel")
    assert entry.default is LogLevel.WARNING
    assert entry.choices == tuple(LogLevel)
