"""GetPreferredAllocation's choice of replicas, called directly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsagent.base.config import AllocationPolicy
from mpsagent.base.devices import GpuUuid, ReplicaId, format_replica_id
from mpsagent.base.errors import RequestError
from mpsagent.domain.placement import preferred_replicas

DISTRIBUTED = AllocationPolicy.DISTRIBUTED
PACKED = AllocationPolicy.PACKED


def uuid(index: int) -> GpuUuid:
    return GpuUuid(f"GPU-{index}")


def rid(gpu: int, replica: int) -> ReplicaId:
    return format_replica_id(uuid(gpu), replica)


def layout(gpus: int, replicas: int) -> dict[GpuUuid, tuple[ReplicaId, ...]]:
    return {uuid(g): tuple(rid(g, r) for r in range(replicas)) for g in range(gpus)}


def everything(gpus: int, replicas: int) -> list[ReplicaId]:
    return [r for replicas_ in layout(gpus, replicas).values() for r in replicas_]


def choose(
    gpus: int,
    replicas: int,
    size: int,
    policy: AllocationPolicy,
    *,
    used: tuple[tuple[int, int], ...] = (),
    must: tuple[tuple[int, int], ...] = (),
) -> list[ReplicaId]:
    """Replicas in `used` are taken (not available); the rest of the layout is available."""
    taken = {rid(*pair) for pair in used}
    return preferred_replicas(
        gpu_replicas=layout(gpus, replicas),
        available=[r for r in everything(gpus, replicas) if r not in taken],
        must_include=[rid(*pair) for pair in must],
        size=size,
        policy=policy,
        resource="nvidia.com/gpu",
    )


def pairs(*items: tuple[int, int]) -> list[ReplicaId]:
    return [rid(*item) for item in items]


HALF_USED = ((0, 0), (0, 1), (1, 0), (1, 1))


@pytest.mark.parametrize(
    ("gpus", "replicas", "size", "policy", "used", "must", "expected"),
    [
        # One replica on a fresh node: the first GPU, either way.
        pytest.param(3, 4, 1, DISTRIBUTED, (), (), [(0, 0)], id="one-distributed"),
        pytest.param(3, 4, 1, PACKED, (), (), [(0, 0)], id="one-packed"),
        # At most one GPU's worth stays on one GPU (a proportional share of it), either way.
        pytest.param(2, 4, 2, DISTRIBUTED, (), (), [(0, 0), (0, 1)], id="two-distributed"),
        pytest.param(2, 4, 2, PACKED, (), (), [(0, 0), (0, 1)], id="two-packed"),
        pytest.param(3, 4, 3, DISTRIBUTED, (), (), [(0, 0), (0, 1), (0, 2)], id="three-distributed"),
        pytest.param(3, 4, 3, PACKED, (), (), [(0, 0), (0, 1), (0, 2)], id="three-packed"),
        # The policy picks among the GPUs with room: distributed the idlest, packed the busiest.
        pytest.param(3, 4, 2, DISTRIBUTED, ((0, 0),), (), [(1, 0), (1, 1)], id="busy-distributed"),
        pytest.param(3, 4, 2, PACKED, ((1, 0),), (), [(1, 1), (1, 2)], id="busy-packed"),
        # No GPU has room for all of them: replica by replica, distributed to the idle GPU first, packed the busy.
        pytest.param(2, 4, 3, DISTRIBUTED, HALF_USED, (), [(0, 2), (1, 2), (0, 3)], id="split-distributed"),
        pytest.param(2, 4, 3, PACKED, HALF_USED, (), [(0, 2), (0, 3), (1, 2)], id="split-packed"),
        # Packed prefers the busiest GPU even when it is not the first.
        pytest.param(3, 4, 1, PACKED, ((2, 0),), (), [(2, 1)], id="packed-busiest-later-gpu"),
        pytest.param(3, 4, 1, DISTRIBUTED, ((0, 0), (1, 3)), (), [(2, 0)], id="distributed-idlest-gpu"),
        # must_include comes first and counts as in use.
        pytest.param(2, 4, 4, DISTRIBUTED, (), ((1, 2),), [(1, 2), (1, 0), (1, 1), (1, 3)], id="must-distributed"),
        pytest.param(2, 4, 4, PACKED, (), ((1, 2),), [(1, 2), (1, 0), (1, 1), (1, 3)], id="must-packed"),
        pytest.param(2, 4, 2, DISTRIBUTED, (), ((1, 1), (0, 3)), [(1, 1), (0, 3)], id="must-is-everything"),
        pytest.param(2, 4, 2, DISTRIBUTED, (), ((1, 1), (1, 1)), [(1, 1), (1, 0)], id="must-duplicated"),
        # Whole-GPU requests take wholly free GPUs, even when a partly used GPU comes first.
        pytest.param(2, 4, 4, DISTRIBUTED, ((0, 0),), (), [(1, 0), (1, 1), (1, 2), (1, 3)], id="whole-distributed"),
        pytest.param(2, 4, 4, PACKED, ((0, 0),), (), [(1, 0), (1, 1), (1, 2), (1, 3)], id="whole-packed"),
        pytest.param(3, 2, 4, PACKED, ((1, 1),), (), [(0, 0), (0, 1), (2, 0), (2, 1)], id="two-whole-gpus"),
        pytest.param(2, 4, 4, DISTRIBUTED, (), (), [(0, 0), (0, 1), (0, 2), (0, 3)], id="whole-fresh-node"),
        pytest.param(
            3, 4, 5, DISTRIBUTED, (), ((2, 0),), [(2, 0), (0, 0), (0, 1), (0, 2), (0, 3)], id="must-then-whole-gpu"
        ),
        # Not enough wholly free GPUs: the policy decides, replica by replica.
        pytest.param(2, 2, 4, DISTRIBUTED, ((0, 0), (1, 0)), (), None, id="no-whole-gpu-and-too-few"),
        pytest.param(
            3,
            2,
            4,
            DISTRIBUTED,
            ((0, 0), (1, 0)),
            (),
            [(2, 0), (0, 1), (1, 1), (2, 1)],
            id="one-whole-gpu-of-two-wanted-distributed",
        ),
        pytest.param(
            3,
            2,
            4,
            PACKED,
            ((0, 0), (1, 0)),
            (),
            [(0, 1), (1, 1), (2, 0), (2, 1)],
            id="one-whole-gpu-of-two-wanted-packed",
        ),
        pytest.param(1, 4, 0, DISTRIBUTED, (), (), [], id="size-0"),
    ],
)
def test_orders(
    gpus: int,
    replicas: int,
    size: int,
    policy: AllocationPolicy,
    used: tuple[tuple[int, int], ...],
    must: tuple[tuple[int, int], ...],
    expected: list[tuple[int, int]] | None,
) -> None:
    if expected is None:
        with pytest.raises(RequestError):
            choose(gpus, replicas, size, policy, used=used, must=must)
    else:
        assert choose(gpus, replicas, size, policy, used=used, must=must) == pairs(*expected)


@pytest.mark.parametrize("policy", [DISTRIBUTED, PACKED])
@pytest.mark.parametrize(
    ("gpus", "replicas", "size", "used", "must", "phrase"),
    [
        pytest.param(1, 4, 5, (), (), "nvidia.com/gpu: 5 replicas requested but only 4 are available", id="too-few"),
        pytest.param(2, 2, 3, ((0, 0), (1, 1)), (), "3 replicas requested but only 2 are available", id="some-used"),
        pytest.param(
            2,
            4,
            2,
            (),
            ((0, 0), (0, 1), (1, 0)),
            "nvidia.com/gpu: 3 replicas must be included but only 2 were requested",
            id="must-larger",
        ),
        pytest.param(
            1, 4, 0, (), ((0, 0),), "1 replica must be included but only 0 were requested", id="must-with-size-0"
        ),
        pytest.param(
            1, 4, 1, (), ((0, 0), (0, 1)), "2 replicas must be included but only 1 was requested", id="must-2-of-1"
        ),
        pytest.param(1, 1, 2, (), (), "nvidia.com/gpu: 2 replicas requested but only 1 is available", id="one-left"),
        pytest.param(1, 4, 1, ((0, 0), (0, 1), (0, 2), (0, 3)), (), "1 replica requested but only 0 are", id="none"),
    ],
)
def test_refusals(
    policy: AllocationPolicy,
    gpus: int,
    replicas: int,
    size: int,
    used: tuple[tuple[int, int], ...],
    must: tuple[tuple[int, int], ...],
    phrase: str,
) -> None:
    with pytest.raises(RequestError) as info:
        choose(gpus, replicas, size, policy, used=used, must=must)
    assert phrase in str(info.value)


@pytest.mark.parametrize("policy", [DISTRIBUTED, PACKED])
def test_does_not_change_its_inputs(policy: AllocationPolicy) -> None:
    gpu_replicas = layout(2, 3)
    available = everything(2, 3)
    must = [rid(1, 0)]
    preferred_replicas(
        gpu_replicas=gpu_replicas, available=available, must_include=must, size=4, policy=policy, resource="r"
    )
    assert gpu_replicas == layout(2, 3)
    assert available == everything(2, 3)
    assert must == [rid(1, 0)]


@st.composite
def requests(draw: st.DrawFn) -> tuple[int, int, list[ReplicaId], list[ReplicaId], int, AllocationPolicy]:
    gpus = draw(st.integers(1, 5))
    replicas = draw(st.integers(1, 6))
    all_ids = everything(gpus, replicas)
    available = draw(st.lists(st.sampled_from(all_ids), unique=True, min_size=1))
    # Kubelet's mustInclude is a subset of the available devices.
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=len(available)))
    size = draw(st.integers(len(must), len(available)))
    policy = draw(st.sampled_from([DISTRIBUTED, PACKED]))
    return gpus, replicas, available, must, size, policy


@settings(max_examples=300, deadline=None)
@given(request=requests())
def test_property_exact_size_distinct_available_must_first(
    request: tuple[int, int, list[ReplicaId], list[ReplicaId], int, AllocationPolicy],
) -> None:
    gpus, replicas, available, must, size, policy = request
    result = preferred_replicas(
        gpu_replicas=layout(gpus, replicas),
        available=available,
        must_include=must,
        size=size,
        policy=policy,
        resource="nvidia.com/gpu",
    )
    assert len(result) == size
    assert len(set(result)) == size
    assert set(result) <= set(available) | set(must)
    assert result[: len(must)] == must


@settings(max_examples=200, deadline=None)
@given(
    gpus=st.integers(1, 4),
    replicas=st.integers(1, 4),
    data=st.data(),
)
def test_property_must_include_outside_available(gpus: int, replicas: int, data: st.DataObject) -> None:
    """mustInclude need not be a subset of available: the result is still exact, or the request is refused."""
    all_ids = everything(gpus, replicas)
    available = data.draw(st.lists(st.sampled_from(all_ids), unique=True))
    must = data.draw(st.lists(st.sampled_from(all_ids), unique=True))
    size = data.draw(st.integers(0, len(all_ids)))
    policy = data.draw(st.sampled_from([DISTRIBUTED, PACKED]))
    try:
        result = preferred_replicas(
            gpu_replicas=layout(gpus, replicas),
            available=available,
            must_include=must,
            size=size,
            policy=policy,
            resource="r",
        )
    except RequestError:
        assert len(must) > size or len(set(available) - set(must)) < size - len(must)
        return
    assert len(result) == size
    assert len(set(result)) == size
    assert set(result) <= set(available) | set(must)
    assert result[: len(must)] == must


@pytest.mark.parametrize(
    ("policy", "used", "size", "expected"),
    [
        # The NVIDIA plugin's rule: distributed spreads replica by replica from the idlest GPU, so a container of two
        # replicas holds 1/replicas of two GPUs instead of two of one (the same caps either way under `equal`).
        pytest.param(DISTRIBUTED, (), 2, [(0, 0), (1, 0)], id="two-spread"),
        pytest.param(DISTRIBUTED, ((0, 0),), 3, [(1, 0), (0, 1), (1, 1)], id="three-from-the-idlest"),
        # A whole GPU's worth is no whole GPU under `equal`: spread too.
        pytest.param(DISTRIBUTED, (), 4, [(0, 0), (1, 0), (0, 1), (1, 1)], id="four-spread"),
        # packed keeps filling the busiest GPU.
        pytest.param(PACKED, ((1, 0),), 2, [(1, 1), (1, 2)], id="packed-busiest"),
    ],
)
def test_equal_grants_follow_the_policy_replica_by_replica(
    policy: AllocationPolicy, used: tuple[tuple[int, int], ...], size: int, expected: list[tuple[int, int]]
) -> None:
    taken = {rid(*pair) for pair in used}
    chosen = preferred_replicas(
        gpu_replicas=layout(2, 4),
        available=[r for r in everything(2, 4) if r not in taken],
        must_include=[],
        size=size,
        policy=policy,
        resource="nvidia.com/gpu",
        equal_grants=True,
    )
    assert chosen == pairs(*expected)
