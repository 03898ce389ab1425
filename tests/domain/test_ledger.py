"""The ledger of one resource (domain code, no sockets): grants recorded, a replica granted again ending its
earlier grant, an Allocate withdrawn, grants released and adopted, and the counts the metrics read."""

from __future__ import annotations

import pytest

from mpsagent.base.devices import ContainerRef, ReplicaId
from mpsagent.domain.claims import ClaimRef
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.ledger import Ledger
from mpsagent.domain.shares import Share
from mpsagent_testing.domain import claims_held, replica_id, share_model, uuid

A = [replica_id(0, i) for i in range(4)]
SHARES = share_model(1, 4)
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


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)], ids=["same order", "another order"])
def test_the_ids_of_one_grant_granted_again_end_it_as_any_regrant(order: tuple[int, ...]) -> None:
    """The kubelet granting a container's IDs again (any order): the earlier grant ends and the new one holds them,
    as when a grant takes some of another's IDs, and a withdrawal gives them back."""
    ledger = Ledger()
    first = record(ledger, A[0], A[1], A[2]).grant
    record(ledger, A[3])
    before = (holders(ledger), ledger.statistics(), set(ledger.live_grants()), ledger.tally.clients(0))
    again = record(ledger, *(A[i] for i in order))
    assert (again.ended, again.grant.superseded_ids) == ((first,), tuple(A[i] for i in order))
    assert holders(ledger) == {A[0]: 3, A[1]: 3, A[2]: 3, A[3]: 2}
    assert [g.grant_id for g in ledger.holders(A[:3])] == [3]
    assert ledger.tally.clients(0) == 2
    stats = ledger.statistics()
    assert (stats.superseded_grants, stats.regranted_replicas) == (1, 3)
    ledger.withdraw(again)
    assert (holders(ledger), ledger.statistics(), set(ledger.live_grants()), ledger.tally.clients(0)) == before
    assert ledger.holder(A[0]) is first
    ledger.release([first.grant_id])  # its IDs are free again, each of them
    assert holders(ledger) == {A[3]: 2}


def test_the_grant_holding_exactly_some_ids_is_found_in_any_order() -> None:
    ledger = Ledger()
    grant = record(ledger, A[0], A[1], A[2]).grant
    assert ledger.holding((A[0], A[1], A[2])) is ledger.holding((A[2], A[0], A[1])) is grant
    assert ledger.holding((A[0], A[1])) is ledger.holding((*A,)) is ledger.holding((A[0], A[1], A[1])) is None
    ledger.release([grant.grant_id])
    assert ledger.holding((A[0], A[1], A[2])) is None


def test_a_grant_of_fewer_or_more_ids_than_the_one_it_ends_frees_the_rest() -> None:
    ledger = Ledger()
    record(ledger, A[0], A[1], A[2])
    fewer = record(ledger, A[1], A[0])
    assert (len(fewer.ended), holders(ledger)) == (1, {A[0]: 2, A[1]: 2})
    more = record(ledger, A[0], A[1], A[3])
    assert (more.ended, more.grant.superseded_ids) == ((fewer.grant,), (A[0], A[1]))
    assert holders(ledger) == {A[0]: 3, A[1]: 3, A[3]: 3}


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


# --- DRA claims' shares -------------------------------------------------------------------------------------

CLAIM = ClaimRef(namespace="ml", name="train-gpu", uid="0b5f1c52-8f5e-4a55-9b0e-3f8a1c2d4e6f")
OTHER_CLAIM = ClaimRef(namespace="ml", name="eval-gpu", uid="7d0c1e9a-2b3c-4d5e-8f90-a1b2c3d4e5f6")
QUARTER_MIB = 4096  # `A[0]`'s cap (a quarter of 16 GiB); a claim's 10000 MiB and 60 % lie above it


def claim_share(memory_mib: int = 10000, threads: int = 60) -> Share:
    return SHARES.capacity_share(0, memory_mib, threads)


def test_a_claims_share_lifts_the_ceilings_while_held_and_they_fall_back_when_released() -> None:
    ledger = Ledger(clock=lambda: 1700000000.0, monotonic=lambda: 42.0)
    record(ledger, A[0])
    before = SHARES.ceilings(ledger.tally)
    assert (before.thread_percentage, before.memory_mib) == (25, (QUARTER_MIB,))
    held = ledger.hold_claim(CLAIM, "gpu-0", claim_share())
    assert (held.claim, held.claim_device, held.replica_ids, held.kind) == (CLAIM, "gpu-0", (), GrantKind.CAPPED)
    assert (held.granted_at, held.granted_monotonic, held.adopted, held.owner) == (1700000000.0, 42.0, False, None)
    during = SHARES.ceilings(ledger.tally)
    assert (during.thread_percentage, during.memory_mib) == (60, (10000,))
    assert ledger.tally.clients(0) == 2
    assert ledger.release([held.grant_id]) == (held,)
    assert SHARES.ceilings(ledger.tally) == before
    assert ledger.tally.clients(0) == 1


