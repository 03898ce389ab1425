"""The claim route's side of the node's grants: a DRA claim decided from its allocation (`claim_shares`), admitted
whole by the node's accounting on every GPU it names (`accounting.admit`: the same rule a device-plugin Allocate
meets), held in the ledgers of the resources whose daemons serve those GPUs, and released; a checkpointed claim
restored by the same rules; and what each GPU's device offers the claims now (`room`).

Pure and synchronous: the claim server reads the claim from the API server, calls `prepare`, then has the daemons
hold the ceilings and writes the CDI spec and checkpoint; on any failure there it calls `release`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpsagent.base.devices import GpuUuid, ResourceName
from mpsagent.base.errors import GrantRefusedError, RequestError
from mpsagent.base.values import TaintEffect
from mpsagent.domain.accounting import (
    ClaimCapacity,
    GpuProblem,
    GpuRefusal,
    RefusalKind,
    admit,
    claim_capacity,
    healthy,
)
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.claim_shares import ClaimShare, DeviceRoom, claim_shares, device_name
from mpsagent.domain.claims import (
    FULL_COMPUTE,
    TAINT_FULL,
    TAINT_NO_CLIENTS,
    TAINT_UNHEALTHY,
    ClaimAllocation,
    ClaimDevice,
    ClaimRef,
    DeviceTaint,
    PreparedClaim,
    PreparedDevice,
    cdi_device_id,
)
from mpsagent.domain.container import ContainerEdits, share_edits
from mpsagent.domain.ledger import Grant
from mpsagent.domain.plan import NodePlan
from mpsagent.domain.shares import Share

_NEXT_STEP = {
    RefusalKind.CLIENTS: "once a container on the GPU ends (the scheduler does not count MPS clients)",
    RefusalKind.MEMORY: "once the grants and claims on the GPU leave room for it (the device offered more when the "
    "scheduler allocated it: a device-plugin grant or a claim came first)",
    RefusalKind.COMPUTE: "once the grants and claims on the GPU leave room for it (the device offered more when the "
    "scheduler allocated it: a device-plugin grant or a claim came first)",
    RefusalKind.UNHEALTHY: "once the GPU is healthy again (its device is tainted: new claims go elsewhere)",
}


def claim_refused(claim: ClaimRef, refusal: GpuRefusal) -> GrantRefusedError:
    """A prepare the node's accounting refuses: the GPU's side of it, and what happens next."""
    return GrantRefusedError(
        f"claim {claim}: {refusal.reason}; nothing was prepared: the kubelet retries, and the claim is prepared "
        f"{_NEXT_STEP[refusal.kind]}",
        kind=refusal.kind.value,
        gpu=refusal.uuid,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class CdiDevice:
    """One of a prepared claim's devices as its CDI spec names it, and what a container using it gets."""

    name: str
    edits: ContainerEdits


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveClaim:
    """A claim prepared on this node and not yet unprepared: its checkpoint record, the ledger grants that hold its
    shares (by resource), and its CDI devices."""

    prepared: PreparedClaim
    grants: tuple[tuple[ResourceName, Grant], ...]
    cdi_devices: tuple[CdiDevice, ...]

    @property
    def resources(self) -> frozenset[ResourceName]:
        return frozenset(resource for resource, _ in self.grants)


def cdi_name(claim: ClaimRef, device: str, share_id: str | None) -> str:
    """Unique within the claim's spec: two requests of one claim can share a device (each its own share ID)."""
    return f"{claim.uid}-{device}" + (f"-{share_id}" if share_id else "")


