"""What several parts of the agent ask of the host in the same way: whether a process lives, and replacing a
file so that no reader ever sees it half-written."""

from __future__ import annotations

import os
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
