"""The ledger converging to the kubelet's pod-resources listing (domain code, no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsagent.base.devices import ContainerRef, ReplicaId
from mpsagent.domain.claims import ClaimRef
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.ledger import Ledger
from mpsagent.domain.reconcile import ListedDevices, ListedGrant, listed_grants, reconcile
from mpsagent.domain.shares import Ceilings, Share
from mpsagent_testing.domain import claims_held, replica_id, share_model

IDS = [replica_id(0, i) for i in range(8)]
SHARES = share_model(1, 8)
CAPPED = SHARES.share_of(IDS[:1])


def share_of(ids: tuple[ReplicaId, ...]) -> Share:
    return SHARES.share_of(ids)


def capped_live(ledger: Ledger) -> bool:
    return any(share.kind is GrantKind.CAPPED for share in (g.share for g in ledger.live_grants()))


def ref(pod: str, container: str = "main", namespace: str = "default") -> ContainerRef:
    return ContainerRef(namespace=namespace, pod=pod, container=container)


def new_ledger(clock: list[float] | None = None) -> Ledger:
    """A ledger whose grants are made at monotonic time `clock[0]` (0 unless given: before every `now` here)."""
    at = clock if clock is not None else [0.0]
    return Ledger(monotonic=lambda: at[0])


def run(ledger: Ledger, listed: list[ListedGrant], now: float, grace: float = 60.0):
    return reconcile(ledger, listed, now=now, grace_s=grace, shares=SHARES)


def test_a_listed_grant_learns_its_owner_and_stays() -> None:
    ledger = new_ledger()
    grant = ledger.record((IDS[0],), CAPPED).grant
    result = run(ledger, [ListedGrant(container=ref("a"), replica_ids=(IDS[0],))], now=100)
    assert result.identified == (grant,)
    assert grant.owner == ref("a")
    assert not result.ledger_changed
    # Learning it again is not news.
    assert run(ledger, [ListedGrant(container=ref("a"), replica_ids=(IDS[0],))], now=101).identified == ()


def test_a_grant_is_never_listed_until_a_listing_names_its_container() -> None:
    """What the reconciler's follow-up lookups after an Allocate wait for."""
    ledger = new_ledger()
    ledger.record((IDS[0],), CAPPED)
    assert ledger.never_listed() == 1
    run(ledger, [], now=100)  # a lookup before the kubelet recorded the container
    assert ledger.never_listed() == 1
    run(ledger, [ListedGrant(container=ref("a"), replica_ids=(IDS[0],))], now=101)
    assert ledger.never_listed() == 0
    run(ledger, [ListedGrant(container=ref("b"), replica_ids=(IDS[1],))], now=102)  # a gone, b adopted
    assert ledger.never_listed() == 0


def test_an_unlisted_grant_is_released_only_after_the_grace_period() -> None:
    ledger = new_ledger()
    grant = ledger.record((IDS[0], IDS[1]), CAPPED).grant
    assert run(ledger, [], now=100).missing == 1
    assert run(ledger, [], now=159.9).released == ()
    assert capped_live(ledger)
    result = run(ledger, [], now=160)
    assert result.released == (grant,)
    assert not capped_live(ledger)
    assert ledger.holder(IDS[0]) is None


def test_a_reconciliation_says_when_the_first_unlisted_grant_can_be_released() -> None:
    """The reconciler looks again then: a release is never a whole lookup period late."""
    ledger = new_ledger()
    ledger.record((IDS[0],), CAPPED)
    later = ledger.record((IDS[1],), share_of((IDS[1],))).grant
    assert run(ledger, [], now=100).next_release_at == 160
    # Listed again: its clock stops, and starts anew when it goes again.
    assert run(ledger, [ListedGrant(container=ref("b"), replica_ids=(IDS[1],))], now=130).next_release_at == 160
    result = run(ledger, [], now=160)
    assert (len(result.released), result.next_release_at) == (1, 220)
    assert run(ledger, [], now=220).released == (later,)
    assert run(ledger, [], now=221).next_release_at is None


def test_a_grant_gets_a_full_grace_period_even_from_a_listing_older_than_itself() -> None:
    # The reconciler took the listing (and its `now`) at 100; the Allocate came in while it was at work, at 105.
    clock = [105.0]
    ledger = new_ledger(clock)
    grant = ledger.record((IDS[0],), CAPPED).grant
    assert run(ledger, [], now=100, grace=10).missing == 1
    assert run(ledger, [], now=112, grace=10).released == ()
    assert run(ledger, [], now=115, grace=10).released == (grant,)


