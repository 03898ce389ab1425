"""A DRA claim's share of each GPU, decided from its allocation; and the node's ResourceSlice.

Pure and synchronous. The node publishes one device per shared GPU (`node_slice`): consumable `memory` (the whole
GPU by default, so that a claim asking no capacity gets the whole GPU) and `compute` (per cent of the SMs, 0 by
default: "in proportion to the memory"). For each device the scheduler allocated a claim, `claim_shares` gives the
share: a memory cap of exactly the memory consumed, threads = the compute consumed or in proportion to the memory,
uncapped when that is all of the GPU; plus the claim's opaque parameters, checked. A refusal raises RequestError
naming the claim and what is wrong, before anything is held.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from mpsagent.base.devices import Gpu, GpuUuid
from mpsagent.base.errors import RequestError, shown
from mpsagent.base.values import MIB
from mpsagent.base.words import counted
from mpsagent.domain.accounting import ClaimCapacity
from mpsagent.domain.claims import (
    DEVICE_NAME_PREFIX,
    DRA_DRIVER,
    FULL_COMPUTE,
    MEMORY_STEP_BYTES,
    CapacityPolicy,
    ClaimAllocation,
    ClaimDevice,
    DeviceTaint,
    NodeSlice,
    OpaqueConfig,
    SliceDevice,
)
from mpsagent.domain.container import ContainerEdits, share_edits
from mpsagent.domain.plan import NodePlan, ResourcePlan, mps_client_limit
from mpsagent.domain.shares import Share

PARAMETERS_API_VERSION = f"{DRA_DRIVER}/v1alpha1"
PARAMETERS_KIND = "MpsShareConfig"
ENV_CLIENT_PRIORITY = "CUDA_MPS_CLIENT_PRIORITY"
CLIENT_PRIORITIES = (0, 1)
"""MPS's client priorities: 0 normal (the default), 1 below normal."""
_SEMVER_PARTS = 3


def device_name(gpu: Gpu) -> str:
    return f"{DEVICE_NAME_PREFIX}{gpu.index}"


def _semver(version: str) -> str:
    """A driver version (`580.65.06`) as the semantic version a `version` attribute must be (`580.65.6`)."""
    parts = [str(int(p)) for p in version.split(".") if p.isascii() and p.isdigit()][:_SEMVER_PARTS]
    return ".".join(parts + ["0"] * (_SEMVER_PARTS - len(parts))) if parts else "0.0.0"


def whole_memory(gpu: Gpu) -> int:
    """A GPU's memory as its device offers it: in whole MiB, in bytes."""
    return gpu.memory_bytes // MEMORY_STEP_BYTES * MEMORY_STEP_BYTES


def memory_capacity(free_bytes: int) -> CapacityPolicy:
    """A device's `memory`: what the claims may take of it (its GPU's memory less the device-plugin grants'), in MiB
    steps, all of it by default (a claim that asks no capacity gets what is left: the whole GPU when no grant holds
    any of it)."""
    return CapacityPolicy(
        value=free_bytes, default=free_bytes, minimum=MEMORY_STEP_BYTES, maximum=free_bytes, step=MEMORY_STEP_BYTES
    )


def compute_capacity(free: int) -> CapacityPolicy:
    """A device's `compute`: per cent of the SMs the claims may take (100 less the device-plugin grants'); a claim
    that asks none consumes 0 and gets threads in proportion to its memory."""
    return CapacityPolicy(value=free, default=0, minimum=0, maximum=free, step=1)


def clients_capacity(free: int) -> CapacityPolicy:
    """A device's `clients`: the MPS clients the claims may be (its server's limit less the device-plugin grants');
    every claim consumes exactly one (the policy's default and only value), asked or not."""
    return CapacityPolicy(value=free, default=1, minimum=1, maximum=1, step=1)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceRoom:
    """What one GPU's device offers the claims now: what the device-plugin grants leave of its memory, SMs and MPS
    clients, and its taints."""

    capacity: ClaimCapacity
    taints: tuple[DeviceTaint, ...] = ()


def node_slice(plan: NodePlan, node: str, room: Mapping[GpuUuid, DeviceRoom] | None = None) -> NodeSlice:
    """The ResourceSlice of the node: every GPU of a shared resource, one device each, in host-index order, offering
    what `room` says of it (default: the whole GPU, untainted: the dry run, or no grant yet)."""
    devices = []
    for resource in plan.resources:
        for gpu in resource.gpus:
            offered = (room or {}).get(gpu.uuid)
            whole = ClaimCapacity(
                memory_mib=whole_memory(gpu) // MEMORY_STEP_BYTES, compute=FULL_COMPUTE, clients=mps_client_limit(gpu)
            )
            left = whole if offered is None else offered.capacity
            devices.append(
                SliceDevice(
                    name=device_name(gpu),
                    uuid=gpu.uuid,
                    index=gpu.index,
                    product_name=gpu.name,
                    compute_capability=f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}.0",
                    driver_version=_semver(plan.driver_version),
                    resource=resource.name,
                    memory=memory_capacity(min(left.memory_mib * MEMORY_STEP_BYTES, whole_memory(gpu))),
                    compute=compute_capacity(left.compute),
                    clients=clients_capacity(left.clients),
                    taints=() if offered is None else offered.taints,
                )
            )
    return NodeSlice(driver=DRA_DRIVER, node=node, pool=node, devices=tuple(sorted(devices, key=lambda d: d.index)))


