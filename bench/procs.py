"""The processes the bench starts: a marker in their environment to find them (and the MPS daemons and front-ends
they start) again, ending them for sure, and what /proc says about their memory and CPU time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

MARKER_ENV = "MPSAGENT_BENCH_DIR"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def marked_env(directory: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process the bench starts: every descendant inherits the marker."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", MARKER_ENV: str(directory), **(extra or {})}


def processes_marked(directory: Path) -> list[int]:
    """PIDs whose environment names `directory` or a path below it (agents, MPS daemons in their own sessions)."""
    exact = f"{MARKER_ENV}={directory}".encode()
    below = exact + b"/"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(item == exact or item.startswith(below) for item in environ):
                found.append(int(entry.name))
    return found


def kill_marked(directory: Path) -> list[int]:
    """SIGKILL every process marked with `directory` (or below); returns their PIDs."""
    pids = processes_marked(directory)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


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
