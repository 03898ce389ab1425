"""Reconciling the ledger with what the kubelet's pod-resources API lists: plain decisions on plain data.

The kubelet never tells a device plugin that a container ended, and after a node reboot it re-uses checkpointed
allocations without calling Allocate. Its pod-resources listing is therefore the truth the ledger converges to:
- a listed container whose replicas the ledger holds as one grant names that grant's owner;
- a listed container the ledger does not know (or knows split differently) is adopted as a grant of its own;
- a grant no container lists is released, but only once it has been missing for the grace period, because a pod
  admitted a moment ago may not be listed yet. The grace clock starts no earlier than the grant itself (a listing
  taken before an Allocate cannot show its grant), so every grant is given at least one full grace period.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mpsagent.devices import ContainerRef, ReplicaId
from mpsagent.ledger import Grant, Ledger
from mpsagent.shares import Share


@dataclass(frozen=True, kw_only=True, slots=True)
class ListedDevices:
    """One container's device IDs of one resource, as one entry of the kubelet's listing."""

    container: ContainerRef
    device_ids: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Holding:
    """The replicas one container holds, after deduplication across the whole listing."""

    container: ContainerRef
    replica_ids: tuple[ReplicaId, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconcileResult:
    identified: tuple[Grant, ...] = ()
    """Grants whose owner became known."""
    adopted: tuple[Grant, ...] = ()
    replaced: tuple[Grant, ...] = ()
    """Grants ended because the kubelet lists their replicas grouped differently."""
    released: tuple[Grant, ...] = ()
    missing: int = 0
    """Grants not listed, still inside the grace period."""

    @property
    def ledger_changed(self) -> bool:
        return bool(self.adopted or self.replaced or self.released)


def holdings(listing: Iterable[ListedDevices]) -> list[Holding]:
    """Group the listing by container, each ID counted once: the first container to list an ID holds it.

    The kubelet lists a pod's init containers with the devices its app containers then re-use, so an ID can
    appear more than once; duplicates within one container are dropped too.
    """
    owner: dict[str, ContainerRef] = {}
    for entry in listing:
        for device_id in entry.device_ids:
            owner.setdefault(device_id, entry.container)
    grouped: dict[ContainerRef, list[ReplicaId]] = {}
    for device_id, container in owner.items():
        grouped.setdefault(container, []).append(ReplicaId(device_id))
    return [Holding(container=c, replica_ids=tuple(ids)) for c, ids in grouped.items()]


def reconcile(
    ledger: Ledger,
    listed: Sequence[Holding],
    *,
    now: float,
    grace_s: float,
    share_of: Callable[[tuple[ReplicaId, ...]], Share],
) -> ReconcileResult:
    """Bring the ledger to the listing; `now` is monotonic time, `share_of` gives an adopted grant its share."""
    identified: list[Grant] = []
    adopted: list[Grant] = []
    replaced: list[Grant] = []
    seen: set[int] = set()
    for holding in listed:
        holders = {grant.grant_id: grant for r in holding.replica_ids if (grant := ledger.holder(r)) is not None}
        match = next(iter(holders.values())) if len(holders) == 1 else None
        if match is not None and set(match.replica_ids) == set(holding.replica_ids):
            if match.missing_since is not None:
                match.missing_since = None
                ledger.note_change()
            if match.owner != holding.container:
                match.owner = holding.container
                ledger.note_change()
                identified.append(match)
            seen.add(match.grant_id)
            continue
        result = ledger.adopt(holding.replica_ids, share_of(holding.replica_ids), holding.container)
        replaced.extend(result.ended)
        adopted.append(result.grant)
        seen.add(result.grant.grant_id)

    expired: list[int] = []
    missing = 0
    for grant in ledger.live_grants():
        if grant.grant_id in seen:
            continue
        if grant.missing_since is None:
            grant.missing_since = max(now, grant.granted_monotonic)
            ledger.note_change()
        if now - grant.missing_since >= grace_s:
            expired.append(grant.grant_id)
        else:
            missing += 1
    return ReconcileResult(
        identified=tuple(identified),
        adopted=tuple(adopted),
        replaced=tuple(replaced),
        released=ledger.release(expired),
        missing=missing,
    )
