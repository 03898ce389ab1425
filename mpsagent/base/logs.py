"""structlog set-up: one event per line, JSON or console; the standard library's loggers (grpclib's) go through
the same renderer. Exceptions are rendered without local variables. The agent's own events (`mpsagent.*`) are
logged from `--log-level`, every library's from `--library-log-level` (warning unless asked).

The agent's own loggers take structlog's native path (a filtering bound logger writing straight to stderr), not
the standard library's: a log line sits on the Allocate path, and the stdlib round trip (LogRecord, handler,
ProcessorFormatter) cost several times the rendering itself."""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any, TextIO

import structlog
from structlog.typing import FilteringBoundLogger

from mpsagent.base.values import LogFormat

AGENT_LOGGER = "mpsagent"
"""The agent's own loggers are this one and those below it (`get_logger(__name__)`)."""


class _LibraryLevel(logging.Filter):
    """Drops a library's record below the library level, whatever level its logger was given (by the library
    itself, or by an earlier set-up): the root logger's level alone reaches only loggers left at NOTSET."""

    def __init__(self, level_number: int) -> None:
        super().__init__()
        self.level_number = level_number

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == AGENT_LOGGER or record.name.startswith(AGENT_LOGGER + ".")
        return own or record.levelno >= self.level_number


def configure_logging(
    log_format: LogFormat = LogFormat.AUTO, level: str = "info", library_level: str = "warning"
) -> None:
    use_json = log_format is LogFormat.JSON or (log_format is LogFormat.AUTO and not sys.stderr.isatty())
    level_number = logging.getLevelNamesMapping()[level.upper()]
    library_number = logging.getLevelNamesMapping()[library_level.upper()]
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,  # the module's name: the record's for stdlib loggers, else ModuleLogger's
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if use_json:
        # One encoder built once: json.dumps(default=...) builds a new one per line. The same bytes either way.
        encoder = json.JSONEncoder(default=repr)
        renderer = structlog.processors.JSONRenderer(serializer=lambda event_dict, **_: encoder.encode(event_dict))
        shared.append(
            structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
        )
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(_LibraryLevel(library_number))
    # The libraries log at their own level: at debug, h2 and hpack log every HTTP/2 frame, grpclib every stream,
    # httpx2 every request, a flood that would bury the agent's own debug events; the agent reports what matters
    # itself. The root level keeps their records from being made at all.
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(library_number)
    logging.getLogger(AGENT_LOGGER).setLevel(level_number)
    structlog.configure(
        processors=[*shared, renderer],
        logger_factory=functools.partial(ModuleLogger, sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        cache_logger_on_first_use=True,
    )


class ModuleLogger(structlog.WriteLogger):
    """Writes rendered lines to `file`, and carries the name given to `get_logger` for add_logger_name."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


def get_logger(name: str) -> FilteringBoundLogger:
    logger: FilteringBoundLogger = structlog.get_logger(name)
    return logger
