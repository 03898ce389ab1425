"""What a process's `/proc` entry says about where it runs: its parents and its cgroups. `proc_root` is the host's
`/proc` as the agent sees it (`--proc-root`); the control-socket watch reads its own PID namespace's.

Every reader answers "gone" (empty, None) for a process that ended meanwhile: PIDs come from lists taken a moment
before (NVML's, the daemon's sockets')."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
MAX_ANCESTORS = 64
"""Deeper chains are cut here: PID namespaces nest a few levels, a process tree a few dozen."""


def ancestors(pid: int, proc_root: Path = PROC) -> list[int]:
    """The process's parent, its parent's, ... up to PID 1 (bounded); empty when it is gone."""
    chain: list[int] = []
    while len(chain) < MAX_ANCESTORS:
        try:
            stat = (proc_root / str(pid) / "stat").read_text()
        except OSError:
            break
        # The command name in parentheses may hold spaces and parentheses: the fields after its last ')' do not.
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])
        if parent <= 0:
            break
        chain.append(parent)
        pid = parent
    return chain


def cgroup_text(pid: int, proc_root: Path = PROC) -> str | None:
    """The process's `/proc/<pid>/cgroup`; None when it is gone."""
    try:
        return (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
