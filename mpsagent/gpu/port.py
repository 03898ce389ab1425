"""The GPU port: what the agent needs to know about and do to the node's GPUs."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from mpsagent.base.devices import GpuUuid, NodeGpus


class ComputeMode(enum.IntEnum):
    """NVML compute modes (nvmlComputeMode_t)."""

    DEFAULT = 0
    EXCLUSIVE_THREAD = 1
    PROHIBITED = 2
    EXCLUSIVE_PROCESS = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class XidEvent:
    """A critical-Xid event; `uuid` None when NVML could not say which GPU it came from."""

    uuid: GpuUuid | None
    xid: int


UTILIZATION_WINDOW_S = 10.0
"""How far back a process's SM utilization sample may be: a scrape interval or two."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuProcess:
    pid: int
    used_bytes: int | None
    """None when the driver cannot tell (some platforms, some MPS setups)."""
    mps_client: bool
    sm_percent: int | None = None
    """How busy its kernels kept the GPU's SMs in its latest sample of the last UTILIZATION_WINDOW_S (0: no sample,
    idle); None where NVML does not sample processes (MIG, some GPUs and drivers)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CgroupMemory:
    """A cgroup's memory limit on one GPU as the driver holds it, and what its processes use there."""

    hard_bytes: int | None
    """None: no limit."""
    soft_bytes: int
    used_bytes: int


class MemoryLimits(Protocol):
    """The driver's memory limits per cgroup v2 directory (`cgroup`: its full path, `/sys/fs/cgroup/...`), r615+;
    blocking calls. Each raises MemoryLimitError naming the GPU, the cgroup and what the driver said."""

    def set_hard_limit(self, uuid: GpuUuid, cgroup: str, hard_bytes: int) -> None:
        """Limit the cgroup's processes to `hard_bytes` of the GPU's memory, together (no soft limit)."""
        ...

    def read(self, uuid: GpuUuid, cgroup: str) -> CgroupMemory | None:
        """The cgroup's limit and use on the GPU; None when the cgroup is gone (its limit went with it)."""
        ...


class GpuEventWatch(Protocol):
    """A blocking NVML event subscription; used from one worker thread at a time."""

    registration_problems: dict[GpuUuid, str]
    """GPUs whose events cannot be watched, and why."""

    def wait(self, timeout_ms: int) -> XidEvent | None:
        """The next critical-Xid event, or None after the timeout; raises GpuHealthError when waiting fails."""
        ...

    def close(self) -> None: ...


class GpuHealthSource(Protocol):
    """Blocking calls for GPU health: the agent runs them off the event loop."""

    def watch_events(self, uuids: tuple[GpuUuid, ...]) -> GpuEventWatch: ...

    def probe(self, uuid: GpuUuid) -> str | None:
        """None when the GPU answers normally, else what is wrong (for instance, lost)."""
        ...

    def processes(self, uuid: GpuUuid) -> tuple[GpuProcess, ...]:
        """The processes using the GPU (MPS clients included); raises GpuDiscoveryError when NVML cannot say."""
        ...


class GpuSource(Protocol):
    """Discovers the GPUs; NVML-backed sources can also change compute modes and report health."""

    def discover(self) -> NodeGpus: ...

    @property
    def health(self) -> GpuHealthSource | None: ...

    @property
    def manages_compute_mode(self) -> bool: ...

    @property
    def memory_limits(self) -> MemoryLimits | None:
        """The driver's per-cgroup memory limits; None where GPUs do not come from NVML."""
        ...

    def compute_mode(self, uuid: GpuUuid) -> ComputeMode: ...

    def set_compute_mode(self, uuid: GpuUuid, mode: ComputeMode) -> None: ...