# --- a claim's parameters ----------------------------------------------------------------------------------


class ShareParameters(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """The opaque parameters of this driver (`MpsShareConfig`); unknown fields are refused."""

    api_version: str
    kind: str
    client_priority: int | None = None


def share_parameters(configs: Sequence[OpaqueConfig], request: str, claim: str) -> ShareParameters | None:
    """The parameters that apply to `request`: the class's, then the claim's, a later value over an earlier."""
    chosen: ShareParameters | None = None
    base_request = request.partition("/")[0]
    for config in configs:
        if config.requests and request not in config.requests and base_request not in config.requests:
            continue
        where = f"claim {claim}: the opaque parameters from the {config.source}"
        try:
            parameters = msgspec.json.decode(config.parameters, type=ShareParameters)
        except msgspec.ValidationError as exc:
            raise RequestError(f"{where} are not an {PARAMETERS_KIND}: {shown(str(exc))}") from None
        except msgspec.DecodeError:
            raise RequestError(f"{where} are not JSON") from None
        if parameters.api_version != PARAMETERS_API_VERSION or parameters.kind != PARAMETERS_KIND:
            raise RequestError(
                f"{where} are `{shown(parameters.api_version)}` `{shown(parameters.kind)}`; this driver reads "
                f"apiVersion {PARAMETERS_API_VERSION}, kind {PARAMETERS_KIND}"
            )
        if parameters.client_priority is not None and parameters.client_priority not in CLIENT_PRIORITIES:
            raise RequestError(
                f"{where}: clientPriority must be 0 (normal) or 1 (below normal), not {parameters.client_priority}"
            )
        if chosen is None or parameters.client_priority is not None:
            chosen = parameters
    return chosen


# --- a claim's shares --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaimShare:
    """What one allocated device of a claim gets: its GPU's resource, the share, and the container's edits."""

    device: ClaimDevice
    resource: ResourcePlan
    gpu: Gpu
    share: Share
    edits: ContainerEdits

    @property
    def rounded_off_bytes(self) -> int:
        """The allocated memory below a whole MiB: the cap is the allocation rounded down to whole MiB."""
        return 0 if self.device.memory_bytes is None else self.device.memory_bytes % MIB


def _memory_mib(device: ClaimDevice, gpu: Gpu, claim: str) -> int:
    whole = whole_memory(gpu)
    if device.memory_bytes is None:
        return whole // MIB
    if not MEMORY_STEP_BYTES <= device.memory_bytes <= whole:
        raise RequestError(
            f"claim {claim}: device {device.device} was allocated {counted(device.memory_bytes, 'byte')} of memory; "
            f"its GPU has 1Mi to {whole // MIB}Mi to give"
        )
    return device.memory_bytes // MIB


def _thread_percentage(device: ClaimDevice, gpu: Gpu, memory_mib: int, claim: str) -> int:
    if device.compute is not None and not 0 <= device.compute <= FULL_COMPUTE:
        raise RequestError(
            f"claim {claim}: device {device.device} was allocated compute {shown(device.compute)}; it must be from 0 "
            f"to {FULL_COMPUTE} (per cent of the SMs)"
        )
    if device.compute:
        return device.compute
    return max(1, FULL_COMPUTE * memory_mib // (whole_memory(gpu) // MIB))


def claim_shares(plan: NodePlan, allocation: ClaimAllocation, node: str) -> tuple[ClaimShare, ...]:
    """Each allocated device's share; raises RequestError naming the claim and what is wrong."""
    claim = str(allocation.claim)
    if not allocation.devices:
        raise RequestError(f"claim {claim} has no device of driver {DRA_DRIVER} on node {node} in its allocation")
    by_name = {device_name(gpu): (resource, gpu) for resource in plan.resources for gpu in resource.gpus}
    shares = []
    for device in allocation.devices:
        placed = by_name.get(device.device) if device.pool == node else None
        if placed is None:
            published = ", ".join(sorted(by_name)) or "none"
            raise RequestError(
                f"claim {claim}: device `{shown(device.device)}` of pool `{shown(device.pool)}` is not one this node "
                f"publishes (pool {node}: {published}); the ResourceSlice it was allocated from is out of date"
            )
        resource, gpu = placed
        memory_mib = _memory_mib(device, gpu, claim)
        threads = _thread_percentage(device, gpu, memory_mib, claim)
        ordinal = resource.shares.ordinal_of(gpu.uuid)
        assert ordinal is not None  # `by_name` holds the resource's own GPUs
        share = resource.shares.capacity_share(ordinal, memory_mib, threads, compute=device.compute or 0)
        parameters = share_parameters(allocation.configs, device.request, claim)
        edits = share_edits(resource, share, plan.shm_directory)
        if parameters is not None and parameters.client_priority is not None:
            edits.envs[ENV_CLIENT_PRIORITY] = str(parameters.client_priority)
        shares.append(ClaimShare(device=device, resource=resource, gpu=gpu, share=share, edits=edits))
    return tuple(shares)