class ClaimGrants:
    """Decides, holds and releases claims over the resources' allocators (one per resource, by name)."""

    def __init__(
        self,
        plan: NodePlan,
        allocators: Mapping[ResourceName, ResourceAllocator],
        node: str,
        *,
        problem: GpuProblem = healthy,
        unhealthy_effect: TaintEffect = TaintEffect.NO_SCHEDULE,
    ) -> None:
        """`problem`: why a GPU is unhealthy now (a claim on it is refused, and its device tainted with
        `unhealthy_effect`)."""
        self._plan = plan
        self._allocators = allocators
        self._node = node
        self._problem = problem
        self._unhealthy_effect = unhealthy_effect
        self._tainted_since: dict[tuple[str, GpuUuid], float] = {}
        """When each GPU's taint began (its `timeAdded`: the slice shows the same taint while it lasts)."""

    # --- a prepare, and its undo ----------------------------------------------------------------------------

    def prepare(self, allocation: ClaimAllocation, *, now: float) -> LiveClaim:
        """Decide the claim's share of each GPU it was allocated, admit them whole (every GPU healthy, within its
        memory, SMs and client limit beside the live shares of both routes), and hold them. Raises RequestError
        (GrantRefusedError when the accounting refuses) naming the claim and what is wrong; holds nothing then."""
        shares = claim_shares(self._plan, allocation, self._node)
        self._admit(allocation.claim, shares, problem=self._problem)
        return self._hold(_prepared(allocation, shares, now), shares)

    def release(self, live: LiveClaim) -> None:
        """Give the claim's shares back (its unprepare, or an undo)."""
        for resource, grant in live.grants:
            self._allocators[resource].ledger.release([grant.grant_id])

    def _admit(self, claim: ClaimRef, shares: Sequence[ClaimShare], *, problem: GpuProblem) -> None:
        by_resource: dict[ResourceName, list[Share]] = {}
        for share in shares:
            by_resource.setdefault(ResourceName(share.resource.name), []).append(share.share)
        for resource, added in sorted(by_resource.items()):
            allocator = self._allocators[resource]
            refusal = admit(allocator.resource.shares, allocator.ledger.tally, added, problem=problem)
            if refusal is not None:
                raise claim_refused(claim, refusal)

    def _hold(self, prepared: PreparedClaim, shares: Sequence[ClaimShare]) -> LiveClaim:
        grants = tuple(
            (
                resource,
                self._allocators[resource].ledger.hold_claim(prepared.claim, share.device.device, share.share),
            )
            for share in shares
            for resource in (ResourceName(share.resource.name),)
        )
        devices = tuple(
            CdiDevice(name=cdi_name(prepared.claim, share.device.device, share.device.share_id), edits=share.edits)
            for share in shares
        )
        return LiveClaim(prepared=prepared, grants=grants, cdi_devices=devices)

    # --- a restart -----------------------------------------------------------------------------------------

    def restore(self, prepared: PreparedClaim) -> LiveClaim:
        """Hold a checkpointed claim again, checked by the rules a fresh prepare meets (its devices the node's, its
        figures within its GPU, and beside the claims restored before it within every GPU's memory, SMs and client
        limit; a GPU's health is not asked: the claim's pods run already). Raises RequestError naming the rule."""
        shares = tuple(self._restored_share(prepared, index) for index in range(len(prepared.devices)))
        self._admit(prepared.claim, shares, problem=healthy)
        return self._hold(prepared, shares)

    def _restored_share(self, prepared: PreparedClaim, index: int) -> ClaimShare:
        device = prepared.devices[index]
        where = f"device {index} ({device.device})"
        allocator = self._allocators.get(ResourceName(device.resource))
        if allocator is None:
            raise RequestError(f"{where}: resource {device.resource} is not configured (any more)")
        gpu = next((gpu for gpu in allocator.resource.gpus if gpu.uuid == device.gpu), None)
        ordinal = allocator.resource.shares.ordinal_of(device.gpu)
        if gpu is None or ordinal is None:
            raise RequestError(f"{where}: GPU {device.gpu} is not one of {device.resource}'s")
        if device.device != device_name(gpu) or device.pool != self._node:
            raise RequestError(
                f"{where}: pool {device.pool} device {device.device} is not GPU {device.gpu}'s device "
                f"({self._node} {device_name(gpu)})"
            )
        whole = allocator.resource.shares.gpus[ordinal].memory_mib
        if not 1 <= device.memory_mib <= whole:
            raise RequestError(f"{where}: {device.memory_mib} MiB is outside the GPU's 1 to {whole} MiB")
        if not 1 <= device.thread_percentage <= FULL_COMPUTE or not 0 <= device.compute <= FULL_COMPUTE:
            raise RequestError(
                f"{where}: threads {device.thread_percentage} % or compute {device.compute} % outside 1 (0) to 100"
            )
        share = allocator.resource.shares.capacity_share(
            ordinal, device.memory_mib, device.thread_percentage, compute=device.compute
        )
        if share.kind is not device.kind:
            raise RequestError(f"{where}: marked {device.kind}, but its figures make it {share.kind}")
        # The environment without the claim's opaque parameters (the checkpoint has none): its CDI spec, written at
        # its prepare, is kept as it is.
        edits = share_edits(allocator.resource, share, self._plan.shm_directory)
        claim_device = _claim_device(device)
        return ClaimShare(device=claim_device, resource=allocator.resource, gpu=gpu, share=share, edits=edits)

    # --- what the node's devices offer -----------------------------------------------------------------------

    def room(self, *, now: float) -> dict[GpuUuid, DeviceRoom]:
        """Each GPU's device as the ResourceSlice offers it now: what the device-plugin grants leave of its memory
        and SMs, tainted while the GPU is unhealthy (the taint's time: when it became so) or has no memory left."""
        room = {}
        for allocator in self._allocators.values():
            shares, tally = allocator.resource.shares, allocator.ledger.tally
            for gpu in shares.gpus:
                capacity = claim_capacity(shares, tally, gpu.ordinal)
                room[gpu.uuid] = DeviceRoom(capacity=capacity, taints=self._taints(gpu.uuid, capacity, now))
        return room

    def _taints(self, uuid: GpuUuid, left: ClaimCapacity, now: float) -> tuple[DeviceTaint, ...]:
        problem = self._problem(uuid)
        # A GPU full of device-plugin grants only keeps new claims off: the claims already on it are within it.
        found = (
            (TAINT_UNHEALTHY, None if problem is None else _taint_value(problem), self._unhealthy_effect),
            (TAINT_FULL, "device-plugin-grants" if left.memory_mib < 1 else None, TaintEffect.NO_SCHEDULE),
            (TAINT_NO_CLIENTS, "device-plugin-grants" if left.clients < 1 else None, TaintEffect.NO_SCHEDULE),
        )
        taints = []
        for key, value, effect in found:
            if value is None:
                self._tainted_since.pop((key, uuid), None)
                continue
            since = self._tainted_since.setdefault((key, uuid), now)
            taints.append(DeviceTaint(key=key, value=value, effect=effect, added=since))
        return tuple(taints)


