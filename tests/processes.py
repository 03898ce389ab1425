"""Finding and ending the processes a test, the bench or the hardware check started: by a directory named in
their environment (MPS daemons run in sessions of their own, so a process group does not reach them)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def processes_using(directory: Path) -> list[int]:
    """PIDs whose environment names a path under `directory`."""
    marker = str(directory).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def kill_processes_using(directory: Path) -> None:
    for pid in processes_using(directory):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
