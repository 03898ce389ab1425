"""The allocation ledger of one resource: who holds which replicas, and whether any capped grant is live.

The kubelet is the authority on allocations: the ledger records, it never refuses. The kubelet hands out a replica
only once it is free, so a replica granted again means its earlier grant (the whole container) has ended.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mpsagent.devices import ReplicaId
from mpsagent.plan import CapMode


@dataclass(kw_only=True, slots=True)
class Grant:
    grant_id: int
    replica_ids: tuple[ReplicaId, ...]
    kind: CapMode
    granted_at: float
    superseded_ids: tuple[ReplicaId, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordResult:
    grant: Grant
    ended: tuple[Grant, ...]
    """Earlier grants that this one shows to have ended (they held one of its replicas)."""


@dataclass(kw_only=True, slots=True)
class LedgerStatistics:
    grants: dict[CapMode, int] = field(default_factory=lambda: dict.fromkeys(CapMode, 0))
    regranted_replicas: int = 0
    live_grants: int = 0


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._wall = clock
        self._ids = itertools.count(1)
        self._live: dict[int, Grant] = {}
        self._holder: dict[ReplicaId, int] = {}
        self._stats = LedgerStatistics()

    def record(self, replica_ids: tuple[ReplicaId, ...], kind: CapMode) -> RecordResult:
        ended_ids = {self._holder[r] for r in replica_ids if r in self._holder}
        ended = tuple(self._end(grant_id) for grant_id in sorted(ended_ids))
        regranted = tuple(r for r in replica_ids if any(r in g.replica_ids for g in ended))
        grant = Grant(
            grant_id=next(self._ids),
            replica_ids=replica_ids,
            kind=kind,
            granted_at=self._wall(),
            superseded_ids=regranted,
        )
        self._live[grant.grant_id] = grant
        for replica in replica_ids:
            self._holder[replica] = grant.grant_id
        self._stats.grants[kind] += 1
        self._stats.regranted_replicas += len(regranted)
        return RecordResult(grant=grant, ended=ended)

    def release(self, replica_ids: Iterable[ReplicaId]) -> tuple[Grant, ...]:
        """End every grant holding one of these replicas (the pod that held them is gone)."""
        grant_ids = {self._holder[r] for r in replica_ids if r in self._holder}
        return tuple(self._end(grant_id) for grant_id in sorted(grant_ids))

    def _end(self, grant_id: int) -> Grant:
        grant = self._live.pop(grant_id)
        for replica in grant.replica_ids:
            if self._holder.get(replica) == grant_id:
                del self._holder[replica]
        return grant

    def live_grants(self) -> tuple[Grant, ...]:
        return tuple(self._live.values())

    def holder(self, replica_id: ReplicaId) -> Grant | None:
        grant_id = self._holder.get(replica_id)
        return self._live[grant_id] if grant_id is not None else None

    def has_live(self, kind: CapMode) -> bool:
        return any(grant.kind is kind for grant in self._live.values())

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(
            grants=dict(self._stats.grants),
            regranted_replicas=self._stats.regranted_replicas,
            live_grants=len(self._live),
        )