def _taint_value(problem: str) -> str:
    """A taint's value is a label value: at most 63 characters of [A-Za-z0-9_.-], from and to an alphanumeric."""
    value = "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "-" for c in problem)
    value = value[:63].strip("-_.")
    return value or "unhealthy"


def _prepared(allocation: ClaimAllocation, shares: Sequence[ClaimShare], now: float) -> PreparedClaim:
    ref = allocation.claim
    return PreparedClaim(
        claim=ref,
        devices=tuple(
            PreparedDevice(
                request=share.device.request,
                pool=share.device.pool,
                device=share.device.device,
                share_id=share.device.share_id,
                cdi_device_ids=(
                    cdi_device_id(cdi_name(ref, share.device.device, share.device.share_id)),
                    *share.edits.cdi_devices,
                ),
                resource=share.resource.name,
                gpu=share.gpu.uuid,
                memory_mib=share.share.gpus[0].memory_mib,
                thread_percentage=share.share.thread_percentage,
                kind=share.share.kind,
                rounded_off_bytes=share.rounded_off_bytes,
                compute=share.share.gpus[0].compute,
            )
            for share in shares
        ),
        pods=allocation.pods,
        prepared_at=now,
    )


def _claim_device(device: PreparedDevice) -> ClaimDevice:
    return ClaimDevice(request=device.request, pool=device.pool, device=device.device, share_id=device.share_id)
