"""What a container granted some replicas is given: its share (from `shares`), environment, mounts and CDI
devices. `Allocate` and `--once`'s examples (through `allocation`, which works a share's edits out once) build it with
`setup_of`; a DRA claim's CDI spec takes the same edits for its share (`share_edits`).

Where the driver limits memory per cgroup (a GPU whose `enforcement` is the driver's), a capped container also gets
the driver's hard limit of its share on each such GPU, set on its cgroup before its first process runs: the CDI device
`mpsagent.io/memory-limit=<limits>` (`MemoryLimitDevice`), whose spec carries the agent's hook, on both routes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import assert_never

from mpsagent.base.devices import Gpu, GpuUuid, ReplicaId
from mpsagent.base.values import DeviceIdStrategy, DeviceListStrategy, Enforcement
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.plan import ResourcePlan
from mpsagent.domain.shares import Share

CONTAINER_MPS_ROOT = PurePosixPath("/mps")
CONTAINER_SHM = PurePosixPath("/dev/shm")
ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
ENV_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_PINNED_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
CDI_KIND = "nvidia.com/gpu"
MEMORY_LIMIT_CDI_KIND = "mpsagent.io/memory-limit"
"""The agent's own CDI kind: a device of it is a set of the driver's memory limits, set by its hook."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ContainerSetup:
    """What one container is given (the content of its Allocate answer): its replicas, its share of each GPU, its
    environment, mounts and CDI devices. The ledger's record of who holds those replicas is `ledger.Grant`.

    The environment, mounts and devices are the resource's edits for the share (`share_edits`): the same for every
    setup of one share, which the servicer relies on to build each share's answer once."""

    replica_ids: tuple[ReplicaId, ...]
    share: Share
    envs: dict[str, str]
    mounts: tuple[Mount, ...]
    cdi_devices: tuple[str, ...]
    memory_limits: MemoryLimitDevice | None = None
    """The driver's limits on its cgroup, which `cdi_devices` names."""


def container_pipe_directory(resource: ResourcePlan) -> PurePosixPath:
    """Where the resource's pipe directory is mounted in a container (the daemon's sockets)."""
    return CONTAINER_MPS_ROOT / resource.name / "pipe"


def _visible_devices(resource: ResourcePlan, gpus: Iterable[Gpu]) -> str:
    if resource.device_id_strategy is DeviceIdStrategy.INDEX:
        return ",".join(str(gpu.index) for gpu in gpus)
    return ",".join(gpu.uuid for gpu in gpus)


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class MemoryLimit:
    """The driver's hard limit on a container cgroup's memory on one GPU."""

    uuid: GpuUuid
    mib: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryLimitDevice:
    """A set of the driver's memory limits as a device of the agent's CDI kind: its spec's hook sets them on the
    cgroup of the container given it, before its first process runs."""

    limits: tuple[MemoryLimit, ...]

    @property
    def name(self) -> str:
        """`GPU-..._20389M`, one part a GPU: what the limits are, in the characters a CDI device name allows."""
        return "-".join(f"{limit.uuid}_{limit.mib}M" for limit in self.limits)

    @property
    def cdi_id(self) -> str:
        return f"{MEMORY_LIMIT_CDI_KIND}={self.name}"


def memory_limit_device(resource: ResourcePlan, share: Share) -> MemoryLimitDevice | None:
    """The driver's limits a container holding `share` gets: its cap on each of its GPUs the driver can limit;
    None for a full grant, or where the driver limits none of its GPUs."""
    enforced = {gpu.uuid for gpu in resource.gpus if gpu.enforcement is Enforcement.DRIVER}
    limits = tuple(MemoryLimit(uuid=gpu.uuid, mib=mib) for gpu, mib in share.memory_caps() if gpu.uuid in enforced)
    return MemoryLimitDevice(limits=limits) if limits else None


@dataclass(frozen=True, kw_only=True, slots=True)
class ContainerEdits:
    """What a container holding a share gets, through an Allocate answer or a claim's CDI spec alike."""

    envs: dict[str, str]
    mounts: tuple[Mount, ...]
    cdi_devices: tuple[str, ...]
    """NVIDIA's CDI devices of its GPUs (`cdi-cri`; empty when NVIDIA_VISIBLE_DEVICES names them), and the agent's
    memory-limit device when the driver limits its memory."""
    memory_limits: MemoryLimitDevice | None = None
    """The driver's limits on its cgroup, which `cdi_devices` names: the device's spec must exist before the
    container does."""


def share_edits(resource: ResourcePlan, share: Share, shm_directory: Path) -> ContainerEdits:
    """The environment, mounts and devices of a container holding `share` of the resource's GPUs."""
    granted = {gpu.uuid for gpu in share.gpus}
    gpus = [gpu for gpu in resource.gpus if gpu.uuid in granted]
    pipe_directory = container_pipe_directory(resource)
    envs = {ENV_PIPE_DIRECTORY: str(pipe_directory)}
    cdi: tuple[str, ...] = ()
    if resource.device_list_strategy is DeviceListStrategy.CDI_CRI:
        cdi = tuple(f"{CDI_KIND}={gpu.uuid}" for gpu in gpus)
    else:
        envs[ENV_VISIBLE_DEVICES] = _visible_devices(resource, gpus)
    limits = None
    match share.kind:
        case GrantKind.FULL:  # no cap variables at all: the whole of its GPUs
            pass
        case GrantKind.CAPPED:
            envs[ENV_THREAD_PERCENTAGE] = str(share.thread_percentage)
            envs[ENV_PINNED_MEM_LIMIT] = share.memory_limit_env()
            limits = memory_limit_device(resource, share)
            if limits is not None:
                cdi = (*cdi, limits.cdi_id)
        case _:
            assert_never(share.kind)
    mounts = (
        Mount(container_path=str(pipe_directory), host_path=str(resource.pipe_directory)),
        Mount(container_path=str(CONTAINER_SHM), host_path=str(shm_directory)),
    )
    return ContainerEdits(envs=envs, mounts=mounts, cdi_devices=cdi, memory_limits=limits)


def setup_of(replica_ids: tuple[ReplicaId, ...], share: Share, edits: ContainerEdits) -> ContainerSetup:
    """A container's set-up from its replicas' share and that share's edits: the edits depend on the share alone, so
    an allocator works them out once per share (`share_edits`) and gives each container a copy of the environment."""
    return ContainerSetup(
        replica_ids=replica_ids,
        share=share,
        envs=dict(edits.envs),
        mounts=edits.mounts,
        cdi_devices=edits.cdi_devices,
        memory_limits=edits.memory_limits,
    )
