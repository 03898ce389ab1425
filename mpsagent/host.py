"""What several parts of the agent ask of the host in the same way: whether a process lives, reading a file that
someone else wrote without hanging or exhausting memory, and replacing a file so that no reader ever sees it
half-written."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mpsagent.errors import FileReadError

_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def pid_alive(pid: int) -> bool:
    """True while a process with this PID exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size_text(size: int) -> str:
    return f"{size // (1 << 20)} MiB" if size % (1 << 20) == 0 else f"{size} bytes"


def read_regular_file(path: Path, max_bytes: int, what: str) -> bytes:
    """The contents of `path`, which must be a regular file (a link to one is fine: ConfigMaps are links) of at
    most `max_bytes`; raises FileReadError naming `what` (e.g. `--config-file`), the path and the problem.

    The kind is checked on the opened descriptor, so nothing can swap the file in between; the open itself does
    not block (O_NONBLOCK), so a FIFO is refused instead of waiting for a writer forever.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise FileReadError(path, what, "no such file") from exc
    except OSError as exc:
        raise FileReadError(path, what, f"cannot open it ({exc.strerror})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "a special file")
            raise FileReadError(path, what, f"is {kind}, not a regular file; give a regular file (or a link to one)")
        if info.st_size > max_bytes:
            raise FileReadError(path, what, f"is larger than {_size_text(max_bytes)} ({info.st_size} bytes)")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(max_bytes + 1)  # a file that grew since fstat is not read without bound either
    except OSError as exc:
        raise FileReadError(path, what, f"cannot read it ({exc.strerror})") from exc
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileReadError(path, what, f"is larger than {_size_text(max_bytes)}")
    return data


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
