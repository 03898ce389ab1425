"""The processes a test, the bench or the hardware check started: finding them again by a directory named in their
environment (MPS daemons run in sessions of their own, so a process group does not reach them), ending them for
sure, and what /proc says about them. Whether a PID exists at all is `mpsagent.base.host.pid_alive`, which the agent
uses itself; `alive` here also counts a zombie as gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MARKER_ENV = "MPSAGENT_TEST_DIR"
"""Names the directory a process belongs to; every descendant inherits it (`marked_env`)."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def marked_env(directory: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process started for `directory`: `processes_using(directory)` finds it and everything
    it starts."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", MARKER_ENV: str(directory), **(extra or {})}


def _names(environ: bytes, directory: str) -> bool:
    """Whether some environment value (or one part of a `:`-separated list) is `directory` or a path below it."""
    below = directory + "/"
    for item in environ.decode(errors="replace").split("\0"):
        for part in item.partition("=")[2].split(os.pathsep):
            if part == directory or part.startswith(below):
                return True
    return False


def processes_using(directory: Path) -> list[int]:
    """PIDs (not this process) whose environment names `directory` or a path below it."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if _names(environ, str(directory)):
                found.append(int(entry.name))
    return found


def kill_processes_using(directory: Path) -> list[int]:
    """SIGKILL every process that `processes_using(directory)` finds; returns their PIDs."""
    pids = processes_using(directory)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


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


def end_group(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int | None:
    """SIGTERM the process, then SIGKILL its whole process group (it was started as a session leader)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    return process.returncode


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


@dataclass(frozen=True, slots=True)
class CpuTimes:
    own_s: float
    """user + system time of the process itself"""
    children_s: float
    """user + system time of its children that it has waited for (the MPS control front-ends)"""


def cpu_times(pid: int) -> CpuTimes:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3 of proc(5)): utime, stime, cutime, cstime are fields 14..17
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return CpuTimes(own_s=(utime + stime) / CLOCK_TICKS, children_s=(cutime + cstime) / CLOCK_TICKS)


def open_fds(pid: int) -> int:
    """How many file descriptors a process holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    """How many threads a process runs."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


@contextmanager
def busy_cpus(count: int | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` processes (one per CPU by default) that spin until the block ends: a busy node for the code under
    test to compete with. Each is ended when the block ends, however it ends."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(count or os.cpu_count() or 1)
    ]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            end_group(spinner)
