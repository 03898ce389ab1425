"""Per-resource request handling: checks kubelet requests, asks the ledger, builds each container's grant.

Plain synchronous code; the gRPC servicer translates messages to and from these calls. A refused request raises
RequestError before anything is recorded, so it changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from mpsagent.base.devices import GpuUuid, ReplicaId, gpu_of
from mpsagent.base.errors import GrantRefusedError, RequestError, shown
from mpsagent.domain.accounting import GpuProblem, GpuRefusal, Withheld, admit, healthy, withheld_replicas
from mpsagent.domain.container import ContainerEdits, ContainerSetup, MemoryLimitDevice, setup_of, share_edits
from mpsagent.domain.ledger import Ledger, Recorded
from mpsagent.domain.placement import preferred_replicas
from mpsagent.domain.plan import ResourcePlan
from mpsagent.domain.reconcile import ListedGrant, ReconcileResult, reconcile
from mpsagent.domain.shares import Ceilings, Share, ShareTally

MAX_NAMED_IDS = 3
MAX_KNOWN_EDITS = 4096


def describe_ids(ids: Sequence[str]) -> str:
    """Name the first few IDs and count the rest, so that a message stays well under a gRPC status's limit."""
    named = ", ".join(f"'{shown(i)}'" for i in ids[:MAX_NAMED_IDS])
    rest = len(ids) - MAX_NAMED_IDS
    return f"{named} and {rest} more" if rest > 0 else named


def size_error(resource: str, count: int) -> RequestError:
    """A request of more than one replica where the config allows one (the NVIDIA plugin's "maximum request size for
    shared resources is 1"). The kubelet asks GetPreferredAllocation first whenever more IDs are free than requested,
    so the operator mostly reads this in a rejected pod's status: it names the key that allows more."""
    return RequestError(
        f"{resource}: a request of {count} replicas is refused: sharing.mps.failRequestsGreaterThanOne is true "
        "(the default), which allows 1 per container; set it to false to allow more"
    )


