"""The follower of a daemon's control.log (mps.daemon_log) on a file written as the daemon writes it: an O_APPEND
descriptor held open, one write per line. Rotated by the daemon's owner past its bound, cut back by someone else
(logrotate's copytruncate, `: >`), followed by a second follower beside the owner's (the agent beside a daemon
host): every line the daemon wrote is read once, in order. Each poll is called by the test, no event loop."""

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

BOUND = 1024
"""The size past which the owner's follower rotates, in these tests (the agent's is ROTATE_BYTES)."""
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


def test_a_log_past_its_bound_is_rotated_once_read_and_what_it_held_kept_in_control_log_1(tmp_path: Path) -> None:
    path = tmp_path / "control.log"
    with daemon_output(path) as write, capture_logs() as logs:
        follower = Follower(path, rotate_bytes=BOUND)
        for n in range(20):  # 1,400 bytes: past the bound
            write(n)
        written = path.read_bytes()
        follower.log.poll()
        assert path.stat().st_size == 0
        write(20)
        follower.log.poll()
    assert follower.numbers() == list(range(21))
    assert path.with_name("control.log.1").read_bytes() == written
    assert path.read_text() == f"{line(20)}\n"
    assert (path.with_name("control.log.1").stat().st_mode & 0o777) == 0o600
    assert events(logs, "warning") == []
    rotated = next(e for e in logs if e["event"] == "mps daemon log rotated")
    assert rotated["kept"] == str(path.with_name("control.log.1"))
    assert [c.cut for c in follower.chunks] == [True, False]  # the reader learns of the rotation's cut


def test_a_log_adopted_far_past_its_bound_keeps_only_its_last_bound_of_whole_lines(tmp_path: Path) -> None:
    """A daemon's log from before it was bounded (4.1 MiB after 2,000 pod starts): copying it whole would hold up
    the agent and fill the directory."""
    path = tmp_path / "control.log"
    with daemon_output(path) as write:
        for n in range(60):  # 5,000 bytes: past twice the bound
            write(n)
        follower = Follower(path, rotate_bytes=BOUND, since=None)
        follower.log.poll()
        write(60)
        follower.log.poll()
    assert follower.numbers() == [60]
    kept = path.with_name("control.log.1").read_text()
    assert len(kept) <= BOUND and kept.startswith("[") and kept.endswith(f"{line(59)}\n")
    assert "".join(f"{line(n)}\n" for n in range(60)).endswith(kept)


def test_a_rotation_that_cannot_keep_the_old_part_is_reported_and_tried_again_a_bound_later(tmp_path: Path) -> None:
    path, kept = tmp_path / "control.log", tmp_path / "control.log.1"
    kept.mkdir()  # something in the way
    with daemon_output(path) as write, capture_logs() as logs:
        follower = Follower(path, rotate_bytes=BOUND)
        n = 0
        while not any(e["event"] == "mps daemon log rotated" for e in logs):
            write(n)
            follower.log.poll()
            n += 1
            if n == 20:
                kept.rmdir()
        write(n)
        follower.log.poll()
    assert follower.numbers() == list(range(n + 1))
    failures = [e for e in logs if e["event"] == "mps daemon log not rotated; it grows until rotated"]
    assert len(failures) == 1 and failures[0]["reason"] == (
        f"the daemon log's copy {kept} is a directory, not a regular file"
    )
    rotated = next(e for e in logs if e["event"] == "mps daemon log rotated")
    assert rotated["bytes"] >= 2 * BOUND  # tried again a bound after the failure, not at every poll
    assert path.read_text() == f"{line(n)}\n"


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


def test_a_follower_beside_the_owners_reads_every_line_once_through_its_rotations(tmp_path: Path) -> None:
    """The agent beside a daemon host: the daemon host's follower rotates, the agent's reads behind it."""
    path = tmp_path / "control.log"
    with daemon_output(path) as write, capture_logs() as logs:
        owner = Follower(path, rotate_bytes=BOUND)
        beside = Follower(path)
        for n in range(100):
            write(n)
            owner.log.poll()  # in the same tick, the owner's poll comes first (it started first)
            if n % 7 == 0:
                beside.log.poll()
        beside.log.poll()
    assert [e["event"] for e in logs].count("mps daemon log rotated") >= 4
    assert owner.numbers() == beside.numbers() == list(range(100))
    assert events(logs, "warning") == []
    assert beside.log.following().events == 0