def test_a_grant_listed_again_within_the_grace_period_restarts_its_clock() -> None:
    ledger = new_ledger()
    ledger.record((IDS[0],), CAPPED)
    listed = [ListedGrant(container=ref("a"), replica_ids=(IDS[0],))]
    run(ledger, [], now=100)
    run(ledger, listed, now=150)
    assert run(ledger, [], now=200).released == ()
    assert len(run(ledger, [], now=260).released) == 1


def test_unknown_containers_are_adopted_with_their_kind() -> None:
    ledger = new_ledger()
    result = run(
        ledger,
        [ListedGrant(container=ref("full"), replica_ids=tuple(IDS))],
        now=1,
    )
    assert [(g.kind, g.owner, g.adopted) for g in result.adopted] == [(GrantKind.FULL, ref("full"), True)]
    assert result.ledger_changed
    ledger2 = new_ledger()
    result2 = run(ledger2, [ListedGrant(container=ref("small"), replica_ids=(IDS[3],))], now=1)
    assert result2.adopted[0].kind is GrantKind.CAPPED
    assert ledger2.statistics().adopted_grants == 1


def test_a_grant_split_differently_by_the_kubelet_is_replaced() -> None:
    ledger = new_ledger()
    old = ledger.record((IDS[0], IDS[1]), CAPPED).grant
    result = run(
        ledger,
        [
            ListedGrant(container=ref("a"), replica_ids=(IDS[0],)),
            ListedGrant(container=ref("b"), replica_ids=(IDS[1],)),
        ],
        now=1,
    )
    assert result.replaced == (old,)
    assert sorted(str(g.owner) for g in result.adopted) == ["default/a/main", "default/b/main"]
    assert {ledger.holder(IDS[0]).owner, ledger.holder(IDS[1]).owner} == {ref("a"), ref("b")}  # type: ignore[union-attr]


# --- the kubelet's listing: which container holds what ----------------------------------------------------------

TWO_GPUS = share_model(2, 4)
A = [replica_id(0, i) for i in range(4)]
B = [replica_id(1, i) for i in range(4)]
WHOLE_MIB = 16384
QUARTER_MIB, HALF_MIB = 4096, 8192

# (pod, container, its IDs) in the kubelet's order: a pod's (restartable) init containers before its app containers.
Listing = list[tuple[str, str, list[ReplicaId]]]


def listing_of(entries: Listing) -> list[ListedDevices]:
    return [ListedDevices(container=ref(pod, name), device_ids=tuple(ids)) for pod, name, ids in entries]


@pytest.mark.parametrize(
    ("entries", "held", "ceilings"),
    [
        pytest.param(
            [("p", "init", A[:1]), ("p", "app", [A[0], A[1]])],
            {"p/app": A[:2]},
            (50, HALF_MIB, WHOLE_MIB),
            id="the-app-reuses-the-init-containers-id",
        ),
        pytest.param(
            [("p", "init", A[:2]), ("p", "app", A[:1])],
            {"p/app": A[:2]},
            (50, HALF_MIB, WHOLE_MIB),
            id="the-app-reuses-part-of-the-init-containers-ids",
        ),
        pytest.param(
            [("p", "init", A[:2]), ("p", "app1", A[:1]), ("p", "app2", A[1:2])],
            {"p/app2": A[:2]},
            (50, HALF_MIB, WHOLE_MIB),
            id="two-apps-share-out-the-init-containers-ids",
        ),
        pytest.param(
            [("p", "init", A[:2]), ("p", "app", [*A[:2], B[0]])],
            {"p/app": [*A[:2], B[0]]},
            (50, HALF_MIB, QUARTER_MIB),  # threads: the init container's 50 %, not the app's 25 %
            id="no-container-covers-the-others",
        ),
        pytest.param(
            [("p", "app1", A[:1]), ("p", "app2", A[1:3])],
            {"p/app1": A[:1], "p/app2": A[1:3]},
            (50, HALF_MIB, WHOLE_MIB),
            id="apps-of-one-pod-hold-their-own",
        ),
        pytest.param(
            [("p", "init", A[:1]), ("q", "app", [A[0], A[1]])],
            {"p/init": A[:1], "q/app": A[1:2]},
            (25, QUARTER_MIB, WHOLE_MIB),
            id="an-id-listed-by-two-pods-stays-with-the-first",
        ),
        pytest.param(
            [("p", "main", [A[0], A[0], A[1]]), ("q", "main", [])],
            {"p/main": A[:2]},
            (50, HALF_MIB, WHOLE_MIB),
            id="duplicates-and-empty-containers",
        ),
    ],
)
def test_a_pods_containers_never_split_a_grant(
    entries: Listing, held: dict[str, list[ReplicaId]], ceilings: tuple[int, int, int]
) -> None:
    """The kubelet hands the IDs of a pod's init container on to its later containers, which list them too: the
    containers of a pod that share IDs are one grant, of their last container, with a share that covers each of
    theirs; the daemon's ceilings are those of the listed containers' own shares, no lower and no higher."""
    ledger = new_ledger()
    listed = listed_grants(listing_of(entries))
    reconcile(ledger, listed, now=1, grace_s=60, shares=TWO_GPUS)
    assert {str(g.owner).removeprefix("default/"): sorted(g.replica_ids) for g in ledger.live_grants()} == {
        owner: sorted(ids) for owner, ids in held.items()
    }
    thread, memory0, memory1 = ceilings
    assert TWO_GPUS.ceilings(ledger.tally) == Ceilings(thread_percentage=thread, memory_mib=(memory0, memory1))


