"""The plan: config + GPUs -> the resources to advertise, each with its GPUs, device IDs, paths and share model.

Pure functions only. What follows from a resource's plan has a home of its own: a grant's environment in
`container`, the daemon's commands and start in `mps.commands`, the node labels in `nfd`. `Allocate`, the daemon
supervisor and `--once` all start from this plan, so the dry run shows exactly what the running agent does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mpsagent.base.devices import Gpu, GpuUuid, NodeGpus, ReplicaId, ResourceName, format_replica_id
from mpsagent.base.errors import ConfigError, shown
from mpsagent.base.values import (
    MAX_CLIENTS_PER_GPU,
    MAX_CLIENTS_PER_GPU_BEFORE_VOLTA,
    MIB,
    AllocationPolicy,
    DeviceIdStrategy,
    DeviceListStrategy,
    MultiUser,
    ResourceSpec,
    SharingConfig,
)
from mpsagent.base.words import counted
from mpsagent.domain.shares import GpuSlots, ShareModel

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
    device_list_strategy: DeviceListStrategy
    device_id_strategy: DeviceIdStrategy
    allocation_policy: AllocationPolicy
    shares: ShareModel = field(compare=False)
    """How its IDs turn into shares; it also says whether the daemon enforces caps and a memory unit's size."""
    multi_user: MultiUser = MultiUser.AUTO

    @property
    def enforce_caps(self) -> bool:
        return self.shares.enforce

    @property
    def memory_unit_bytes(self) -> int | None:
        """Memory per device ID for a memory-unit resource; None for replicas."""
        return self.shares.unit_bytes

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
    def visible_devices(self) -> str:
        """CUDA_VISIBLE_DEVICES for the daemon: the resource's GPUs, so that it numbers them from 0."""
        return ",".join(gpu.uuid for gpu in self.gpus)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePlan:
    driver_version: str
    gpu_source: str
    gpus: tuple[Gpu, ...]
    resources: tuple[ResourcePlan, ...]
    mps_root: Path

    @property
    def shm_directory(self) -> Path:
        return self.mps_root / "shm"


# --- building the plan ------------------------------------------------------------------------------------


def _reference_key(ref: int | str) -> str:
    """A device reference as `_select_gpus` looks it up: a GPU UUID, or an index in decimal without leading zeros
    (compared as text: a string of thousands of digits is no index, and no reason to convert it)."""
    if isinstance(ref, int):
        return str(ref)
    return (ref.lstrip("0") or "0") if ref.isascii() and ref.isdigit() else ref


def mps_client_limit(gpu: Gpu) -> int:
    """How many MPS clients the GPU's server takes: 48 from Volta on, 16 before."""
    return MAX_CLIENTS_PER_GPU if gpu.compute_capability >= (7, 0) else MAX_CLIENTS_PER_GPU_BEFORE_VOLTA


def _select_gpus(spec: ResourceSpec, gpus: tuple[Gpu, ...]) -> tuple[Gpu, ...]:
    path = f"{spec.path}.devices"
    if spec.devices == "all":
        return gpus
    if isinstance(spec.devices, int):
        if spec.devices > len(gpus):
            raise ConfigError(path, f"asks for {counted(spec.devices, 'GPU')} but this node has {len(gpus)}")
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
        if (spec.replicas or 0) > (limit := mps_client_limit(gpu)):
            raise ConfigError(
                f"{spec.path}.replicas",
                f"GPU {gpu.index} has compute capability {gpu.compute_capability_text}, where MPS allows at most "
                f"{limit} clients; {spec.replicas} is too many",
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
                id_count=count,
                max_clients=mps_client_limit(gpu),
            )
            for ordinal, (gpu, count) in enumerate(zip(gpus, ids, strict=True))
        ),
        rule=sharing.grants,
        unit_bytes=spec.memory_unit_bytes,
        enforce=sharing.enforce_caps,
    )


def _check_caps(spec: ResourceSpec, gpus: tuple[Gpu, ...], shares: ShareModel) -> None:
    """Refuse replicas that would cap a GPU's memory at 0 MiB: MPS reads a limit of 0 as none at all (and the
    daemon's read-back then prints nothing, so no capped Allocate could ever succeed)."""
    if spec.replicas is None:
        return  # a memory unit is at least 1 MiB
    for gpu, mib in zip(gpus, shares.smallest_caps().memory_mib, strict=True):
        if mib < 1:
            raise ConfigError(
                f"{spec.path}.replicas",
                f"gives GPU {gpu.index} ({gpu.uuid}, {gpu.memory_mib} MiB) a memory cap of 0 MiB for one replica, "
                f"which MPS reads as no limit at all; use at most {gpu.memory_mib} replicas, or leave the GPU out of "
                "this resource",
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
        shares = _share_model(spec, sharing, gpus, ids)
        _check_caps(spec, gpus, shares)
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
                device_list_strategy=sharing.device_list_strategy,
                device_id_strategy=sharing.device_id_strategy,
                allocation_policy=sharing.allocation_policy,
                shares=shares,
                multi_user=sharing.multi_user,
            )
        )
    return NodePlan(
        driver_version=node.driver_version,
        gpu_source=node.source,
        gpus=node.gpus,
        resources=tuple(resources),
        mps_root=mps_root,
    )
