"""The follower of a daemon's control.log (mps.daemon_log) on a file written as the daemon writes it: an O_APPEND
descriptor held open, one write per line. Cut back by someone else (logrotate's copytruncate, `: >`): every line the
daemon wrote is read once, in order. Each poll is called by the test, no event loop."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog
from structlog.testing import capture_logs

from mpsagent.mps.daemon_log import Chunk, DaemonLog

MOVED = "mps daemon log moved; followed"


def line(n: int) -> str:
    return f"[2026-12-07 10:00:00.{n % 1000:03} Control  4242] Cmd:get_default_active_thread_percentage {n}"


@contextmanager
def daemon_output(path: Path) -> Iterator[Callable[[int], None]]:
    """Writes line(n) as the daemon does: through the descriptor its starter opened (O_APPEND), one write a line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        yield lambda n: os.write(fd, f"{line(n)}\n".encode()) and None
    finally:
        os.close(fd)


class Follower:
    """A DaemonLog and everything its reader was handed."""

    def __init__(self, path: Path, *, since: int | None = 0, **kwargs: Any) -> None:
        """`since`: None to follow from the end, as an agent adopting a running daemon does."""
        self.lines: list[str] = []
        self.chunks: list[Chunk] = []
        self.log = DaemonLog(path, structlog.get_logger("test"), reader=self._read, **kwargs)
        self.log.attach(None, since=since)

    def _read(self, chunk: Chunk) -> None:
        self.lines += chunk.lines
        self.chunks.append(chunk)

    def numbers(self) -> list[int]:
        return [int(text.rsplit(" ", 1)[1]) for text in self.lines]


def events(logs: list[dict[str, Any]], level: str) -> list[str]:
    return [e["event"] for e in logs if e["log_level"] == level and e["event"] != "mps daemon log"]


def test_lines_a_copytruncate_took_before_they_were_read_are_read_from_the_copy(tmp_path: Path) -> None:
    path = tmp_path / "control.log"
    with daemon_output(path) as write, capture_logs() as logs:
        follower = Follower(path)
        write(0)
        follower.log.poll()
        write(1)
        write(2)
        shutil.copyfile(path, path.with_name("control.log.1"))  # logrotate's copytruncate, between two polls
        os.truncate(path, 0)
        write(3)
        follower.log.poll()
    assert follower.numbers() == [0, 1, 2, 3]
    assert events(logs, "warning") == []
    assert follower.log.following().events == 0


def test_a_log_cut_back_and_written_past_where_it_was_read_is_read_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "control.log"
    with daemon_output(path) as write, capture_logs() as logs:
        follower = Follower(path)
        write(0)
        follower.log.poll()
        os.truncate(path, 0)  # `: > control.log`, nothing kept
        for n in range(1, 4):  # more than was read before the cut
            write(n)
        follower.log.poll()
    assert follower.numbers() == [0, 1, 2, 3]
    assert [e["what"] for e in logs if e["event"] == MOVED] == [f"{path} was truncated; following it from its start"]
    assert [c.cut for c in follower.chunks] == [False, True]
