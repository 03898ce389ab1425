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


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it, found through the parent PIDs in /proc (sessions of their own
    included: a container runtime ends those too, since they stay in the container's cgroup)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending.extend(children.get(pid, []))
    return tree


def kill_container(root: int) -> list[int]:
    """End a process and everything it started at once, as a container runtime ends a container: SIGKILL to each."""
    tree = process_tree(root)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return tree
