"""Following the file an MPS control daemon writes its log to (`<resource>/log/control.log`): its new lines
forwarded into the agent's log, each at a level that fits it, and handed to whoever reads them (the ceiling watch);
rotated by the daemon's owner past a bound.

The daemon runs in the foreground with its output on that file, opened once at its start (O_APPEND, by
`launch`): it keeps writing to that file whatever happens to the path. So the follower holds the daemon's own file
open (`/proc/<pid>/fd/1` when the daemon is known and that is a regular file, else the path), and follows it through
what an operator or a tool does:
- cut back (`copytruncate`, `: > control.log`): read again from its start; the lines cut before they were read are
  read from `control.log.1` when that is the copy of what was cut (logrotate's `copytruncate`, the owner's
  rotation), else the cut is reported;
- renamed away or deleted (logrotate's `create`, `rm`): still followed (the daemon writes there), reported once.
A file that cannot be opened or read is reported once, tried again every poll, and never ends its owner.

The daemon's owner's follower (`rotate_bytes`: the agent's when it starts the daemons, the daemon host's when that
does) rotates the file it follows past ROTATE_BYTES. Renaming it would not do (the daemon writes on in the renamed
file), so it copies the file to `control.log.1` and truncates it, as `copytruncate` does, but only right after it
has read it to its end and only while the file still ends there: every line is read before the cut, and a line
written in the instant between that last look and the truncation (two system calls) is in neither file, as one
written between a `copytruncate`'s copy and its truncation is. Whoever reads the lines learns of each cut
(`Chunk.cut`): the ceiling guard then reads the daemon's ceilings back at once.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from structlog.typing import FilteringBoundLogger

from mpsagent.base.errors import FileRefusedError
from mpsagent.base.host import copy_atomically, file_kind, open_private_file, os_reason, size_text
from mpsagent.base.ticker import FAST_POLLS
from mpsagent.base.values import MIB

LOG_POLL_S = FAST_POLLS.period_s
"""How often the file is read: a ceiling changed behind the agent is seen within this (and restored within 1 s)."""
MAX_READ_BYTES = 1 << 20
"""At most this much of the log per poll: a daemon that writes faster is followed, not read whole at once."""
MAX_LINE_BYTES = 4096
ROTATE_BYTES = 16 * MIB
"""Past this size the daemon's owner rotates control.log (a pod start writes about 2 KiB to it: some 8,000 pod
starts), keeping what it held in control.log.1 (its last ROTATE_BYTES when it had grown past twice this)."""
ROTATED_SUFFIX = ".1"
_ROTATE_LOOKS = 3
"""Looks, each after reading what the daemon wrote since the one before, for a moment the file ends where read."""
_COPY = "the daemon log's copy"
_TAIL_BYTES = 64
"""The last bytes read, kept: a file cut back no longer holds them where they were read (even one written past
that point again), and a copy of what was cut holds them there."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """New lines of the log, and what the read that found them knows."""

    lines: list[str]
    at_end: bool
    """The read reached the end of the file (everything the daemon had written when it began is in it)."""
    began: float
    """When the read began (monotonic)."""
    cut: bool = False
    """The file was cut back (rotated, truncated) since the last chunk: a line the daemon wrote in the instant
    before the cut may be in neither the file nor its copy."""


LogReader = Callable[[Chunk], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class Following:
    """What the follower knows of the file now: for `--status`."""

    file: str
    """The file followed (or tried): the path, or the daemon's own output through /proc."""
    followed: bool
    problem: str | None
    """Why it is not followed, or what last happened to it (truncated, renamed away, deleted)."""
    problem_at: float | None
    """When (wall clock)."""
    events: int
    """Truncations, renames and deletions followed (not rotations: a cut whose lines the copy holds)."""


