"""The ledger converging to the kubelet's pod-resources listing (domain code, no sockets)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mpsagent.config import GrantRule
from mpsagent.devices import ContainerRef, GpuUuid, ReplicaId
from mpsagent.ledger import Ledger
from mpsagent.reconcile import Holding, ListedDevices, holdings, reconcile
from mpsagent.shares import GpuSlots, GrantKind, Share, ShareModel

IDS = [ReplicaId(f"GPU-a::{i}") for i in range(8)]
SHARES = ShareModel(
    gpus=(GpuSlots(uuid=GpuUuid("GPU-a"), ordinal=0, memory_bytes=16 << 30, ids=8),),
    rule=GrantRule.PROPORTIONAL,
    unit_bytes=None,
    enforce=True,
)
CAPPED = SHARES.share_of(IDS[:1])


def share_of(ids: tuple[ReplicaId, ...]) -> Share:
    return SHARES.share_of(ids)


def capped_live(ledger: Ledger) -> bool:
    return any(share.kind is GrantKind.CAPPED for share in ledger.live_shares())


def ref(pod: str, container: str = "main", namespace: str = "default") -> ContainerRef:
    return ContainerRef(namespace=namespace, pod=pod, container=container)


def new_ledger(clock: list[float] | None = None) -> Ledger:
    """A ledger whose grants are made at monotonic time `clock[0]` (0 unless given: before every `now` here)."""
    at = clock if clock is not None else [0.0]
    return Ledger(monotonic=lambda: at[0])


def run(ledger: Ledger, listed: list[Holding], now: float, grace: float = 60.0):
    return reconcile(ledger, listed, now=now, grace_s=grace, share_of=share_of)


def test_a_listed_grant_learns_its_owner_and_stays() -> None:
    ledger = new_ledger()
    grant = ledger.record((IDS[0],), CAPPED).grant
    result = run(ledger, [Holding(container=ref("a"), replica_ids=(IDS[0],))], now=100)
    assert result.identified == (grant,)
    assert grant.owner == ref("a")
    assert not result.ledger_changed
    # Learning it again is not news.
    assert run(ledger, [Holding(container=ref("a"), replica_ids=(IDS[0],))], now=101).identified == ()


def test_a_grant_is_never_listed_until_a_listing_names_its_container() -> None:
    """What the reconciler's follow-up lookups after an Allocate wait for."""
    ledger = new_ledger()
    ledger.record((IDS[0],), CAPPED)
    assert ledger.never_listed() == 1
    run(ledger, [], now=100)  # a lookup before the kubelet recorded the container
    assert ledger.never_listed() == 1
    run(ledger, [Holding(container=ref("a"), replica_ids=(IDS[0],))], now=101)
    assert ledger.never_listed() == 0
    run(ledger, [Holding(container=ref("b"), replica_ids=(IDS[1],))], now=102)  # a gone, b adopted
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
    listed = [Holding(container=ref("a"), replica_ids=(IDS[0],))]
    run(ledger, [], now=100)
    run(ledger, listed, now=150)
    assert run(ledger, [], now=200).released == ()
    assert len(run(ledger, [], now=260).released) == 1


def test_unknown_containers_are_adopted_with_their_kind() -> None:
    ledger = new_ledger()
    result = run(
        ledger,
        [Holding(container=ref("full"), replica_ids=tuple(IDS))],
        now=1,
    )
    assert [(g.kind, g.owner, g.adopted) for g in result.adopted] == [(GrantKind.FULL, ref("full"), True)]
    assert result.ledger_changed
    ledger2 = new_ledger()
    result2 = run(ledger2, [Holding(container=ref("small"), replica_ids=(IDS[3],))], now=1)
    assert result2.adopted[0].kind is GrantKind.CAPPED
    assert ledger2.statistics().adopted_grants == 1


def test_a_grant_split_differently_by_the_kubelet_is_replaced() -> None:
    ledger = new_ledger()
    old = ledger.record((IDS[0], IDS[1]), CAPPED).grant
    result = run(
        ledger,
        [
            Holding(container=ref("a"), replica_ids=(IDS[0],)),
            Holding(container=ref("b"), replica_ids=(IDS[1],)),
        ],
        now=1,
    )
    assert result.replaced == (old,)
    assert sorted(str(g.owner) for g in result.adopted) == ["default/a/main", "default/b/main"]
    assert {ledger.holder(IDS[0]).owner, ledger.holder(IDS[1]).owner} == {ref("a"), ref("b")}  # type: ignore[union-attr]


def test_holdings_deduplicate_ids_across_and_within_containers() -> None:
    init = ref("p", "init")
    main = ref("p", "main")
    listed = holdings(
        [
            ListedDevices(container=init, device_ids=(IDS[0], IDS[0], IDS[1])),
            ListedDevices(container=main, device_ids=(IDS[1], IDS[0])),
            ListedDevices(container=ref("q"), device_ids=(IDS[2],)),
        ]
    )
    assert listed == [
        Holding(container=init, replica_ids=(IDS[0], IDS[1])),
        Holding(container=ref("q"), replica_ids=(IDS[2],)),
    ]


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
    listed = holdings([ListedDevices(container=c, device_ids=tuple(ids)) for c, ids in listing])
    within = run(ledger, listed, now=0)
    # Inside the grace period nothing the listing shows is lost, and everything listed is held by its container.
    for holding in listed:
        for replica in holding.replica_ids:
            holder = ledger.holder(replica)
            assert holder is not None and holder.owner == holding.container
    assert within.released == ()
    run(ledger, listed, now=60)
    held = {frozenset(g.replica_ids): g.owner for g in ledger.live_grants()}
    assert held == {frozenset(h.replica_ids): h.container for h in listed if h.replica_ids}
    assert ledger.held_replicas() == sum(len(h.replica_ids) for h in listed)
