"""The GPU port: what the agent needs to know about and do to the node's GPUs."""

from __future__ import annotations

import enum
from typing import Protocol

from mpsagent.devices import GpuUuid, NodeGpus


class ComputeMode(enum.IntEnum):
    """NVML compute modes (nvmlComputeMode_t)."""

    DEFAULT = 0
    EXCLUSIVE_THREAD = 1
    PROHIBITED = 2
    EXCLUSIVE_PROCESS = 3


class GpuSource(Protocol):
    """Discovers the GPUs; NVML-backed sources can also change compute modes."""

    def discover(self) -> NodeGpus: ...

    @property
    def manages_compute_mode(self) -> bool: ...

    def compute_mode(self, uuid: GpuUuid) -> ComputeMode: ...

    def set_compute_mode(self, uuid: GpuUuid, mode: ComputeMode) -> None: ...