def test_the_apps_allocate_grant_is_kept_when_its_init_container_lists_a_part_of_it() -> None:
    """init {A}, app {A, X}: the app's Allocate ended the init container's grant; the listing must not split the app's
    2/4 into two 1/4 grants (the daemon went to 25 % while the app ran with 50 % caps)."""
    ledger = new_ledger()
    ledger.record(tuple(A[:1]), TWO_GPUS.share_of(A[:1]))
    app = ledger.record(tuple(A[:2]), TWO_GPUS.share_of(A[:2])).grant
    listed = listed_grants(listing_of([("p", "init", A[:1]), ("p", "app", [A[1], A[0]])]))
    result = reconcile(ledger, listed, now=1, grace_s=60, shares=TWO_GPUS)
    assert (result.identified, result.adopted, result.replaced) == ((app,), (), ())
    assert app.owner == ref("p", "app")
    assert TWO_GPUS.ceilings(ledger.tally).thread_percentage == 50


@pytest.mark.parametrize(
    ("listed_ids", "ceilings"),
    [
        # A restart with 4 replicas instead of 8 while pods run: 4 of the old 8 is not the whole GPU (100 % / 16G).
        pytest.param([replica_id(0, i) for i in range(4, 8)], (25, QUARTER_MIB, WHOLE_MIB), id="4-of-old-8"),
        # Not "6 of 4" with a 24576 MiB ceiling on a 16384 MiB GPU.
        pytest.param(
            [*(replica_id(0, i) for i in range(6)), replica_id(1, 0)], (25, QUARTER_MIB, QUARTER_MIB), id="6-of-4"
        ),
        pytest.param(["GPU-gone::0"], (25, QUARTER_MIB, QUARTER_MIB), id="a-gpu-outside-the-resource"),
    ],
)
def test_a_listed_grant_with_ids_the_resource_does_not_advertise_counts_as_the_smallest_share(
    listed_ids: list[str], ceilings: tuple[int, int, int]
) -> None:
    ledger = new_ledger()
    listed = listed_grants([ListedDevices(container=ref("old"), device_ids=tuple(listed_ids))])
    result = reconcile(ledger, listed, now=1, grace_s=60, shares=TWO_GPUS)
    assert result.unplaced == result.adopted and len(result.adopted) == 1
    thread, memory0, memory1 = ceilings
    assert TWO_GPUS.ceilings(ledger.tally) == Ceilings(thread_percentage=thread, memory_mib=(memory0, memory1))
    # Listed again, the same grant: nothing new to say.
    again = reconcile(ledger, listed, now=2, grace_s=60, shares=TWO_GPUS)
    assert (again.adopted, again.unplaced) == ((), ())


pods = st.sampled_from("pqr")
names = st.sampled_from(["init", "side", "app", "app2"])