def test_a_smaller_claim_leaves_the_ceilings_at_the_largest_share() -> None:
    ledger = Ledger()
    record(ledger, A[0], A[1])  # 8192 MiB, 50 %
    ledger.hold_claim(CLAIM, "gpu-0", claim_share(2048, 10))
    ceilings = SHARES.ceilings(ledger.tally)
    assert (ceilings.thread_percentage, ceilings.memory_mib) == (50, (8192,))


def test_a_claim_of_the_whole_gpu_lifts_the_ceilings_to_the_hardware() -> None:
    ledger = Ledger()
    record(ledger, A[0])
    whole = ledger.hold_claim(CLAIM, "gpu-0", SHARES.capacity_share(0, 16384, 100))
    assert whole.kind is GrantKind.FULL
    assert SHARES.ceilings(ledger.tally) == SHARES.full_hardware()


def test_a_claim_is_a_client_of_its_gpu_for_the_client_limit() -> None:
    """MPS takes 48 clients per GPU, whichever route they came by."""
    shares = share_model(1, 48, memory_bytes=48 << 30)
    replicas = [replica_id(0, i) for i in range(48)]
    ledger = Ledger()
    for replica in replicas[:47]:
        ledger.record((replica,), shares.share_of((replica,)))
    claim = shares.capacity_share(0, 1024, 2)
    assert shares.clients_over_limit(ledger.tally, (), [claim]) == ()
    held = ledger.hold_claim(CLAIM, "gpu-0", claim)
    assert ledger.tally.clients(0) == 48
    assert shares.full_gpus(ledger.tally) == {uuid(0)}
    (over,) = shares.clients_over_limit(ledger.tally, (), [claim])
    assert (over.ordinal, over.grants, over.limit) == (0, 49, 48)
    # A device-plugin grant of the last replica is over too: the claim counts as a client.
    last = shares.share_of((replicas[47],))
    assert shares.clients_over_limit(ledger.tally, (), [last]) != ()
    ledger.release([held.grant_id])
    assert shares.clients_over_limit(ledger.tally, (), [claim]) == ()


def test_claim_grants_are_apart_from_the_listed_route() -> None:
    """The kubelet's pod-resources listing speaks for device-plugin grants only: a claim's share is never waited for
    there (never_listed), nor one of the grants a listing reconciles (listed_route)."""
    ledger = Ledger()
    plugin = record(ledger, A[0]).grant
    first = ledger.hold_claim(CLAIM, "gpu-0", claim_share())
    second = ledger.hold_claim(OTHER_CLAIM, "gpu-0", claim_share(2048, 10))
    assert ledger.listed_route() == (plugin,)
    assert claims_held(ledger) == (first, second)
    assert ledger.never_listed() == 1
    assert set(ledger.live_grants()) == {plugin, first, second}
    ledger.mark_listed(plugin, OWNER)
    assert ledger.never_listed() == 0
    ledger.release([first.grant_id])
    assert claims_held(ledger) == (second,)
    assert ledger.listed_route() == (plugin,)


def test_a_device_plugin_grant_never_ends_a_claims_share() -> None:
    ledger = Ledger()
    held = ledger.hold_claim(CLAIM, "gpu-0", claim_share())
    result = ledger.record(tuple(A), share(*A))  # every replica of the GPU
    assert result.ended == ()
    assert claims_held(ledger) == (held,)
    ledger.withdraw(result)
    assert claims_held(ledger) == (held,)
    assert ledger.holders(A) == []


def test_the_statistics_count_claims_held_all_time_and_live_by_kind() -> None:
    ledger = Ledger()
    record(ledger, A[0])
    capped = ledger.hold_claim(CLAIM, "gpu-0", claim_share())
    ledger.hold_claim(OTHER_CLAIM, "gpu-0", SHARES.capacity_share(0, 16384, 100))
    stats = ledger.statistics()
    assert stats.claim_grants == 2
    assert stats.live_grants == {GrantKind.CAPPED: 2, GrantKind.FULL: 1}
    assert stats.grants == {GrantKind.CAPPED: 1, GrantKind.FULL: 0}  # Allocates only
    ledger.release([capped.grant_id])
    stats = ledger.statistics()
    assert (stats.claim_grants, stats.released_grants) == (2, 1)
    assert stats.live_grants == {GrantKind.CAPPED: 1, GrantKind.FULL: 1}


def test_the_version_moves_when_a_claim_is_held_and_released() -> None:
    ledger = Ledger()
    version = ledger.version
    held = ledger.hold_claim(CLAIM, "gpu-0", claim_share())
    assert ledger.version > version
    version = ledger.version
    ledger.live_grants(), ledger.listed_route(), ledger.never_listed(), ledger.statistics()
    assert ledger.version == version
    ledger.release([held.grant_id])
    assert ledger.version > version
