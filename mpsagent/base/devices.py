"""Value types shared by every layer: a GPU (and what makes its values plausible), a replica ID `<uuid>::<i>`,
health."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace
from typing import NewType

from mpsagent.base.errors import shown
from mpsagent.base.values import MIB, Enforcement

GpuUuid = NewType("GpuUuid", str)
ReplicaId = NewType("ReplicaId", str)
ResourceName = NewType("ResourceName", str)

REPLICA_SEPARATOR = "::"
MAX_GPUS_PER_NODE = 64
"""Nodes carry 8 GPUs (DGX, HGX) or up to about 20 (PCIe servers) today; 64 leaves room and bounds what a node's
set-up and every request over its replica IDs can cost."""
MAX_GPU_MEMORY_BYTES = 16 << 40
MAX_GPU_NAME_CHARS = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
MAX_NUMA_NODE = 1023  # Linux's largest MAX_NUMNODES
MAX_COMPUTE_CAPABILITY_MAJOR = 19
MAX_COMPUTE_CAPABILITY_MINOR = 9
"""NVIDIA's compute capabilities run from 1.0 to 12.x today, every minor a single digit: room for generations to
come, and nothing like 99.99."""
GPU_UUID_FORM = "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, hexadecimal"
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_PCI_BUS_ID = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_DRIVER_VERSION = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}")
UNKNOWN_DRIVER_VERSION = "unknown"


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
    memory_limits_unavailable: str | None = "not asked"
    """Why the driver cannot limit a container's memory on this GPU (per cgroup); None when it can."""

    @property
    def enforcement(self) -> Enforcement:
        """Who holds a capped container to its memory here: the driver where it can, else MPS alone."""
        return Enforcement.MPS if self.memory_limits_unavailable else Enforcement.DRIVER

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes // MIB

    @property
    def compute_capability_text(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


def is_gpu_uuid(text: str) -> bool:
    """True for the form NVML gives a GPU's UUID; nothing else may reach a container's NVIDIA_VISIBLE_DEVICES."""
    return _GPU_UUID.fullmatch(text) is not None


def gpu_problem(gpu: Gpu) -> tuple[str, str] | None:
    """The first value of `gpu` that no real GPU has, as (its key as snapshots and `--once` spell it, why); None when
    every value is plausible. The one check of a GPU's values, for every source that describes GPUs."""
    if not is_gpu_uuid(gpu.uuid):
        return "uuid", f"`{shown(gpu.uuid)}` is not an NVIDIA GPU UUID ({GPU_UUID_FORM})"
    if not 0 <= gpu.index < MAX_GPUS_PER_NODE:
        return "index", f"must be from 0 to {MAX_GPUS_PER_NODE - 1}, not {shown(gpu.index)}"
    if not gpu.name or len(gpu.name) > MAX_GPU_NAME_CHARS:
        return "name", f"must be at most {MAX_GPU_NAME_CHARS} characters, and not empty; it has {len(gpu.name)}"
    if not (gpu.name.isascii() and gpu.name.isprintable()):
        return "name", f"must be printable ASCII, not `{shown(gpu.name)}`"
    if not MIB <= gpu.memory_bytes <= MAX_GPU_MEMORY_BYTES:
        return "memoryBytes", f"must be between 1 MiB and 16 TiB, not {shown(gpu.memory_bytes)}"
    major, minor = gpu.compute_capability
    if not (1 <= major <= MAX_COMPUTE_CAPABILITY_MAJOR and 0 <= minor <= MAX_COMPUTE_CAPABILITY_MINOR):
        return "computeCapability", (
            f'must look like "9.0" (major 1 to {MAX_COMPUTE_CAPABILITY_MAJOR}, minor 0 to '
            f"{MAX_COMPUTE_CAPABILITY_MINOR}), not {gpu.compute_capability_text}"
        )
    if gpu.pci_bus_id and not _PCI_BUS_ID.fullmatch(gpu.pci_bus_id):
        return "pciBusId", f"must be DOMAIN:BUS:DEVICE.FUNCTION (00000000:18:00.0), not `{shown(gpu.pci_bus_id)}`"
    if gpu.numa_node is not None and not 0 <= gpu.numa_node <= MAX_NUMA_NODE:
        return "numaNode", f"must be from 0 to {MAX_NUMA_NODE} (-1 or null: none), not {shown(gpu.numa_node)}"
    return None


def driver_version_problem(version: str) -> str | None:
    """Why a driver version is not of NVIDIA's form (550.90.07), or None."""
    if version == UNKNOWN_DRIVER_VERSION or _DRIVER_VERSION.fullmatch(version):
        return None
    return f"must look like 550.90.07, not `{shown(version)}`"


def format_replica_id(uuid: GpuUuid, replica: int) -> ReplicaId:
    return ReplicaId(f"{uuid}{REPLICA_SEPARATOR}{replica}")


def gpu_of(replica_id: ReplicaId) -> GpuUuid:
    """The GPU behind a replica ID the agent itself formatted."""
    return GpuUuid(replica_id.rpartition(REPLICA_SEPARATOR)[0])


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeGpus:
    """The node's GPUs in host-index order, and where they were read from."""

    driver_version: str
    gpus: tuple[Gpu, ...]
    source: str

    def without_memory_limits(self, reason: str) -> NodeGpus:
        """The same GPUs, none of them limited by the driver (`reason`, where the driver could): the agent has no
        hook to set the limits with."""
        gpus = tuple(
            gpu if gpu.memory_limits_unavailable else replace(gpu, memory_limits_unavailable=reason)
            for gpu in self.gpus
        )
        return replace(self, gpus=gpus)


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class ContainerRef:
    """A container as the kubelet's pod-resources API names it."""

    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"
