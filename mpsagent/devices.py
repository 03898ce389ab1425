"""Value types shared by every layer: a GPU, a replica ID `<uuid>::<i>`, health."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

GpuUuid = NewType("GpuUuid", str)
ReplicaId = NewType("ReplicaId", str)
ResourceName = NewType("ResourceName", str)

REPLICA_SEPARATOR = "::"
MIB = 1024 * 1024


class Health(enum.StrEnum):
    """Device health as the kubelet spells it."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    """One physical GPU as NVML (or a node snapshot) describes it."""

    uuid: GpuUuid
    index: int
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    pci_bus_id: str
    numa_node: int | None
    mig_enabled: bool

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes // MIB

    @property
    def compute_capability_text(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


def format_replica_id(uuid: GpuUuid, replica: int) -> ReplicaId:
    return ReplicaId(f"{uuid}{REPLICA_SEPARATOR}{replica}")


def gpu_of(replica_id: ReplicaId) -> GpuUuid:
    """The GPU behind a replica ID the agent itself formatted."""
    return GpuUuid(replica_id.rpartition(REPLICA_SEPARATOR)[0])


def parse_replica_id(replica_id: str) -> tuple[GpuUuid, int] | None:
    """Split `<uuid>::<i>`; None when the text is not of that form."""
    uuid, sep, index = replica_id.rpartition(REPLICA_SEPARATOR)
    if not sep or not uuid or not index.isascii() or not index.isdigit():
        return None
    return GpuUuid(uuid), int(index)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeGpus:
    """The node's GPUs in host-index order, and where they were read from."""

    driver_version: str
    gpus: tuple[Gpu, ...]
    source: str


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class ContainerRef:
    """A container as the kubelet's pod-resources API names it."""

    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"
