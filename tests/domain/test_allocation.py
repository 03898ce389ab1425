"""The allocator of one resource (domain code, no sockets): requests checked before anything is recorded, the
grants of every container of an Allocate recorded together, withdrawn together, the daemon ceilings following the
ledger, and preferred allocations. Arbitrary input: test_bad_input.py; the 48-client limit: test_shares.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpsagent.base.config import check_config, parse_config
from mpsagent.base.devices import ContainerRef, ReplicaId
from mpsagent.base.errors import RequestError
from mpsagent.domain.allocation import ResourceAllocator, describe_ids
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.plan import build_plan
from mpsagent.domain.reconcile import ListedGrant
from mpsagent.domain.shares import Ceilings
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent_testing.node import ALL, GPU0, GPU1, RESOURCE, config, ids, small_node

GIB_MIB = 1024
WHOLE = Ceilings(thread_percentage=100, memory_mib=(16 * GIB_MIB, 16 * GIB_MIB))


@pytest.fixture
def node_file(tmp_path: Path) -> Path:
    return small_node(tmp_path / "node.json")


def allocator_for(node_file: Path, text: str | None = None) -> ResourceAllocator:
    node = SnapshotGpuSource(node_file).discover()
    plan = build_plan(check_config(parse_config(text or config(), "config.yaml")), node, Path("/run/mps"))
    return ResourceAllocator(plan.resources[0], plan.shm_directory)


@pytest.fixture
def allocator(node_file: Path) -> ResourceAllocator:
    return allocator_for(node_file)


def live(allocator: ResourceAllocator) -> list[tuple[str, ...]]:
    return [g.replica_ids for g in allocator.ledger.live_grants()]


@pytest.mark.parametrize(
    ("names", "shown"),
    [
        (["a"], "'a'"),
        (["a", "b", "c"], "'a', 'b', 'c'"),
        (["a", "b", "c", "d", "e"], "'a', 'b', 'c' and 2 more"),
    ],
)
def test_a_message_names_the_first_three_ids_and_counts_the_rest(names: list[str], shown: str) -> None:
    assert describe_ids(names) == shown


def test_a_request_is_deduplicated_in_its_order(allocator: ResourceAllocator) -> None:
    assert allocator.check_request(ids(GPU1, 2) + ids(GPU0, 1, 1)) == tuple(ids(GPU1, 2) + ids(GPU0, 1))


@pytest.mark.parametrize(
    ("request_ids", "message"),
    [
        ([], f"{RESOURCE}: a container request must name at least one device ID"),
        (
            ["GPU-nope::0", "GPU-nope::0"],
            f"{RESOURCE}: unknown device ID 'GPU-nope::0' in the request; this resource advertises IDs of the form "
            "<GPU UUID>::<replica>",
        ),
        (
            [*ids(GPU0, 0), "x", "y"],
            f"{RESOURCE}: unknown device IDs 'x', 'y' in the request; this resource advertises IDs of the form "
            "<GPU UUID>::<replica>",
        ),
    ],
)
def test_a_wrong_request_is_refused_with_what_is_wrong(
    allocator: ResourceAllocator, request_ids: list[str], message: str
) -> None:
    with pytest.raises(RequestError) as refused:
        allocator.check_request(request_ids)
    assert str(refused.value) == message


def test_what_a_grant_would_be_records_nothing(allocator: ResourceAllocator) -> None:
    grant = allocator.grant_for(ids(GPU0, 0))
    assert (grant.replica_ids, grant.share.kind) == (tuple(ids(GPU0, 0)), GrantKind.CAPPED)
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == GPU0
    assert (live(allocator), allocator.ledger.version) == ([], 0)


def test_an_allocate_records_every_container_or_none(allocator: ResourceAllocator) -> None:
    allocations = allocator.allocate([ids(GPU0, 0), ids(GPU1, 0, 1)])
    granted = [tuple(ids(GPU0, 0)), tuple(ids(GPU1, 0, 1))]
    assert [a.setup.replica_ids for a in allocations] == live(allocator) == granted
    assert [a.record.grant.grant_id for a in allocations] == [1, 2]
    version = allocator.ledger.version
    with pytest.raises(RequestError):
        allocator.allocate([ids(GPU0, 2), ["GPU-nope::0"]])  # the second container is wrong: the first is not granted
    assert allocator.ledger.version == version
    assert live(allocator) == granted


def test_a_grant_of_the_same_ids_again_gets_the_same_setup_of_its_own(allocator: ResourceAllocator) -> None:
    """The kubelet granting the same IDs again (any order): the same share, environment, mounts; an environment of
    its own (the servicer may change it)."""
    (first,) = allocator.allocate([ALL])
    ceilings = allocator.ceilings()
    (second,) = allocator.allocate([list(reversed(ALL))])
    assert allocator.ceilings() is ceilings  # the live shares are the same: not worked out again
    assert second.record.ended == (first.record.grant,)
    assert second.setup.replica_ids == tuple(reversed(ALL))
    assert (second.setup.share, second.setup.envs, second.setup.mounts) == (
        first.setup.share,
        first.setup.envs,
        first.setup.mounts,
    )
    assert second.setup.envs is not first.setup.envs
    assert live(allocator) == [tuple(reversed(ALL))]


def test_the_same_ids_as_an_adopted_grant_get_their_own_share(allocator: ResourceAllocator) -> None:
    """An adopted grant's share may be a pod's joined one: a grant of its IDs again works its own share out."""
    whole_gpu0 = allocator.grant_for(ids(GPU0, 0, 1, 2, 3)).share
    quarter = allocator.grant_for(ids(GPU0, 0)).share
    allocator.ledger.adopt(tuple(ids(GPU0, 0)), whole_gpu0, ContainerRef(namespace="ml", pod="p", container="c"))
    (again,) = allocator.allocate([ids(GPU0, 0)])
    assert again.record.ended[0].share == whole_gpu0
    assert again.setup.share == quarter


def test_a_withdrawn_allocate_leaves_the_ledger_and_the_ceilings_as_they_were(allocator: ResourceAllocator) -> None:
    allocator.allocate([ids(GPU0, 0)])
    before = (live(allocator), allocator.ceilings(), allocator.ledger.statistics())
    allocator.withdraw(allocator.allocate([ALL, ids(GPU0, 0, 1)]))
    assert (live(allocator), allocator.ceilings(), allocator.ledger.statistics()) == before


def test_the_ceilings_follow_the_live_grants(allocator: ResourceAllocator) -> None:
    assert allocator.ceilings() == WHOLE
    allocator.allocate([ids(GPU0, 0)])  # a quarter of GPU 0
    assert allocator.ceilings() == Ceilings(thread_percentage=25, memory_mib=(4 * GIB_MIB, 16 * GIB_MIB))
    allocator.allocate([ids(GPU0, 0, 1)])  # ends the first: half of GPU 0
    assert allocator.ceilings() == Ceilings(thread_percentage=50, memory_mib=(8 * GIB_MIB, 16 * GIB_MIB))
    allocator.allocate([ALL])  # every replica: the whole hardware
    assert allocator.ceilings() == WHOLE


def test_caps_not_enforced_leave_the_ceilings_at_the_whole_hardware(node_file: Path) -> None:
    text = config().replace("    resources:", "    enforceCaps: false\n    resources:")
    allocator = allocator_for(node_file, text)
    allocator.allocate([ids(GPU0, 0)])
    assert allocator.ceilings() == WHOLE


@pytest.mark.parametrize(
    ("size", "fail_gt_one", "message"),
    [
        (0, False, f"{RESOURCE}: allocation size must be at least 1, not 0"),
        (
            2,
            True,
            f"{RESOURCE}: a request of 2 replicas is refused: sharing.mps.failRequestsGreaterThanOne is true "
            "(the default), which allows 1 per container; set it to false to allow more",
        ),
    ],
)
def test_a_wrong_preferred_allocation_is_refused(node_file: Path, size: int, fail_gt_one: bool, message: str) -> None:
    allocator = allocator_for(node_file, config(fail_gt_one=fail_gt_one))
    with pytest.raises(RequestError) as refused:
        allocator.preferred(ALL, [], size)
    assert str(refused.value) == message


def test_a_preferred_allocation_keeps_the_required_ids_and_grants_nothing(allocator: ResourceAllocator) -> None:
    chosen = allocator.preferred(ALL, ids(GPU1, 3), 2)
    assert len(set(chosen)) == 2
    assert ReplicaId(ids(GPU1, 3)[0]) in chosen
    assert live(allocator) == []


def test_reconciling_adopts_a_listed_grant_with_its_share(allocator: ResourceAllocator) -> None:
    owner = ContainerRef(namespace="ml", pod="train", container="main")
    listed = [ListedGrant(container=owner, replica_ids=tuple(ReplicaId(i) for i in ids(GPU1, 0, 1)))]
    result = allocator.reconcile(listed, now=100.0, grace_s=10.0)
    (adopted,) = result.adopted
    assert (adopted.owner, adopted.replica_ids, adopted.kind) == (owner, tuple(ids(GPU1, 0, 1)), GrantKind.CAPPED)
    assert allocator.ceilings() == Ceilings(thread_percentage=50, memory_mib=(16 * GIB_MIB, 8 * GIB_MIB))


def test_a_preferred_allocation_under_equal_grants_spreads_as_the_nvidia_plugin(node_file: Path) -> None:
    # grants: equal and the default distributed policy: 2 replicas on a two-GPU node come one from each GPU.
    equal = allocator_for(node_file, config(grants="equal"))
    chosen = equal.preferred(ALL, [], 2)
    assert chosen == [ids(GPU0, 0)[0], ids(GPU1, 0)[0]]
    # Proportional grants keep them on one GPU: a 2/4 share of it.
    assert allocator_for(node_file).preferred(ALL, [], 2) == ids(GPU0, 0, 1)