def grant_refused(resource: str, refusal: GpuRefusal, asked: Sequence[str]) -> GrantRefusedError:
    """An Allocate the node's accounting refuses: the GPU's side of it, the IDs asked, and what the user can do."""
    return GrantRefusedError(
        f"{resource}: {refusal.reason}; nothing was granted (asked: {describe_ids(asked)}): ask for IDs of another "
        "GPU, or wait for a container or claim on it to end",
        kind=refusal.kind.value,
        gpu=refusal.uuid,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ContainerAllocation:
    """One container's part of an Allocate: what it is given (`setup`, the answer's content) and the ledger's
    record of it (`record`: the `ledger.Grant` and the earlier grants it showed ended)."""

    setup: ContainerSetup
    record: Recorded


class ResourceAllocator:
    """Answers Allocate and GetPreferredAllocation for one resource."""

    def __init__(
        self,
        resource: ResourcePlan,
        shm_directory: Path,
        ledger: Ledger | None = None,
        *,
        problem: GpuProblem = healthy,
    ) -> None:
        """`problem`: why a GPU of the resource is unhealthy now (None: healthy); a new share on it is refused."""
        self.resource = resource
        self.ledger = ledger or Ledger()
        self.problem = problem
        self._shm = shm_directory
        # Each advertised ID to itself: a request's IDs (new strings on every call) are checked and swapped for these in
        # one pass, so that the ledger's and the shares' lookups of them after that compare by identity.
        self._known: dict[str, ReplicaId] = {replica: replica for replica in resource.device_ids}
        self._edits: dict[int, tuple[Share, ContainerEdits]] = {}
        self._ceilings: tuple[ShareTally, int, Ceilings] | None = None
        """The ceilings of a tally, as of its `changes`."""
        replicas: dict[GpuUuid, list[ReplicaId]] = {gpu.uuid: [] for gpu in resource.gpus}  # host-index order
        for replica in resource.device_ids:  # one pass: set-up grows with the node's replicas, not their square
            replicas[gpu_of(replica)].append(replica)
        self._gpu_replicas = {uuid: tuple(ids) for uuid, ids in replicas.items()}
        # failRequestsGreaterThanOne is about replicas: a request of n memory units is the normal case.
        self._one_at_most = resource.fail_requests_greater_than_one and not resource.memory_units

    def _known_ids(self, ids: Sequence[str], what: str) -> tuple[ReplicaId, ...]:
        """The IDs deduplicated in their order, each the resource's own string; raises RequestError naming unknown
        ones."""
        unique = dict.fromkeys(ids)
        known = tuple(map(self._known.get, unique))
        if None in known:
            unknown = [i for i in unique if i not in self._known]
            raise RequestError(
                f"{self.resource.name}: unknown device ID{'s' if len(unknown) > 1 else ''} {describe_ids(unknown)}"
                f" in {what}; this resource advertises IDs of the form <GPU UUID>::<replica>"
            )
        return cast(tuple[ReplicaId, ...], known)  # checked: no None

    def check_request(self, ids: Sequence[str]) -> tuple[ReplicaId, ...]:
        """Deduplicate and check one container's IDs; raises RequestError naming what is wrong."""
        if not ids:
            raise RequestError(f"{self.resource.name}: a container request must name at least one device ID")
        unique = self._known_ids(ids, "the request")
        if self._one_at_most and len(unique) > 1:
            raise size_error(self.resource.name, len(unique))
        return unique

    def grant_for(self, ids: Sequence[str]) -> ContainerSetup:
        """What a container asking for these IDs would get; records nothing (the dry run calls this too)."""
        replica_ids = self.check_request(ids)
        return setup_of(replica_ids, (share := self._share_of(replica_ids)), self._edits_of(share))

    def _share_of(self, replica_ids: tuple[ReplicaId, ...]) -> Share:
        """The share of these checked IDs. The kubelet granting a container's IDs again: the live grant of exactly
        these IDs that an Allocate recorded has their share (not one adopted, whose share may be a pod's joined one),
        without counting them again."""
        earlier = self.ledger.holding(replica_ids)
        if earlier is not None and not earlier.adopted and earlier.claim is None:
            return earlier.share
        return self.resource.shares.share_of(replica_ids, distinct=True)

    def _edits_of(self, share: Share) -> ContainerEdits:
        """`share_edits` of a share, worked out once per share (the shares' model gives the same object for the same
        share, so they are kept by identity)."""
        known = self._edits.get(id(share))
        if known is not None and known[0] is share:
            return known[1]
        if len(self._edits) >= MAX_KNOWN_EDITS:
            self._edits.clear()
        edits = share_edits(self.resource, share, self._shm)
        self._edits[id(share)] = (share, edits)
        return edits

    def allocate(self, requests: Sequence[Sequence[str]]) -> list[ContainerAllocation]:
        """Check every container request, then record them all; a refusal records nothing."""
        grants = [self.grant_for(ids) for ids in requests]
        self._admit(grants)
        return [ContainerAllocation(setup=g, record=self.ledger.record(g.replica_ids, g.share)) for g in grants]

    def _admit(self, grants: Sequence[ContainerSetup]) -> None:
        """Refuse grants that do not fit their GPUs beside the live shares of both routes (`accounting.admit`),
        but those whose replicas they take over: live grants, and earlier containers of the same request (the
        kubelet hands an init container's IDs on to a later container), as recording them will end them."""
        ending = {holder.grant_id: holder for g in grants for holder in self.ledger.holders(g.replica_ids)}
        staying: list[ContainerSetup] = []
        for grant in grants:
            taken = set(grant.replica_ids)
            staying = [earlier for earlier in staying if taken.isdisjoint(earlier.replica_ids)]
            staying.append(grant)
        refusal = admit(
            self.resource.shares,
            self.ledger.tally,
            [g.share for g in staying],
            ending=[holder.share for holder in ending.values()],
            problem=self.problem,
        )
        if refusal is not None:
            raise grant_refused(self.resource.name, refusal, [i for g in grants for i in g.replica_ids])

    def withheld(self) -> tuple[Withheld, ...]:
        """Per GPU, the free IDs ListAndWatch must not offer: their share no longer fits beside the live ones."""
        found = []
        for gpu in self.resource.shares.gpus:
            free = [replica for replica in self._gpu_replicas[gpu.uuid] if self.ledger.holder(replica) is None]
            withheld = withheld_replicas(self.resource.shares, self.ledger.tally, gpu.ordinal, free)
            if withheld is not None:
                found.append(withheld)
        return tuple(found)

    def withdraw(self, allocations: Sequence[ContainerAllocation]) -> None:
        """Undo `allocate` (its answer was an error): the ledger is as it was before, as far as nothing else has
        changed it meanwhile (see Ledger.withdraw)."""
        for allocation in reversed(allocations):
            self.ledger.withdraw(allocation.record)

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[ReplicaId]:
        if size < 1:
            raise RequestError(f"{self.resource.name}: allocation size must be at least 1, not {size}")
        if self._one_at_most and size > 1:
            raise size_error(self.resource.name, size)
        return preferred_replicas(
            gpu_replicas=self._gpu_replicas,
            available=self._known_ids(available, "the available devices"),
            must_include=self._known_ids(must_include, "the devices that must be included"),
            size=size,
            policy=self.resource.allocation_policy,
            resource=self.resource.name,
            memory_units=self.resource.memory_units,
            equal_grants=self.resource.shares.equal,
            full_gpus=self.resource.shares.full_gpus(self.ledger.tally),
        )

    def memory_limit_devices(self) -> list[MemoryLimitDevice]:
        """The driver's memory-limit devices of the live grants (and claims) of the resource."""
        found = (self._edits_of(grant.share).memory_limits for grant in self.ledger.live_grants())
        return [device for device in found if device is not None]

    def ceilings(self) -> Ceilings:
        """The ceilings the resource's daemon must hold for the grants the ledger believes live (every Allocate asks:
        worked out again only when the live shares changed)."""
        tally = self.ledger.tally
        known = self._ceilings
        if known is None or known[0] is not tally or known[1] != tally.changes:
            known = self._ceilings = (tally, tally.changes, self.resource.shares.ceilings(tally))
        return known[2]

    def reconcile(self, listed: Sequence[ListedGrant], *, now: float, grace_s: float) -> ReconcileResult:
        """Bring the ledger to the kubelet's listing of this resource (see mpsagent.domain.reconcile)."""
        return reconcile(self.ledger, listed, now=now, grace_s=grace_s, shares=self.resource.shares)
