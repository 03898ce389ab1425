"""The allocation ledger of one resource: who holds which replicas, and each grant's share (see mpsagent.domain.shares).

The kubelet is the authority on allocations: the ledger records, it never refuses. The kubelet hands out a replica
only once it is free, so a replica granted again means its earlier grant (the whole container) has ended.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mpsagent.base.devices import ContainerRef, ReplicaId
from mpsagent.domain.shares import GrantKind, Share, ShareTally


@dataclass(kw_only=True, slots=True)
class Grant:
    grant_id: int
    replica_ids: tuple[ReplicaId, ...]
    share: Share
    granted_at: float
    """Wall-clock time of the grant, for people."""
    granted_monotonic: float
    """Monotonic time of the grant: reconciliation's grace clock never starts before it."""
    superseded_ids: tuple[ReplicaId, ...] = ()
    owner: ContainerRef | None = None
    """The container holding the grant, once the kubelet's pod-resources API has listed it."""
    adopted: bool = False
    """Learned from the kubelet's listing rather than from an Allocate of this agent."""
    missing_since: float | None = None
    """Monotonic time of the first listing that no longer showed the grant (reconciliation's grace clock)."""

    @property
    def kind(self) -> GrantKind:
        return self.share.kind


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordResult:
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
    live_grants: dict[GrantKind, int] = field(default_factory=lambda: dict.fromkeys(GrantKind, 0))


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._wall = clock
        self._monotonic = monotonic
        self._ids = itertools.count(1)
        self._live: dict[int, Grant] = {}
        self._holder: dict[ReplicaId, int] = {}
        self._stats = LedgerStatistics()
        self._version = 0
        self.tally = ShareTally()
        """The live grants' shares, counted for ceilings and the client limit."""

    @property
    def version(self) -> int:
        """Moves whenever a grant is added, ended, or learns its owner or listing state: a cheap "changed?"."""
        return self._version

    def note_change(self) -> None:
        """Called by whoever updates a live grant's owner or listing state in place."""
        self._version += 1

    def record(self, replica_ids: tuple[ReplicaId, ...], share: Share) -> RecordResult:
        """Record an Allocate's grant."""
        result = self._add(replica_ids, share, owner=None)
        self._stats.grants[share.kind] += 1
        self._stats.regranted_replicas += len(result.grant.superseded_ids)
        return result

    def adopt(self, replica_ids: tuple[ReplicaId, ...], share: Share, owner: ContainerRef) -> RecordResult:
        """Record a grant the kubelet lists but this agent never saw allocated (made before it started)."""
        result = self._add(replica_ids, share, owner=owner)
        self._stats.adopted_grants += 1
        return result

    def _add(self, replica_ids: tuple[ReplicaId, ...], share: Share, owner: ContainerRef | None) -> RecordResult:
        ended_ids = {self._holder[r] for r in replica_ids if r in self._holder}
        ended = tuple(self._end(grant_id) for grant_id in sorted(ended_ids))
        self._stats.superseded_grants += len(ended)
        ended_replicas = {r for g in ended for r in g.replica_ids}
        regranted = tuple(r for r in replica_ids if r in ended_replicas)
        grant = Grant(
            grant_id=next(self._ids),
            replica_ids=replica_ids,
            share=share,
            granted_at=self._wall(),
            granted_monotonic=self._monotonic(),
            superseded_ids=regranted,
            owner=owner,
            adopted=owner is not None,
        )
        self._live[grant.grant_id] = grant
        self.tally.add(share)
        for replica in replica_ids:
            self._holder[replica] = grant.grant_id
        self._version += 1
        return RecordResult(grant=grant, ended=ended)

    def withdraw(self, result: RecordResult) -> None:
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
            self.tally.add(earlier.share)
            for replica in earlier.replica_ids:
                self._holder[replica] = earlier.grant_id
        self._stats.grants[grant.kind] -= 1
        self._stats.regranted_replicas -= len(grant.superseded_ids)
        self._stats.superseded_grants -= len(restored)
        self._version += 1

    def release(self, grant_ids: Iterable[int]) -> tuple[Grant, ...]:
        """End these grants (the containers that held them are gone)."""
        released = tuple(self._end(grant_id) for grant_id in sorted(set(grant_ids)) if grant_id in self._live)
        self._stats.released_grants += len(released)
        return released

    def _end(self, grant_id: int) -> Grant:
        self._version += 1
        grant = self._live.pop(grant_id)
        self.tally.remove(grant.share)
        for replica in grant.replica_ids:
            if self._holder.get(replica) == grant_id:
                del self._holder[replica]
        return grant

    def live_grants(self) -> tuple[Grant, ...]:
        return tuple(self._live.values())

    def holder(self, replica_id: ReplicaId) -> Grant | None:
        grant_id = self._holder.get(replica_id)
        return self._live[grant_id] if grant_id is not None else None

    def never_listed(self) -> int:
        """Live grants that no listing of the kubelet has shown yet (their container is not known)."""
        return sum(grant.owner is None for grant in self._live.values())

    def held_replicas(self) -> int:
        return len(self._holder)

    def live_shares(self) -> tuple[Share, ...]:
        return tuple(grant.share for grant in self._live.values())

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
            live_grants=live,
        )
