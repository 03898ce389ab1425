"""What a process's `/proc` entry says about where it runs: its parents, its cgroups, its cgroup v2 directory.
`proc_root` is the host's `/proc` as the agent sees it (`--proc-root`); the control-socket watch reads its own PID
namespace's, the driver's memory limits (the hook, the agent's start) the cgroup v2 directory of a process.

The readers of parents and cgroups answer "gone" (empty, None) for a process that ended meanwhile: PIDs come from
lists taken a moment before (NVML's, the daemon's sockets')."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mpsagent.base.cgroups import cgroup2_mount, cgroup2_path

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


@dataclass(frozen=True, kw_only=True, slots=True)
class Cgroup2Place:
    """A process's place in cgroup v2: where cgroup v2 is mounted here, and the process's path under it."""

    mount: str
    path: str

    @property
    def in_root(self) -> bool:
        return self.path in ("", "/")

    @property
    def directory(self) -> str:
        """Its cgroup v2 directory (`/sys/fs/cgroup/...`): the name the driver's memory limits take."""
        return self.mount if self.in_root else self.mount.rstrip("/") + self.path


def cgroup2_place(process: str, proc_root: Path = PROC) -> Cgroup2Place | None:
    """The cgroup v2 place of `process` (a PID, or `self`); None where the node has no cgroup v2. Raises OSError when
    its entry cannot be read."""
    mount = cgroup2_mount((proc_root / "self" / "mountinfo").read_text())
    path = cgroup2_path((proc_root / process / "cgroup").read_text())
    return None if mount is None or path is None else Cgroup2Place(mount=mount, path=path)
