"""The plan: config + GPUs -> what is advertised, what each daemon is told, and what a grant gets.

Pure functions only. `Allocate`, the daemon supervisor and `--once` all call these, so the dry run shows exactly
what the running agent does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from mpsagent.config import (
    MAX_REPLICAS_BEFORE_VOLTA,
    AllocationPolicy,
    DeviceIdStrategy,
    DeviceListStrategy,
    MultiUser,
    ResourceSpec,
    SharingConfig,
)
from mpsagent.devices import MIB, Gpu, GpuUuid, NodeGpus, ReplicaId, ResourceName, format_replica_id, gpu_of
from mpsagent.errors import ConfigError, shown
from mpsagent.shares import (
    MAX_CLIENTS_PER_GPU,
    MAX_CLIENTS_PER_GPU_BEFORE_VOLTA,
    Ceilings,
    GpuSlots,
    Share,
    ShareModel,
)

CONTAINER_MPS_ROOT = PurePosixPath("/mps")
CONTAINER_SHM = PurePosixPath("/dev/shm")
ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
ENV_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_PINNED_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
CDI_KIND = "nvidia.com/gpu"
MAX_MEMORY_UNITS_PER_GPU = 256
"""What a memory-unit resource may advertise per GPU (1 GiB units of a 141 GiB GPU are 140): bounds the device
list the kubelet is sent and every request over it, as `replicas` (at most 48) does."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourcePlan:
    """One advertised resource: its GPUs (host-index order, as the daemon numbers them), replicas and paths."""

    config_path: str
    name: ResourceName
    replicas: int
    """Device IDs per GPU (for a memory-unit resource, the most any of its GPUs has)."""
    renamed: bool
    gpus: tuple[Gpu, ...]
    device_ids: tuple[ReplicaId, ...]
    directory: Path
    fail_requests_greater_than_one: bool
    enforce_caps: bool
    device_list_strategy: DeviceListStrategy
    device_id_strategy: DeviceIdStrategy
    allocation_policy: AllocationPolicy
    ordinals: dict[GpuUuid, int] = field(compare=False)
    shares: ShareModel = field(compare=False)
    multi_user: MultiUser = MultiUser.AUTO
    memory_unit_bytes: int | None = None

    @property
    def memory_units(self) -> bool:
        return self.memory_unit_bytes is not None

    @property
    def pipe_directory(self) -> Path:
        return self.directory / "pipe"

    @property
    def log_directory(self) -> Path:
        return self.directory / "log"

    @property
    def container_pipe_directory(self) -> PurePosixPath:
        return CONTAINER_MPS_ROOT / self.name / "pipe"

    @property
    def visible_devices(self) -> str:
        """CUDA_VISIBLE_DEVICES for the daemon: the resource's GPUs, so that it numbers them from 0."""
        return ",".join(gpu.uuid for gpu in self.gpus)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePlan:
    driver_version: str
    gpu_source: str
    gpus: tuple[Gpu, ...]
    resources: tuple[ResourcePlan, ...]
    labels: dict[str, str]
    mps_root: Path

    @property
    def shm_directory(self) -> Path:
        return self.mps_root / "shm"


