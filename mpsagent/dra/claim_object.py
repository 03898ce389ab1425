"""A ResourceClaim as the API server returned it, turned into the domain's `ClaimAllocation` within bounds: the
devices of this driver on this node with their consumed capacity, the driver's opaque configurations, the pods it
is reserved for. Plain functions over the API client's objects; the client (`api`) reads the claim and calls
`claim_allocation`. What the server returns is untrusted input: a claim that cannot be prepared as it stands is a
`ClaimRefusedError` that names it and what is wrong."""

from __future__ import annotations

import msgspec
from lightkube.models import resource_v1 as models

from mpsagent.base.config import quantity_value
from mpsagent.base.errors import ClaimRefusedError, shown
from mpsagent.base.words import listed
from mpsagent.domain.allocation import describe_ids
from mpsagent.domain.claims import CLIENTS, COMPUTE, MEMORY, ClaimAllocation, ClaimDevice, ClaimRef, OpaqueConfig

MAX_RESULTS = 128
"""Device results of this driver on this node in one claim (the API server allows 32 a claim)."""
MAX_CONFIGS = 32
"""Opaque configurations of this driver in one claim (the API server allows 32 a claim or class)."""
MAX_PARAMETERS_BYTES = 64 * 1024
"""An opaque configuration's parameters as JSON (the API server allows 10 KiB)."""
MAX_PODS = 256
"""The pods a claim is reserved for, as the API server bounds them."""
_SOURCES = {"FromClass": "class", "FromClaim": "claim"}
_CAPACITIES = (MEMORY, COMPUTE, CLIENTS)
"""The capacities the node's devices have, all a claim can consume of them (`clients`: one, always; the agent counts
one client a device whatever it says)."""


def _consumed_capacity(ref: ClaimRef, result: models.DeviceRequestAllocationResult) -> dict[str, object]:
    """The result's consumed capacity, by name; refused when it names a capacity the devices do not have (the
    scheduler consumes only what the device offers)."""
    consumed = result.consumedCapacity if isinstance(result.consumedCapacity, dict) else {}
    unknown = sorted(name for name in consumed if name not in _CAPACITIES)
    if unknown:
        raise ClaimRefusedError(
            str(ref),
            f"device {shown(result.device)}'s consumed capacity names {describe_ids(unknown)}, which the devices of "
            f"{result.driver} do not have (they have {listed(_CAPACITIES)}): the allocation was not made from "
            "the node's ResourceSlice",
        )
    return consumed


def _consumed(
    ref: ClaimRef, result: models.DeviceRequestAllocationResult, consumed: dict[str, object], name: str
) -> int | None:
    value = consumed.get(name)
    if value is None:
        return None
    amount = quantity_value(value) if isinstance(value, str) else None
    if amount is None:
        problem = "is not a quantity"
    elif amount < 0:
        problem = "is negative"
    elif amount.denominator != 1:  # memory is counted in bytes, compute in whole per cent: `500m` is neither
        problem = "is not a whole number of bytes" if name == MEMORY else "is not a whole per cent"
    else:
        return int(amount)
    raise ClaimRefusedError(str(ref), f"device {shown(result.device)}'s consumed {name} `{shown(value)}` {problem}")


def _claim_device(ref: ClaimRef, result: models.DeviceRequestAllocationResult) -> ClaimDevice:
    consumed = _consumed_capacity(ref, result)
    return ClaimDevice(
        request=result.request,
        pool=result.pool,
        device=result.device,
        share_id=result.shareID,
        memory_bytes=_consumed(ref, result, consumed, MEMORY),
        compute=_consumed(ref, result, consumed, COMPUTE),
    )


def _opaque_config(
    ref: ClaimRef, entry: models.DeviceAllocationConfiguration, opaque: models.OpaqueDeviceConfiguration
) -> OpaqueConfig:
    source = _SOURCES.get(entry.source, "claim")  # an unknown source is trusted no more than the claim's own
    parameters = msgspec.json.encode(opaque.parameters)
    if len(parameters) > MAX_PARAMETERS_BYTES:
        raise ClaimRefusedError(
            str(ref),
            f"the parameters of its {source} configuration for {opaque.driver} are {len(parameters)} bytes "
            f"of JSON, more than the {MAX_PARAMETERS_BYTES // 1024} KiB the agent reads",
        )
    return OpaqueConfig(requests=tuple(entry.requests or ()), parameters=parameters, source=source)