@settings(max_examples=300, deadline=None)
@given(
    listing=st.lists(st.tuples(pods, names, st.lists(st.sampled_from(A + B), max_size=5)), max_size=8),
    allocated=st.lists(st.lists(st.sampled_from(A + B), min_size=1, max_size=8, unique=True), max_size=4),
)
def test_the_ceilings_never_fall_below_a_listed_containers_share_nor_rise_above_the_largest(
    listing: Listing, allocated: list[list[ReplicaId]]
) -> None:
    # The kubelet never lists an ID in two pods: give each ID to the first pod that lists it.
    first_pod: dict[ReplicaId, str] = {}
    for pod, _, ids in listing:
        for replica in ids:
            first_pod.setdefault(replica, pod)
    entries = [(pod, name, [r for r in ids if first_pod[r] == pod]) for pod, name, ids in listing]
    containers: dict[tuple[str, str], list[ReplicaId]] = {}
    for pod, name, ids in entries:
        containers.setdefault((pod, name), []).extend(r for r in ids if r not in containers.get((pod, name), []))
    own = [TWO_GPUS.share_of(ids) for ids in containers.values() if ids]
    # From an empty ledger: exactly the ceilings of the containers' own shares.
    fresh = new_ledger()
    reconcile(fresh, listed_grants(listing_of(entries)), now=1, grace_s=60, shares=TWO_GPUS)
    assert TWO_GPUS.ceilings(fresh.tally) == TWO_GPUS.ceilings(own)
    # After Allocates of the agent: never below any listed container's share (grants not listed wait for the grace).
    ledger = new_ledger()
    for ids in allocated:
        ledger.record(tuple(ids), TWO_GPUS.share_of(ids))
    reconcile(ledger, listed_grants(listing_of(entries)), now=1, grace_s=60, shares=TWO_GPUS)
    held = TWO_GPUS.ceilings(ledger.tally)
    for share in own:
        assert held.thread_percentage >= share.thread_percentage
        assert all(held.memory_mib[ordinal] >= mib for ordinal, mib in share.bounds)
    # And once the grace period is over, exactly them again.
    reconcile(ledger, listed_grants(listing_of(entries)), now=61, grace_s=60, shares=TWO_GPUS)
    assert TWO_GPUS.ceilings(ledger.tally) == TWO_GPUS.ceilings(own)


containers = st.sampled_from([ref(p) for p in "abcdef"])
listings = st.lists(st.tuples(containers, st.lists(st.sampled_from(IDS), max_size=4)), max_size=6)


@settings(max_examples=200, deadline=None)
@given(
    allocated=st.lists(st.lists(st.sampled_from(IDS), min_size=1, max_size=8, unique=True), max_size=6),
    listing=listings,
)
def test_after_the_grace_period_the_ledger_is_exactly_the_listing(
    allocated: list[list[ReplicaId]], listing: list[tuple[ContainerRef, list[ReplicaId]]]
) -> None:
    ledger = new_ledger()
    for ids in allocated:
        ledger.record(tuple(ids), share_of(tuple(ids)))
    listed = listed_grants([ListedDevices(container=c, device_ids=tuple(ids)) for c, ids in listing])
    within = run(ledger, listed, now=0)
    # Inside the grace period nothing the listing shows is lost, and everything listed is held by its container.
    for listed_grant in listed:
        for replica in listed_grant.replica_ids:
            holder = ledger.holder(replica)
            assert holder is not None and holder.owner == listed_grant.container
    assert within.released == ()
    run(ledger, listed, now=60)
    held = {frozenset(g.replica_ids): g.owner for g in ledger.live_grants()}
    assert held == {frozenset(h.replica_ids): h.container for h in listed if h.replica_ids}
    assert sum(ledger.holder(r) is not None for r in IDS) == sum(len(h.replica_ids) for h in listed)


# --- DRA claims' shares: not the listing's to end -----------------------------------------------------------

CLAIM = ClaimRef(namespace="ml", name="train-gpu", uid="0b5f1c52-8f5e-4a55-9b0e-3f8a1c2d4e6f")


def test_a_claims_share_outlives_any_listing_while_an_unlisted_device_plugin_grant_is_released() -> None:
    """The kubelet's pod-resources listing does not show a claim's share; only its unprepare ends it."""
    ledger = new_ledger()
    claim = ledger.hold_claim(CLAIM, "gpu-0", SHARES.capacity_share(0, 10000, 60))
    plugin = ledger.record((IDS[0],), CAPPED).grant
    first = run(ledger, [], now=100)
    assert (first.missing, first.released) == (1, ())
    result = run(ledger, [], now=100 + 1000 * 60)
    assert result.released == (plugin,)
    assert result.missing == 0
    assert ledger.live_grants() == (claim,)
    assert claim.missing_since is None
    ceilings = SHARES.ceilings(ledger.tally)
    assert (ceilings.thread_percentage, ceilings.memory_mib) == (60, (10000,))


def test_a_listing_of_other_containers_leaves_a_claims_share_alone() -> None:
    ledger = new_ledger()
    claim = ledger.hold_claim(CLAIM, "gpu-0", SHARES.capacity_share(0, 2048, 10))
    listed = [ListedGrant(container=ref("a"), replica_ids=tuple(IDS))]  # every replica of the GPU, adopted
    for now in (1, 100, 10_000):
        result = run(ledger, listed, now=now)
        assert claim not in result.released + result.replaced
    assert claims_held(ledger) == (claim,)
    assert claim.owner is None
    assert ledger.tally.clients(0) == 2