@dataclass(frozen=True, kw_only=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ContainerGrant:
    """What one container is given: its replicas, its share of each GPU, and its environment."""

    replica_ids: tuple[ReplicaId, ...]
    share: Share
    envs: dict[str, str]
    mounts: tuple[Mount, ...]
    cdi_devices: tuple[str, ...]

    @property
    def full(self) -> bool:
        return self.share.full


# --- building the plan ------------------------------------------------------------------------------------


def _reference_key(ref: int | str) -> str:
    """A device reference as `_select_gpus` looks it up: a GPU UUID, or an index in decimal without leading zeros
    (compared as text: a string of thousands of digits is no index, and no reason to convert it)."""
    if isinstance(ref, int):
        return str(ref)
    return (ref.lstrip("0") or "0") if ref.isascii() and ref.isdigit() else ref


def _select_gpus(spec: ResourceSpec, gpus: tuple[Gpu, ...]) -> tuple[Gpu, ...]:
    path = f"{spec.path}.devices"
    if spec.devices == "all":
        return gpus
    if isinstance(spec.devices, int):
        if spec.devices > len(gpus):
            raise ConfigError(path, f"asks for {spec.devices} GPUs but this node has {len(gpus)}")
        return gpus[: spec.devices]
    by_reference = {key: gpu for gpu in gpus for key in (gpu.uuid, str(gpu.index))}
    chosen: dict[GpuUuid, Gpu] = {}
    for position, ref in enumerate(spec.devices):
        gpu = by_reference.get(_reference_key(ref))
        if gpu is None:
            known = ", ".join(str(g.index) for g in gpus)
            raise ConfigError(
                f"{path}[{position}]", f"`{shown(ref)}` matches no GPU on this node (indices {known}, or a GPU UUID)"
            )
        if gpu.uuid in chosen:
            raise ConfigError(f"{path}[{position}]", f"GPU {gpu.index} ({gpu.uuid}) is listed twice")
        chosen[gpu.uuid] = gpu
    return tuple(sorted(chosen.values(), key=lambda g: g.index))


def _check_gpus(spec: ResourceSpec, gpus: tuple[Gpu, ...]) -> None:
    for gpu in gpus:
        if gpu.mig_enabled:
            raise ConfigError(
                f"{spec.path}.devices",
                f"GPU {gpu.index} ({gpu.uuid}) has MIG enabled; MPS sharing needs MIG disabled "
                "(nvidia-smi -i <index> -mig 0), or leave the GPU out of this resource",
            )
        if gpu.compute_capability < (7, 0) and (spec.replicas or 0) > MAX_REPLICAS_BEFORE_VOLTA:
            raise ConfigError(
                f"{spec.path}.replicas",
                f"GPU {gpu.index} has compute capability {gpu.compute_capability_text}, where MPS allows at most "
                f"{MAX_REPLICAS_BEFORE_VOLTA} clients; {spec.replicas} is too many",
            )


def _ids_per_gpu(spec: ResourceSpec, gpus: tuple[Gpu, ...]) -> tuple[int, ...]:
    """How many device IDs each GPU advertises: `replicas`, or as many memory units as fit in it."""
    if spec.memory_unit_bytes is None:
        assert spec.replicas is not None
        return tuple(spec.replicas for _ in gpus)
    counts = tuple(gpu.memory_bytes // spec.memory_unit_bytes for gpu in gpus)
    for gpu, count in zip(gpus, counts, strict=True):
        if count < 1:
            raise ConfigError(
                f"{spec.path}.memoryUnit",
                f"is larger than GPU {gpu.index}'s memory ({gpu.memory_mib} MiB); use a smaller unit",
            )
        if count > MAX_MEMORY_UNITS_PER_GPU:
            smallest = -(-gpu.memory_bytes // MAX_MEMORY_UNITS_PER_GPU // MIB)
            raise ConfigError(
                f"{spec.path}.memoryUnit",
                f"makes GPU {gpu.index} advertise {count} device IDs, more than the {MAX_MEMORY_UNITS_PER_GPU} a GPU "
                f"may have; use a unit of at least {smallest}Mi",
            )
    return counts


def _share_model(spec: ResourceSpec, sharing: SharingConfig, gpus: tuple[Gpu, ...], ids: tuple[int, ...]) -> ShareModel:
    return ShareModel(
        gpus=tuple(
            GpuSlots(
                uuid=gpu.uuid,
                ordinal=ordinal,
                memory_bytes=gpu.memory_bytes,
                ids=count,
                max_clients=MAX_CLIENTS_PER_GPU
                if gpu.compute_capability >= (7, 0)
                else MAX_CLIENTS_PER_GPU_BEFORE_VOLTA,
            )
            for ordinal, (gpu, count) in enumerate(zip(gpus, ids, strict=True))
        ),
        rule=sharing.grants,
        unit_bytes=spec.memory_unit_bytes,
        enforce=sharing.enforce_caps,
    )


def build_plan(sharing: SharingConfig, node: NodeGpus, mps_root: Path) -> NodePlan:
    """Combine the checked config with the node's GPUs; raises ConfigError naming the key path."""
    owners: dict[GpuUuid, str] = {}
    resources = []
    for spec in sharing.resources:
        gpus = _select_gpus(spec, node.gpus)
        _check_gpus(spec, gpus)
        for gpu in gpus:
            if gpu.uuid in owners:
                raise ConfigError(
                    f"{spec.path}.devices",
                    f"GPU {gpu.index} ({gpu.uuid}) is already shared by {owners[gpu.uuid]}; "
                    "each GPU can be in one resource only",
                )
            owners[gpu.uuid] = spec.path
        ids = _ids_per_gpu(spec, gpus)
        resources.append(
            ResourcePlan(
                config_path=spec.path,
                name=ResourceName(spec.advertised_name),
                replicas=max(ids, default=0),
                renamed=spec.renamed,
                gpus=gpus,
                device_ids=tuple(
                    format_replica_id(g.uuid, i) for g, count in zip(gpus, ids, strict=True) for i in range(count)
                ),
                directory=mps_root / spec.advertised_name,
                fail_requests_greater_than_one=sharing.fail_requests_greater_than_one,
                enforce_caps=sharing.enforce_caps,
                device_list_strategy=sharing.device_list_strategy,
                device_id_strategy=sharing.device_id_strategy,
                allocation_policy=sharing.allocation_policy,
                ordinals={gpu.uuid: ordinal for ordinal, gpu in enumerate(gpus)},
                shares=_share_model(spec, sharing, gpus, ids),
                multi_user=sharing.multi_user,
                memory_unit_bytes=spec.memory_unit_bytes,
            )
        )
    shared = tuple(resources)
    return NodePlan(
        driver_version=node.driver_version,
        gpu_source=node.source,
        gpus=node.gpus,
        resources=shared,
        labels=node_labels(node.gpus, shared),
        mps_root=mps_root,
    )


_LABEL_VALUE_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def node_labels(gpus: tuple[Gpu, ...], resources: tuple[ResourcePlan, ...]) -> dict[str, str]:
    """The labels the NVIDIA GPU feature discovery would set for this plan (first resource decides replicas)."""
    first = resources[0]
    product = _LABEL_VALUE_UNSAFE.sub("", gpus[0].name.replace(" ", "-")) if gpus else "unknown"
    if not first.renamed:
        product = f"{product}-SHARED"
    return {
        "nvidia.com/gpu.count": str(len(gpus)),
        "nvidia.com/gpu.product": product[:63].strip("-_."),
        "nvidia.com/gpu.replicas": str(first.replicas),
        "nvidia.com/gpu.sharing-strategy": "mps",
        "nvidia.com/mps.capable": "true",
    }


# --- caps ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ControlStep:
    """One control command, the `get_` command that reads its value back, and the reply that means it held;
    `server` is the running MPS server it is about, None for the daemon's defaults."""

    command: str
    read_back: str
    expected: str
    server: int | None = None


def memory_read_back(mib: int) -> str:
    """How the control daemon prints a pinned-memory limit: whole GiB (rounded down) from 1 GiB up, else MiB."""
    return f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"


def daemon_default_steps(ceilings: Ceilings) -> tuple[ControlStep, ...]:
    """The control commands that set the daemon's defaults (its hard ceilings), with read-backs."""
    percentage = ceilings.thread_percentage
    return (
        ControlStep(
            command=f"set_default_active_thread_percentage {percentage}",
            read_back="get_default_active_thread_percentage",
            expected=f"{percentage:.1f}",
        ),
        *(
            ControlStep(
                command=f"set_default_device_pinned_mem_limit {ordinal} {mib}M",
                read_back=f"get_default_device_pinned_mem_limit {ordinal}",
                expected=memory_read_back(mib),
            )
            for ordinal, mib in enumerate(ceilings.memory_mib)
        ),
    )


def daemon_default_commands(ceilings: Ceilings) -> tuple[str, ...]:
    return tuple(step.command for step in daemon_default_steps(ceilings))


def running_server_steps(ceilings: Ceilings, server_pid: int) -> tuple[ControlStep, ...]:
    """Bring an already-running MPS server to the ceilings (defaults only apply to servers started later)."""
    percentage = ceilings.thread_percentage
    return (
        ControlStep(
            command=f"set_active_thread_percentage {server_pid} {percentage}",
            read_back=f"get_active_thread_percentage {server_pid}",
            expected=f"{percentage:.1f}",
            server=server_pid,
        ),
        *(
            ControlStep(
                command=f"set_device_pinned_mem_limit {server_pid} {ordinal} {mib}M",
                read_back=f"get_device_pinned_mem_limit {server_pid} {ordinal}",
                expected=memory_read_back(mib),
                server=server_pid,
            )
            for ordinal, mib in enumerate(ceilings.memory_mib)
        ),
    )


def running_server_commands(ceilings: Ceilings, server_pid: int) -> tuple[str, ...]:
    return tuple(step.command for step in running_server_steps(ceilings, server_pid))


@dataclass(frozen=True, kw_only=True, slots=True)
class CapDifference:
    """A value the daemon holds other than the one its ceilings need: someone with the control socket (every
    client container has it) changed it behind the agent."""

    step: ControlStep
    found: str | None
    """What the read-back printed; None: nothing, which means no limit at all."""

    def describe(self) -> str:
        found = "nothing (no limit)" if self.found is None else self.found
        return f"`{self.step.read_back}` reads {found}, expected {self.step.expected}"


def cap_differences(
    defaults: Sequence[ControlStep],
    default_values: Sequence[str | None],
    servers: Sequence[Sequence[ControlStep]] = (),
    server_values: Sequence[str | None] = (),
) -> tuple[CapDifference, ...]:
    """Where the daemon's values differ from the steps' expected ones. `server_values` follows `servers`, flat.

    A default that reads nothing is a difference (the agent always sets every one). A server that answers none of
    its values is not ready (starting, or gone since it was listed): it is read again on the next round.
    """
    found = [
        CapDifference(step=step, found=value)
        for step, value in zip(defaults, default_values, strict=True)
        if value != step.expected
    ]
    values = iter(server_values)
    for steps in servers:
        read = [next(values) for _ in steps]
        if any(value is not None for value in read):
            found += [
                CapDifference(step=step, found=value)
                for step, value in zip(steps, read, strict=True)
                if value != step.expected
            ]
    return tuple(found)


# --- grants -------------------------------------------------------------------------------------------------


def _visible_devices(resource: ResourcePlan, gpus: Iterable[Gpu]) -> str:
    if resource.device_id_strategy is DeviceIdStrategy.INDEX:
        return ",".join(str(gpu.index) for gpu in gpus)
    return ",".join(gpu.uuid for gpu in gpus)


def container_grant(resource: ResourcePlan, replica_ids: tuple[ReplicaId, ...], shm_directory: Path) -> ContainerGrant:
    """The environment, mounts and devices of a container granted these (known, distinct) replicas."""
    share = resource.shares.share_of(replica_ids)
    granted = {gpu_of(replica) for replica in replica_ids}
    gpus = [gpu for gpu in resource.gpus if gpu.uuid in granted]
    envs = {ENV_PIPE_DIRECTORY: str(resource.container_pipe_directory)}
    cdi: tuple[str, ...] = ()
    if resource.device_list_strategy is DeviceListStrategy.CDI_CRI:
        cdi = tuple(f"{CDI_KIND}={gpu.uuid}" for gpu in gpus)
    else:
        envs[ENV_VISIBLE_DEVICES] = _visible_devices(resource, gpus)
    if not share.full:
        envs[ENV_THREAD_PERCENTAGE] = str(share.thread_percentage)
        envs[ENV_PINNED_MEM_LIMIT] = ",".join(f"{o}={m}M" for o, m in enumerate(share.env_memory_mib))
    mounts = (
        Mount(container_path=str(resource.container_pipe_directory), host_path=str(resource.pipe_directory)),
        Mount(container_path=str(CONTAINER_SHM), host_path=str(shm_directory)),
    )
    return ContainerGrant(replica_ids=replica_ids, share=share, envs=envs, mounts=mounts, cdi_devices=cdi)


# --- the daemon ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonLaunch:
    argv: tuple[str, ...]
    env: dict[str, str]
    unset: tuple[str, ...] = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    """Inherited variables the daemon must not see: it must not be able to speak for the agent to systemd."""

    def environment(self, inherited: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in inherited.items() if k not in self.unset} | self.env


def multi_user_server(resource: ResourcePlan, offered: bool | None, control_bin: str) -> bool:
    """Whether the daemon runs one MPS server for every user (`-M`): without it, a client of another user than
    the running server's waits until every client of that server has left. `offered`: whether the binary's `-h`
    lists the option (None: it could not be asked; starting it will say why)."""
    if resource.multi_user is MultiUser.OFF:
        return False
    if resource.multi_user is MultiUser.ON and offered is False:
        raise ConfigError(
            "sharing.mps.multiUser",
            f"is true, but `{control_bin} -h` does not list --multiuser-server (driver 580's control binary has "
            "it, 535's does not); use auto (multi-user where offered) or false, or a control binary that offers it",
        )
    return resource.multi_user is MultiUser.ON or bool(offered)


def daemon_launch(resource: ResourcePlan, control_bin: str, *, multi_user: bool) -> DaemonLaunch:
    """How the resource's control daemon is started: in the foreground (so the agent sees it exit at once), for
    the resource's GPUs only, with one server for every user when `multi_user`."""
    return DaemonLaunch(
        argv=(control_bin, "-f", *(("-M",) if multi_user else ())),
        env={
            "CUDA_VISIBLE_DEVICES": resource.visible_devices,
            "CUDA_MPS_PIPE_DIRECTORY": str(resource.pipe_directory),
            "CUDA_MPS_LOG_DIRECTORY": str(resource.log_directory),
        },
    )