def reserved_pods(claim: models.ResourceClaim, ref: ClaimRef) -> tuple[str, ...] | None:
    """The pods (`namespace/name`) the claim is reserved for now; None when `claim` is not `ref`'s (its name was
    given to another claim since)."""
    if claim.metadata is None or claim.metadata.uid != ref.uid:
        return None
    return _pods(claim, ref.namespace)


def _pods(claim: models.ResourceClaim, namespace: str) -> tuple[str, ...]:
    reserved = (claim.status.reservedFor if claim.status else None) or []
    return tuple(f"{namespace}/{consumer.name}" for consumer in reserved[:MAX_PODS] if consumer.resource == "pods")


def _requests(claim: models.ResourceClaim) -> frozenset[str]:
    """The requests the claim asks, as an allocation result names them: `name`, and `name/sub` for each
    subrequest of a request with alternatives (`firstAvailable`)."""
    spec = claim.spec.devices if claim.spec else None
    names: set[str] = set()
    for request in ((spec.requests if spec else None) or ())[:MAX_RESULTS]:
        names.add(request.name)
        names.update(f"{request.name}/{sub.name}" for sub in (request.firstAvailable or ())[:MAX_RESULTS])
    return frozenset(names)


def claim_allocation(claim: models.ResourceClaim, ref: ClaimRef, *, driver: str, node: str) -> ClaimAllocation:
    """What `claim`, as the API server returned it, was allocated of `driver` on `node` (the pool named after it):
    its device results with their consumed capacity, the driver's opaque configurations (in the server's order:
    the class's, then the claim's), and the pods it is reserved for. No device of this driver and node is an
    empty `devices`: the caller decides.

    Raises ClaimRefusedError when the claim is not the one the kubelet named (another UID: deleted and
    re-created), is not allocated, names a request in its allocation that it does not ask or a consumed capacity
    that the devices do not have, or holds more than the agent reads."""
    uid = claim.metadata.uid if claim.metadata else None
    if uid != ref.uid:
        raise ClaimRefusedError(
            str(ref),
            f"has UID {shown(uid)}, the kubelet asked for {shown(ref.uid)}: it was deleted and re-created",
        )
    allocation = claim.status.allocation if claim.status else None
    if allocation is None:
        raise ClaimRefusedError(
            str(ref), "is not allocated (it has no status.allocation): the scheduler allocates it before the pod"
        )
    devices = allocation.devices or models.DeviceAllocationResult()
    results = [r for r in devices.results or () if r.driver == driver and r.pool == node]
    if len(results) > MAX_RESULTS:
        raise ClaimRefusedError(
            str(ref), f"has {len(results)} devices of {driver} on {node}, more than the {MAX_RESULTS} the agent reads"
        )
    asked = _requests(claim)
    for result in results:
        if result.request not in asked:
            raise ClaimRefusedError(
                str(ref),
                f"its allocation names request `{shown(result.request)}` (device {shown(result.device)}), which the "
                f"claim does not ask ({', '.join(sorted(asked)) or 'no request'}): the allocation is not this claim's",
            )
    configs = [(c, c.opaque) for c in devices.config or () if c.opaque is not None and c.opaque.driver == driver]
    if len(configs) > MAX_CONFIGS:
        raise ClaimRefusedError(
            str(ref), f"has {len(configs)} configurations for {driver}, more than the {MAX_CONFIGS} the agent reads"
        )
    return ClaimAllocation(
        claim=ref,
        devices=tuple(_claim_device(ref, result) for result in results),
        configs=tuple(_opaque_config(ref, entry, opaque) for entry, opaque in configs),
        pods=_pods(claim, ref.namespace),
    )
