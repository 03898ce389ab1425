"""The ledger of one resource (domain code, no sockets): grants recorded, a replica granted again ending its
earlier grant, an Allocate withdrawn, grants released and adopted, and the counts the metrics read."""

from __future__ import annotations

import pytest

from mpsagent.base.config import GrantRule
from mpsagent.base.devices import ContainerRef, GpuUuid, ReplicaId
from mpsagent.domain.ledger import Ledger
from mpsagent.domain.shares import GpuSlots, GrantKind, Share, ShareModel

A = [ReplicaId(f"GPU-a::{i}") for i in range(4)]
SHARES = ShareModel(
    gpus=(GpuSlots(uuid=GpuUuid("GPU-a"), ordinal=0, memory_bytes=16 << 30, id_count=4),),
    rule=GrantRule.PROPORTIONAL,
    unit_bytes=None,
    enforce=True,
)
OWNER = ContainerRef(namespace="ml", pod="train", container="main")


def share(*replicas: ReplicaId) -> Share:
    return SHARES.share_of(replicas)


def record(ledger: Ledger, *replicas: ReplicaId):
    return ledger.record(replicas, share(*replicas))


def holders(ledger: Ledger) -> dict[ReplicaId, int]:
    return {r: g.grant_id for r in A if (g := ledger.holder(r))}


def test_a_grant_is_recorded_with_its_times_share_and_replicas() -> None:
    ledger = Ledger(clock=lambda: 1700000000.0, monotonic=lambda: 42.0)
    result = record(ledger, A[0], A[1])
    grant = result.grant
    assert (grant.grant_id, grant.replica_ids, grant.kind) == (1, (A[0], A[1]), GrantKind.CAPPED)
    assert (grant.granted_at, grant.granted_monotonic) == (1700000000.0, 42.0)
    assert (grant.owner, grant.adopted, result.ended) == (None, False, ())
    assert holders(ledger) == {A[0]: 1, A[1]: 1}
    assert [g.share for g in ledger.live_grants()] == [share(A[0], A[1])]
    assert ledger.tally.clients(0) == 1


def test_a_replica_granted_again_ends_the_whole_earlier_grant() -> None:
    """The kubelet hands out a replica only once it is free: the container that held it has ended."""
    ledger = Ledger()
    first = record(ledger, A[0], A[1]).grant
    second = record(ledger, A[1], A[2])
    assert second.ended == (first,)
    assert second.grant.superseded_ids == (A[1],)
    assert holders(ledger) == {A[1]: 2, A[2]: 2}  # A[0] is free again
    assert ledger.tally.clients(0) == 1
    stats = ledger.statistics()
    assert (stats.superseded_grants, stats.regranted_replicas) == (1, 1)
    assert stats.live_grants == {GrantKind.CAPPED: 1, GrantKind.FULL: 0}
    assert stats.grants == {GrantKind.CAPPED: 2, GrantKind.FULL: 0}


def test_a_withdrawn_grant_gives_the_ended_grants_back() -> None:
    ledger = Ledger()
    first = record(ledger, A[0]).grant
    record(ledger, A[2])
    before = (holders(ledger), ledger.statistics(), ledger.live_grants())
    failed = ledger.record(tuple(A), share(*A))  # the whole GPU: ends both
    assert failed.grant.kind is GrantKind.FULL
    assert len(failed.ended) == 2
    ledger.withdraw(failed)
    assert (holders(ledger), ledger.statistics(), ledger.live_grants()) == before
    assert ledger.holder(A[0]) is first


def test_a_withdrawal_keeps_what_a_later_grant_took() -> None:
    ledger = Ledger()
    record(ledger, A[0], A[1])
    failed = record(ledger, A[1])  # ends grant 1
    record(ledger, A[0])  # grant 3 takes A[0] of grant 1 meanwhile
    ledger.withdraw(failed)
    assert holders(ledger) == {A[0]: 3}  # grant 1 stays ended: its A[0] is the kubelet's word again
    ledger.withdraw(failed)  # a second withdrawal changes nothing
    assert holders(ledger) == {A[0]: 3}


def test_a_withdrawal_of_a_grant_already_ended_changes_nothing() -> None:
    ledger = Ledger()
    failed = record(ledger, A[0])
    ledger.release([failed.grant.grant_id])
    version = ledger.version
    ledger.withdraw(failed)
    assert (ledger.version, ledger.live_grants()) == (version, ())


def test_released_grants_free_their_replicas_and_unknown_ids_are_ignored() -> None:
    ledger = Ledger()
    one = record(ledger, A[0]).grant
    two = record(ledger, A[1], A[2]).grant
    assert ledger.release([one.grant_id, one.grant_id, 99]) == (one,)
    assert holders(ledger) == {A[1]: two.grant_id, A[2]: two.grant_id}
    assert ledger.statistics().released_grants == 1
    assert ledger.release([]) == ()


def test_an_adopted_grant_names_its_owner_and_counts_apart_from_allocations() -> None:
    ledger = Ledger()
    adopted = ledger.adopt((A[3],), share(A[3]), OWNER).grant
    assert (adopted.owner, adopted.adopted) == (OWNER, True)
    stats = ledger.statistics()
    assert stats.adopted_grants == 1
    assert stats.grants == {GrantKind.CAPPED: 0, GrantKind.FULL: 0}
    assert stats.live_grants[GrantKind.CAPPED] == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda ledger: record(ledger, A[3]),
        lambda ledger: ledger.release([1]),
        lambda ledger: ledger.adopt((A[3],), share(A[3]), OWNER),
        lambda ledger: ledger.mark_listed(ledger.live_grants()[0], OWNER),
        lambda ledger: ledger.mark_unlisted(ledger.live_grants()[0], now=5.0),
    ],
    ids=["record", "release", "adopt", "mark_listed", "mark_unlisted"],
)
def test_the_version_moves_on_every_change(change) -> None:
    ledger = Ledger()
    record(ledger, A[0])
    version = ledger.version
    change(ledger)
    assert ledger.version > version


def test_reading_the_ledger_changes_nothing() -> None:
    ledger = Ledger()
    record(ledger, A[0])
    version = ledger.version
    ledger.holder(A[0]), ledger.live_grants(), ledger.statistics(), ledger.never_listed(), ledger.tally.clients(0)
    assert ledger.version == version