class DaemonLog:
    """Follows one resource's daemon log. `forward`: whether its lines go into the agent's log (the daemon host
    forwards the log of the daemons it keeps; the agent reads them too, to watch the ceilings)."""

    def __init__(
        self,
        path: Path,
        log: FilteringBoundLogger,
        *,
        forward: bool = True,
        rotate_bytes: int | None = None,
        reader: LogReader | None = None,
        proc_root: Path = Path("/proc"),
    ) -> None:
        """`reader`: handed each poll's new lines. `rotate_bytes`: rotate the file past this size (the daemon's
        owner's follower, ROTATE_BYTES); None: never (the agent beside a daemon host, which rotates)."""
        self._path = path
        self._rotated = path.with_name(path.name + ROTATED_SUFFIX)
        self._rotate_bytes = rotate_bytes
        self._rotate_from = rotate_bytes
        """The size at which the next rotation is tried (another bound later after one failed)."""
        self._tail = b""
        """The last bytes read, up to _TAIL_BYTES, ending at the position."""
        self._cut = False
        self._reader = reader
        self._log = log
        self._forward = forward
        self._proc_root = proc_root
        self._fd: int | None = None
        self._file = str(path)
        self._position = 0
        self._pending = b""
        self._daemon: int | None = None
        self._attached = False
        self._failing: str | None = None
        self._moved: tuple[tuple[int, int], bool] | None = None
        """The path's identity (device, inode; (0, 0): no file) and whether the file followed was deleted, when last
        reported."""
        self._problem: tuple[float, str] | None = None
        self.events = 0

    def attach(self, daemon: int | None, *, since: int | None = None) -> None:
        """Follow the file the daemon with this PID writes to (None: the path) from its current end, or from offset
        `since` (the file's size before the daemon was started): called when a daemon has been started or adopted.
        Opens it at once, so no line written after this call is missed."""
        self._daemon = daemon
        self._attached = True
        self._close()
        self._open(since=since)

    def following(self) -> Following:
        problem = self._failing or (self._problem[1] if self._problem else None)
        return Following(
            file=self._file,
            followed=self._fd is not None,
            problem=problem,
            problem_at=self._problem[0] if self._problem else None,
            events=self.events,
        )

    async def run(self) -> None:
        """Follow the file until cancelled: a poll every LOG_POLL_S, in the agent's shared 0.2 s poll (one timer for
        every such poller, no task step of its own)."""
        try:
            with FAST_POLLS.polling(self.poll):
                await anyio.sleep_forever()
        finally:
            self._close()

    def poll(self) -> None:
        """Read what was appended since the last poll, forward it and hand it to the reader. The run loop polls;
        a read-back round polls at once too, so that what the log shows is judged before what it reads back."""
        began = time.monotonic()
        if self._fd is None and self._attached:
            self._open(since=0)  # never read: all of it (a file that appears after the daemon started is its own)
        if self._fd is None:
            return
        try:
            lines, at_end = self._read()
        except OSError as exc:
            self._fail(f"{self._file} cannot be read ({os_reason(exc)})")
            self._close()
            return
        self._check_path()
        for line in lines:
            if self._forward:
                self._log.log(daemon_log_level(line), "mps daemon log", line=line[:MAX_LINE_BYTES])
        cut, self._cut = self._cut, False
        if self._reader is not None:
            self._reader(Chunk(lines=lines, at_end=at_end, began=began, cut=cut))

    # --- the file -------------------------------------------------------------------------------------------

    def _open(self, *, since: int | None = None) -> None:
        """Open the daemon's own file (through /proc), else the path; report once when neither can be."""
        candidates = [] if self._daemon is None else [self._proc_root / str(self._daemon) / "fd" / "1"]
        reasons = []
        for candidate in [*candidates, self._path]:
            what = "the daemon's output" if candidate != self._path else str(self._path)
            try:
                fd = os.open(candidate, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                reasons.append(f"{what} cannot be opened ({os_reason(exc)})")
                continue
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                os.close(fd)
                reasons.append(f"{what} is {file_kind(status.st_mode)}, not a file")
                continue
            self._fd = fd
            self._file = str(self._path) if candidate == self._path else f"{candidate} (the daemon's own output)"
            self._position = status.st_size if since is None or since > status.st_size else since
            self._pending = b""
            self._tail = os.pread(fd, min(self._position, _TAIL_BYTES), max(0, self._position - _TAIL_BYTES))
            self._rotate_from = self._rotate_bytes
            self._moved = None
            if self._failing is not None:
                self._log.info("mps daemon log followed again", file=self._file)
            self._failing = None
            return
        self._fail("; ".join(reasons))

    def _fail(self, reason: str) -> None:
        if self._failing is None:
            self._log.warning(
                "mps daemon log not followed; the caps are checked by reading them back only",
                file=str(self._path),
                reason=reason,
                hint="the agent tries again every poll; the log directory is the agent's own (mode 0700)",
            )
            self._problem = (time.time(), reason)
        self._failing = reason

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _read(self) -> tuple[list[str], bool]:
        """The complete lines appended since the last read, and whether the read reached the end (rotating the
        file then, when it is past its bound)."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        data = b""
        if self._was_cut(size):
            copied = self._copied_rest()
            if copied is None:
                self._event(f"{self._file} was truncated; following it from its start")
                self._pending = b""
            data = copied or b""
            self._position, self._tail, self._cut = 0, b"", True
        data += self._read_to(size)
        at_end = self._position >= size
        if at_end and self._rotate_from is not None and self._position >= self._rotate_from:
            data += self._rotate()
        *complete, pending = (self._pending + data).split(b"\n")
        self._pending = pending[-MAX_LINE_BYTES:]
        lines = [text for line in complete if (text := line.decode(errors="replace").strip())]
        return lines, at_end

    def _read_to(self, size: int) -> bytes:
        """The file from the position up to `size`, at most MAX_READ_BYTES of it; the position moves past it."""
        assert self._fd is not None
        if size <= self._position:
            return b""
        chunk = os.pread(self._fd, min(size - self._position, MAX_READ_BYTES), self._position)
        self._position += len(chunk)
        self._tail = (self._tail + chunk)[-_TAIL_BYTES:]
        return chunk

    def _was_cut(self, size: int) -> bool:
        """Whether the file was cut back since the last read: it is shorter, or no longer holds what was read last
        where it was read (written past that point again before this poll)."""
        assert self._fd is not None
        if size < self._position:
            return True
        tail = self._tail
        return bool(tail) and os.pread(self._fd, len(tail), self._position - len(tail)) != tail

    def _copied_rest(self) -> bytes | None:
        """What control.log.1 holds past the point read, when it is the copy of the file as read (a rotation,
        `copytruncate`): the lines cut before they were read. None when it is not such a copy."""
        tail = self._tail
        try:
            fd = os.open(self._rotated, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            status = os.fstat(fd)
            if not tail or not stat.S_ISREG(status.st_mode) or status.st_size < self._position:
                return None
            if os.pread(fd, len(tail), self._position - len(tail)) != tail:
                return None
            return os.pread(fd, min(status.st_size - self._position, MAX_READ_BYTES), self._position)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _rotate(self) -> bytes:
        """Copy the file, read to its end, to control.log.1 and truncate it; returns what the daemon wrote meanwhile
        (read, and added to the copy, first). The truncation follows a look that finds the file still ends where it
        was read; when the daemon wrote before each of _ROTATE_LOOKS looks, the next poll copies and looks again.
        The daemon appends (O_APPEND): it writes at the start of the emptied file. A rotation that fails is
        reported, and tried again once the file has grown by another bound."""
        assert self._fd is not None
        read = b""
        try:
            writer = os.open(f"/proc/self/fd/{self._fd}", os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._rotation_failed(f"{self._file} cannot be written ({os_reason(exc)})")
            return read
        try:
            mode = stat.S_IMODE(os.fstat(self._fd).st_mode)  # the daemon log's own: owner-only (launch)
            copy_atomically(self._rotated, self._fd, self._kept_from(), self._position, mode, what=_COPY)
            for _ in range(_ROTATE_LOOKS):
                size = os.fstat(writer).st_size
                if size == self._position:
                    os.ftruncate(writer, 0)
                    break
                more = self._read_to(size)
                read += more
                self._add_to_copy(more)
            else:
                return read
        except FileRefusedError as exc:
            self._rotation_failed(str(exc))
            return read
        except OSError as exc:
            self._rotation_failed(f"{self._file} cannot be copied to {self._rotated} and emptied ({os_reason(exc)})")
            return read
        finally:
            os.close(writer)
        self._log.info("mps daemon log rotated", file=self._file, kept=str(self._rotated), bytes=self._position)
        self._position, self._tail, self._cut = 0, b"", True
        self._rotate_from = self._rotate_bytes
        return read

    def _kept_from(self) -> int:
        """Where the copy begins: the file's start, so that a follower behind finds its place in the copy; its last
        ROTATE_BYTES (from a line's start) when it is past twice that (a log from before it was bounded: copying it
        whole would hold up the agent and fill the directory)."""
        assert self._fd is not None and self._rotate_bytes is not None
        if self._position <= 2 * self._rotate_bytes:
            return 0
        start = self._position - self._rotate_bytes
        return start + os.pread(self._fd, MAX_LINE_BYTES, start).find(b"\n") + 1

    def _add_to_copy(self, data: bytes) -> None:
        fd = open_private_file(self._rotated, os.O_WRONLY | os.O_APPEND, 0, what=_COPY)  # not created: no mode
        try:
            left = memoryview(data)
            while left:
                left = left[os.write(fd, left) :]
        finally:
            os.close(fd)

    def _rotation_failed(self, reason: str) -> None:
        assert self._rotate_bytes is not None
        self._rotate_from = self._position + self._rotate_bytes
        self._log.warning(
            "mps daemon log not rotated; it grows until rotated",
            file=self._file,
            reason=reason,
            hint=f"tried again once it has grown by another {size_text(self._rotate_bytes)}; {self._rotated} must be "
            "a regular file, or nothing, in a directory with room for it",
        )

    def _check_path(self) -> None:
        """Report once when the file followed was deleted, or the path no longer names it (renamed away, replaced)."""
        assert self._fd is not None
        followed = os.fstat(self._fd)
        try:
            at_path = os.stat(self._path)
            identity = (at_path.st_dev, at_path.st_ino)
        except OSError:
            identity = (0, 0)
        deleted = followed.st_nlink == 0
        state = (identity, deleted)
        if (identity == (followed.st_dev, followed.st_ino) and not deleted) or state == self._moved:
            return
        self._moved = state
        if deleted:
            what = "the file followed was deleted"
        elif identity == (0, 0):
            what = f"{self._path} was renamed away"
        else:
            what = f"{self._path} now names another file (rotated)"
        self._event(f"{what}; the daemon still writes to the file it opened, which the agent follows")

    def _event(self, what: str) -> None:
        self.events += 1
        self._problem = (time.time(), what)
        self._log.warning("mps daemon log moved; followed", what=what, hint="a new daemon writes a new control.log")


# The agent's own commands (a round trip every few seconds) make most of the daemon's log: debug level for them,
# and for the liveness check's connection, which closes once the daemon greets it (mps.liveness).
_CONTROL_CHATTER = re.compile(
    r"\] (Accepting connection\.\.\.|NEW UI|UI closed|Cmd:(get|set)_\S*.*|[\d.]+[MG]?|(\d+=\d+[MG],?)+"
    r"|User did not send valid credentials)$"
)


def daemon_log_level(line: str) -> int:
    if _CONTROL_CHATTER.search(line):
        return logging.DEBUG
    if re.search(r"error|fail", line, re.IGNORECASE):
        return logging.WARNING
    return logging.INFO
