"""The allocation ledger of one resource: who holds which replicas, and each grant's share (see mpsagent.domain.shares).

The kubelet is the authority on allocations: the ledger records, it never refuses. The kubelet hands out a replica
only once it is free, so a replica granted again means its earlier grant (the whole container) has ended. The ledger
alone changes a grant, one method per change (record, withdraw, adopt, hold_claim, mark_listed, mark_unlisted,
release), each moving `version`.

A DRA claim's share of a GPU (`hold_claim`) is a grant too, so that the ceilings and MPS's client limit count both
routes; it holds no replica IDs, and only its claim's unprepare (or a restart's checkpoint) ends it: the kubelet's
pod-resources listing, which ends device-plugin grants, does not speak for it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mpsagent.base.devices import ContainerRef, ReplicaId
from mpsagent.domain.claims import ClaimRef
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.shares import Share, ShareTally


@dataclass(kw_only=True, slots=True)
class _Listing:
    """What the kubelet's listings have shown of a grant: the one part of a grant that changes, changed by the ledger
    alone (`Ledger.mark_listed`, `Ledger.mark_unlisted`)."""

    owner: ContainerRef | None = None
    missing_since: float | None = None


class _Hold:
    """What `Ledger._holder` maps each of a live grant's IDs to: one object per grant, naming it. A grant of exactly
    the IDs of one live grant (the kubelet granting a container's IDs again) takes that grant's hold over, one write
    for all its IDs; a full grant names hundreds."""

    __slots__ = ("grant_id",)

    def __init__(self, grant_id: int) -> None:
        self.grant_id = grant_id


@dataclass(frozen=True, kw_only=True, slots=True)
class Grant:
    """One grant of the ledger, read-only to everyone but the ledger."""

    grant_id: int
    replica_ids: tuple[ReplicaId, ...]
    share: Share
    granted_at: float
    """Wall-clock time of the grant, for people."""
    granted_monotonic: float
    """Monotonic time of the grant: reconciliation's grace clock never starts before it."""
    superseded_ids: tuple[ReplicaId, ...] = ()
    adopted: bool = False
    """Learned from the kubelet's listing rather than from an Allocate of this agent."""
    claim: ClaimRef | None = None
    """The DRA claim whose share of one GPU this is (`Ledger.hold_claim`); None for a device-plugin grant."""
    claim_device: str = ""
    """The claim's device (`gpu-0`) this share is of."""
    _listing: _Listing = field(default_factory=_Listing, compare=False)

    @property
    def kind(self) -> GrantKind:
        return self.share.kind

    @property
    def owner(self) -> ContainerRef | None:
        """The container holding the grant, once the kubelet's pod-resources API has listed it."""
        return self._listing.owner

    @property
    def missing_since(self) -> float | None:
        """Monotonic time of the first listing that no longer showed the grant (reconciliation's grace clock)."""
        return self._listing.missing_since


@dataclass(frozen=True, kw_only=True, slots=True)
class Recorded:
    """What recording one container's replicas did: the new grant, and the ones it ended."""

    grant: Grant
    ended: tuple[Grant, ...]
    """Earlier grants that this one shows to have ended (they held one of its replicas)."""


@dataclass(kw_only=True, slots=True)
class LedgerStatistics:
    grants: dict[GrantKind, int] = field(default_factory=lambda: dict.fromkeys(GrantKind, 0))
    regranted_replicas: int = 0
    superseded_grants: int = 0
    """Ended because a later grant (or the kubelet's listing) holds their replicas."""
    adopted_grants: int = 0
    released_grants: int = 0
    claim_grants: int = 0
    """DRA claims' shares held (`hold_claim`), all time."""
    live_grants: dict[GrantKind, int] = field(default_factory=lambda: dict.fromkeys(GrantKind, 0))


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._wall = clock
        self._monotonic = monotonic
        self._ids = itertools.count(1)
        self._live: dict[int, Grant] = {}
        self._holder: dict[ReplicaId, _Hold] = {}
        """Every ID a live grant holds, to that grant's hold: all of a live grant's IDs, and only those, name it."""
        self._stats = LedgerStatistics()
        self._version = 0
        self._tally = ShareTally()
        self._same: tuple[tuple[ReplicaId, ...], int, _Hold | None] | None = None
        """The last `_same_ids` answer: for these IDs (that very tuple), at this version."""

    @property
    def version(self) -> int:
        """Moves whenever a grant is added, ended, or learns its owner or listing state: a cheap "changed?"."""
        return self._version

    @property
    def tally(self) -> ShareTally:
        """The live grants' shares, counted for ceilings and the client limit (read it; the ledger keeps it)."""
        return self._tally

    def record(self, replica_ids: tuple[ReplicaId, ...], share: Share) -> Recorded:
        """Record an Allocate's grant: its distinct IDs, and the shares model's share of them (which the allocator
        reads back for a grant of the same IDs again, `holding`)."""
        result = self._add(replica_ids, share, owner=None)
        self._stats.grants[share.kind] += 1
        self._stats.regranted_replicas += len(result.grant.superseded_ids)
        return result

    def adopt(self, replica_ids: tuple[ReplicaId, ...], share: Share, owner: ContainerRef) -> Recorded:
        """Record a grant the kubelet lists but this agent never saw allocated (made before it started)."""
        result = self._add(replica_ids, share, owner=owner)
        self._stats.adopted_grants += 1
        return result

    def _add(self, replica_ids: tuple[ReplicaId, ...], share: Share, owner: ContainerRef | None) -> Recorded:
        """Record a grant of these (distinct) IDs, ending every live grant that holds any of them."""
        # Every Allocate runs this over its IDs (a node's full grant names hundreds): map and filter, not loops.
        grant_id = next(self._ids)
        same = self._same_ids(replica_ids)
        if same is not None:
            # The IDs of one live grant, granted again: it ends, and the new grant takes its hold over.
            earlier = self._live.pop(same.grant_id)
            self._version += 1
            if earlier.share is not share and earlier.share != share:
                self._tally.remove(earlier.share)
                self._tally.add(share)
            same.grant_id = grant_id
            ended: tuple[Grant, ...] = (earlier,)
            regranted = replica_ids
        else:
            # The new grant takes its IDs over below: ending the old ones need not let go of those first.
            taken_over = frozenset(replica_ids)
            held = {hold.grant_id for hold in map(self._holder.get, replica_ids) if hold is not None}
            ended = tuple(self._end(i, taken_over) for i in sorted(held))
            ended_replicas = set().union(*(g.replica_ids for g in ended))
            regranted = tuple(filter(ended_replicas.__contains__, replica_ids))
            self._tally.add(share)
            self._holder.update(dict.fromkeys(replica_ids, _Hold(grant_id)))
        self._stats.superseded_grants += len(ended)
        grant = Grant(
            grant_id=grant_id,
            replica_ids=replica_ids,
            share=share,
            granted_at=self._wall(),
            granted_monotonic=self._monotonic(),
            superseded_ids=regranted,
            adopted=owner is not None,
            _listing=_Listing(owner=owner),
        )
        self._live[grant_id] = grant
        self._version += 1
        return Recorded(grant=grant, ended=ended)

    def holding(self, replica_ids: tuple[ReplicaId, ...]) -> Grant | None:
        """The live grant whose IDs are exactly these (in any order), if one is."""
        same = self._same_ids(replica_ids)
        return self._live[same.grant_id] if same is not None else None

    def _same_ids(self, replica_ids: tuple[ReplicaId, ...]) -> _Hold | None:
        """The hold of the live grant whose IDs are exactly these (in any order), if one is. An Allocate asks this
        three times of one tuple (its share, the client limit, the record): asked again before the ledger changed,
        the answer is the one before."""
        known = self._same
        if known is not None and known[0] is replica_ids and known[1] == self._version:
            return known[2]
        same = self._find_same(replica_ids)
        self._same = (replica_ids, self._version, same)
        return same

    def _find_same(self, replica_ids: tuple[ReplicaId, ...]) -> _Hold | None:
        first = self._holder.get(replica_ids[0]) if replica_ids else None
        if first is None:
            return None
        earlier = self._live[first.grant_id].replica_ids
        if earlier == replica_ids:  # the same IDs in the same order: one comparison, by identity when they are its own
            return first
        count = len(earlier)
        if count != len(replica_ids) or set(map(self._holder.get, replica_ids)) != {first}:
            return None
        return first if count == len(set(replica_ids)) else None  # each of its IDs, none twice

    def hold_claim(self, claim: ClaimRef, device: str, share: Share) -> Grant:
        """Hold a prepared DRA claim's share of one GPU, until `release` (its unprepare)."""
        grant = Grant(
            grant_id=next(self._ids),
            replica_ids=(),
            share=share,
            granted_at=self._wall(),
            granted_monotonic=self._monotonic(),
            claim=claim,
            claim_device=device,
        )
        self._live[grant.grant_id] = grant
        self._tally.add(share)
        self._stats.claim_grants += 1
        self._version += 1
        return grant

    def withdraw(self, result: Recorded) -> None:
        """Undo an Allocate's `record`: the Allocate was answered with an error, so no container got the grant.

        The grant goes, and the grants it ended are live again, unless another grant took one of their replicas
        meanwhile (a grant that did is the kubelet's word again). A grant that something else ended meanwhile (a
        later grant, a release) stays as that left it. Withdraw several records latest first."""
        grant = result.grant
        if self._live.get(grant.grant_id) is not grant:
            return
        self._end(grant.grant_id)
        restored = [g for g in result.ended if all(r not in self._holder for r in g.replica_ids)]
        for earlier in restored:
            self._live[earlier.grant_id] = earlier
            self._tally.add(earlier.share)
            self._holder.update(dict.fromkeys(earlier.replica_ids, _Hold(earlier.grant_id)))
        self._stats.grants[grant.kind] -= 1
        self._stats.regranted_replicas -= len(grant.superseded_ids)
        self._stats.superseded_grants -= len(restored)
        self._version += 1

    def mark_listed(self, grant: Grant, owner: ContainerRef) -> bool:
        """A listing of the kubelet shows this live grant, held by `owner`: its grace clock stops and its owner is
        named. True when the owner is new (the grant is identified)."""
        listing = self._live_listing(grant)
        if listing.missing_since is not None:
            listing.missing_since = None
            self._version += 1
        if listing.owner == owner:
            return False
        listing.owner = owner
        self._version += 1
        return True

    def mark_unlisted(self, grant: Grant, now: float) -> float:
        """A listing of the kubelet no longer shows this live grant: its grace clock starts, at `now` (monotonic) but
        never before the grant, unless it runs already. Returns when it started."""
        listing = self._live_listing(grant)
        if listing.missing_since is None:
            listing.missing_since = max(now, grant.granted_monotonic)
            self._version += 1
        return listing.missing_since

    def _live_listing(self, grant: Grant) -> _Listing:
        if self._live.get(grant.grant_id) is not grant:
            raise ValueError(f"grant {grant.grant_id} is not live in this ledger")
        return grant._listing

    def release(self, grant_ids: Iterable[int]) -> tuple[Grant, ...]:
        """End these grants (the containers that held them are gone)."""
        released = tuple(self._end(grant_id) for grant_id in sorted(set(grant_ids)) if grant_id in self._live)
        self._stats.released_grants += len(released)
        return released

    def _end(self, grant_id: int, taken_over: frozenset[ReplicaId] = frozenset()) -> Grant:
        """End a live grant; its IDs in `taken_over` are about to be held by a new grant and are left to it."""
        self._version += 1
        grant = self._live.pop(grant_id)
        self._tally.remove(grant.share)
        holder = self._holder
        for replica in set(grant.replica_ids).difference(taken_over):
            hold = holder.get(replica)
            if hold is not None and hold.grant_id == grant_id:
                del holder[replica]
        return grant

    def live_grants(self) -> tuple[Grant, ...]:
        return tuple(self._live.values())

    def holders(self, replica_ids: Iterable[ReplicaId]) -> list[Grant]:
        """The live grants that hold any of these IDs, each once."""
        if isinstance(replica_ids, tuple) and (same := self._same_ids(replica_ids)) is not None:
            return [self._live[same.grant_id]]
        holds = dict.fromkeys(map(self._holder.get, replica_ids))
        return [self._live[hold.grant_id] for hold in holds if hold is not None]

    def holder(self, replica_id: ReplicaId) -> Grant | None:
        hold = self._holder.get(replica_id)
        return self._live[hold.grant_id] if hold is not None else None

    def listed_route(self) -> tuple[Grant, ...]:
        """The live device-plugin grants: those the kubelet's pod-resources listing speaks for (no claim's)."""
        return tuple(grant for grant in self._live.values() if grant.claim is None)

    def never_listed(self) -> int:
        """Live device-plugin grants that no listing of the kubelet has shown yet (their container is not known)."""
        return sum(grant.owner is None and grant.claim is None for grant in self._live.values())

    def statistics(self) -> LedgerStatistics:
        live = dict.fromkeys(GrantKind, 0)
        for grant in self._live.values():
            live[grant.kind] += 1
        return LedgerStatistics(
            grants=dict(self._stats.grants),
            regranted_replicas=self._stats.regranted_replicas,
            superseded_grants=self._stats.superseded_grants,
            adopted_grants=self._stats.adopted_grants,
            released_grants=self._stats.released_grants,
            claim_grants=self._stats.claim_grants,
            live_grants=live,
        )
