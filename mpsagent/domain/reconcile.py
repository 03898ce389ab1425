"""Reconciling the ledger with what the kubelet's pod-resources API lists: plain decisions on plain data.

The kubelet never tells a device plugin that a container ended, and after a node reboot it re-uses checkpointed
allocations without calling Allocate. Its pod-resources listing is therefore the truth the ledger converges to:
- the containers of a pod that list the same IDs are one listed grant: the kubelet hands the IDs of a pod's init
  containers on to its later containers (its devicemanager's "devices to reuse"), and lists a pod's (restartable)
  init containers before its app containers, so both can list them; the listed grant is the last one's, and its share
  covers each of theirs (`ShareModel.joined`), so that no listing lowers the ceilings below a live container's share;
- a listed grant whose replicas (and share) the ledger holds as one grant names that grant's owner;
- a listed grant the ledger does not know (or knows split differently) is adopted as a grant of its own (one
  naming IDs the resource does not advertise, an older configuration's, as the smallest share: `unplaced`);
- a grant no container lists is released, but only once it has been missing for the grace period, because a pod
  admitted a moment ago may not be listed yet. The grace clock starts no earlier than the grant itself (a listing
  taken before an Allocate cannot show its grant), so every grant is given at least one full grace period. A DRA
  claim's share is not the listing's to end (its unprepare is).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mpsagent.base.devices import ContainerRef, ReplicaId
from mpsagent.domain.ledger import Grant, Ledger
from mpsagent.domain.shares import Share, ShareModel


@dataclass(frozen=True, kw_only=True, slots=True)
class ListedDevices:
    """One container's device IDs of one resource, as one entry of the kubelet's listing."""

    container: ContainerRef
    device_ids: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ListedGrant:
    """A grant as the kubelet's listing shows it: the replicas one container holds, after deduplication across the
    whole listing, with those of the earlier containers of its pod that list some of them too."""

    container: ContainerRef
    replica_ids: tuple[ReplicaId, ...]
    members: tuple[tuple[ReplicaId, ...], ...] = ()
    """Each container's own IDs, in the kubelet's order (`container` last), when several containers of the pod list
    some of the same IDs; empty when `container` alone holds them."""

    def share(self, shares: ShareModel) -> Share:
        """What the listed grant needs from the ceilings: its container's share, or one that covers each member's."""
        if len(self.members) < 2:
            return shares.share_of(self.replica_ids)
        return shares.joined([shares.share_of(member) for member in self.members])


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconcileResult:
    identified: tuple[Grant, ...] = ()
    """Grants whose owner became known."""
    adopted: tuple[Grant, ...] = ()
    replaced: tuple[Grant, ...] = ()
    """Grants ended because the kubelet lists their replicas grouped differently."""
    released: tuple[Grant, ...] = ()
    unplaced: tuple[Grant, ...] = ()
    """Adopted grants naming IDs the resource does not advertise (an older configuration's): the smallest share."""
    missing: int = 0
    """Grants not listed, still inside the grace period."""
    next_release_at: float | None = None
    """When (monotonic) the first of those reaches the end of its grace period: the lookup that can release it."""

    @property
    def ledger_changed(self) -> bool:
        return bool(self.adopted or self.replaced or self.released)


def listed_grants(listing: Iterable[ListedDevices]) -> list[ListedGrant]:
    """Group the listing into listed grants, each ID counted once.

    An ID belongs to the first pod that lists it (the kubelet never lists one in two pods). Within a pod, containers
    that list a common ID are one listed grant, of the last of them in the kubelet's order (its init containers come
    first: the later container is the one that re-uses their IDs); a container's duplicates are dropped.
    """
    pod_of: dict[str, tuple[str, str]] = {}
    containers: dict[ContainerRef, dict[ReplicaId, None]] = {}
    for entry in listing:
        pod = (entry.container.namespace, entry.container.pod)
        held = containers.setdefault(entry.container, {})
        for device_id in entry.device_ids:
            if pod_of.setdefault(device_id, pod) == pod:
                held[ReplicaId(device_id)] = None
    by_pod: dict[tuple[str, str], list[tuple[ContainerRef, tuple[ReplicaId, ...]]]] = {}
    for container, held in containers.items():
        if held:
            by_pod.setdefault((container.namespace, container.pod), []).append((container, tuple(held)))
    return [listed for members in by_pod.values() for listed in _pod_listed_grants(members)]


def _pod_listed_grants(containers: Sequence[tuple[ContainerRef, tuple[ReplicaId, ...]]]) -> list[ListedGrant]:
    """One pod's containers, in the kubelet's order, grouped by the IDs they share."""
    group_of: dict[ReplicaId, int] = {}
    groups: list[list[int]] = []
    for position, (_, ids) in enumerate(containers):
        joined = sorted({group_of[r] for r in ids if r in group_of})
        target = joined[0] if joined else len(groups)
        if not joined:
            groups.append([])
        for other in joined[1:]:
            groups[target] += groups[other]
            for merged in groups[other]:
                group_of.update(dict.fromkeys(containers[merged][1], target))
            groups[other] = []
        groups[target].append(position)
        group_of.update(dict.fromkeys(ids, target))
    result = []
    for group in groups:
        if not group:
            continue
        members = tuple(containers[position][1] for position in sorted(group))
        replica_ids = tuple(dict.fromkeys(r for ids in members for r in ids))
        holder = containers[max(group)][0]
        result.append(
            ListedGrant(container=holder, replica_ids=replica_ids, members=members if len(members) > 1 else ())
        )
    return result


def reconcile(
    ledger: Ledger,
    listed: Sequence[ListedGrant],
    *,
    now: float,
    grace_s: float,
    shares: ShareModel,
) -> ReconcileResult:
    """Bring the ledger to the listing; `now` is monotonic time, `shares` gives a listed grant its share."""
    identified: list[Grant] = []
    adopted: list[Grant] = []
    replaced: list[Grant] = []
    unplaced: list[Grant] = []
    seen: set[int] = set()
    for entry in listed:
        share = entry.share(shares)
        match = _held_as_listed(ledger, entry, share)
        if match is not None:
            if ledger.mark_listed(match, entry.container):
                identified.append(match)
            seen.add(match.grant_id)
            continue
        result = ledger.adopt(entry.replica_ids, share, entry.container)
        replaced.extend(result.ended)
        adopted.append(result.grant)
        if not all(shares.advertises(replica) for replica in entry.replica_ids):
            unplaced.append(result.grant)
        seen.add(result.grant.grant_id)
    expired, missing, next_release_at = _unlisted(ledger, seen, now=now, grace_s=grace_s)
    return ReconcileResult(
        identified=tuple(identified),
        adopted=tuple(adopted),
        replaced=tuple(replaced),
        released=ledger.release(expired),
        unplaced=tuple(unplaced),
        missing=missing,
        next_release_at=next_release_at,
    )


def _held_as_listed(ledger: Ledger, entry: ListedGrant, share: Share) -> Grant | None:
    """The ledger's grant that alone holds the listed grant's replicas, all of them and no other, with its share."""
    holders = {grant.grant_id: grant for r in entry.replica_ids if (grant := ledger.holder(r)) is not None}
    match = next(iter(holders.values())) if len(holders) == 1 else None
    if match is not None and set(match.replica_ids) == set(entry.replica_ids) and match.share == share:
        return match
    return None


def _unlisted(ledger: Ledger, seen: set[int], *, now: float, grace_s: float) -> tuple[list[int], int, float | None]:
    """The listed route's grants the listing left out (`seen`: the IDs of those it showed): those whose grace
    period is over (to release), how many are still inside it, and when (monotonic) the first of those ends."""
    expired: list[int] = []
    missing = 0
    next_release_at: float | None = None
    for grant in ledger.listed_route():
        if grant.grant_id in seen:
            continue
        release_at = ledger.mark_unlisted(grant, now) + grace_s
        if now >= release_at:
            expired.append(grant.grant_id)
        else:
            missing += 1
            next_release_at = release_at if next_release_at is None else min(next_release_at, release_at)
    return expired, missing, next_release_at
