"""What several parts of the agent ask of the host in the same way: whether a process lives, replacing a file so
that no reader ever sees it half-written, and a lock file that names its holder."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while a process with this PID exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_atomically(path: Path, data: bytes, mode: int, *, durable: bool = False) -> None:
    """Replace `path` with `data`, with exactly `mode` whatever the umask; `durable` also survives a power cut.

    The temporary file sits beside the target under a name starting with a dot, so that a reader listing the
    directory (node-feature-discovery does) never takes it for the real one. Raises OSError; leaves no
    temporary file behind when it does.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), mode)
            file.write(data)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise


class PidLock:
    """An exclusive flock on a file that holds its owner's PID, so that whoever finds it taken can name the holder.
    Held until released, or until the owner dies; the file stays (removing a lock file races with its next taker)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; None when taken, else the PID the holder wrote ("unknown" when it wrote none). Raises
        OSError when the file cannot be opened, and refuses anything but a regular file (never follows a link)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            holder = _flock_or_holder(fd, self.path)
        except OSError:
            os.close(fd)
            raise
        if holder is not None:
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def _flock_or_holder(fd: int, path: Path) -> str | None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return holder if holder.isdigit() else "unknown"
    return None
