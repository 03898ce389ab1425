"""Shares: what a grant of k of a GPU's N IDs gets (env values), the daemon ceilings of live grants, the escape
bound, the 48-client limit, memory-unit resources and their placement. Domain code, no sockets."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsagent.base.config import check_config, parse_config
from mpsagent.base.devices import MIB, NodeGpus, ReplicaId, format_replica_id
from mpsagent.base.errors import ConfigError, RequestError
from mpsagent.documents.report import dra_report, plan_report, render_text
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.claim_shares import claim_shares
from mpsagent.domain.claims import ClaimAllocation, ClaimDevice, ClaimRef, PreparedDevice
from mpsagent.domain.container import ENV_PINNED_MEM_LIMIT, ENV_THREAD_PERCENTAGE, ENV_VISIBLE_DEVICES
from mpsagent.domain.grant_kind import GrantKind, describe_claim_share
from mpsagent.domain.plan import ResourcePlan
from mpsagent.domain.shares import Ceilings
from mpsagent.mps.commands import daemon_default_commands
from mpsagent.mps.state import DaemonState, daemon_state, recorded_ceilings
from mpsagent_testing.domain import H200, MPS_ROOT, T4, gpus_of, node_gpus, node_plan, resource_plan, uuid

GIB = 1024**3
H200_BYTES = H200.memory_bytes
T4_BYTES = T4.memory_bytes
SHM = MPS_ROOT / "shm"


def h200s(count: int, memory_bytes: int = H200_BYTES) -> NodeGpus:
    return node_gpus(*gpus_of(count, H200, memory_bytes=memory_bytes))


def resource(
    entry: str, *, gpus: int = 1, mps: str = "failRequestsGreaterThanOne: false", memory_bytes: int = H200_BYTES
) -> ResourcePlan:
    return resource_plan(h200s(gpus, memory_bytes), entry, mps=mps)


def ids(*counts: int) -> tuple[ReplicaId, ...]:
    """k_g IDs of each GPU g (by host index), from its first ID."""
    return tuple(format_replica_id(uuid(g), i) for g, k in enumerate(counts) for i in range(k))


def envs(plan: ResourcePlan, replica_ids: tuple[ReplicaId, ...]) -> dict[str, str]:
    return ResourceAllocator(plan, SHM).grant_for(replica_ids).envs


# --- the share table ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [4, 10, 48])
def test_k_of_n_replicas_of_one_gpu(replicas: int) -> None:
    plan = resource(f"{{name: gpu, replicas: {replicas}}}")
    for k in range(1, replicas):
        got = envs(plan, ids(k))
        assert got[ENV_THREAD_PERCENTAGE] == str(max(1, 100 * k // replicas)), k
        assert got[ENV_PINNED_MEM_LIMIT] == f"0={H200_BYTES * k // replicas // MIB}M", k
    whole = envs(plan, ids(replicas))
    assert ENV_THREAD_PERCENTAGE not in whole and ENV_PINNED_MEM_LIMIT not in whole


@pytest.mark.parametrize(
    ("replicas", "counts", "threads", "memory"),
    [
        pytest.param(4, (1,), "25", "0=35942M", id="1-of-4"),
        pytest.param(4, (2,), "50", "0=71885M", id="2-of-4"),
        pytest.param(4, (3,), "75", "0=107828M", id="3-of-4"),
        pytest.param(10, (1,), "10", "0=14377M", id="1-of-10"),
        pytest.param(10, (7,), "70", "0=100639M", id="7-of-10"),
        pytest.param(48, (1,), "2", "0=2995M", id="1-of-48"),
        pytest.param(48, (47,), "97", "0=140775M", id="47-of-48"),
        # Mixes: the thread percentage is the smallest share; memory per GPU the container holds, keyed by its
        # ordinal in the container (the held GPUs in the daemon's order); no entry for a GPU it does not hold.
        pytest.param(4, (1, 2), "25", "0=35942M,1=71885M", id="1+2-of-4"),
        pytest.param(4, (4, 1), "25", "0=143771M,1=35942M", id="whole+1-is-capped"),
        pytest.param(4, (0, 3), "75", "0=107828M", id="held-gpu1-only"),
        pytest.param(10, (5, 10, 2), "20", "0=71885M,1=143771M,2=28754M", id="three-gpus"),
        pytest.param(4, (2, 0, 1), "25", "0=71885M,1=35942M", id="gpu0-and-gpu2"),
    ],
)
def test_share_table(replicas: int, counts: tuple[int, ...], threads: str, memory: str) -> None:
    plan = resource(f"{{name: gpu, replicas: {replicas}}}", gpus=max(len(counts), 1))
    got = envs(plan, ids(*counts))
    assert (got[ENV_THREAD_PERCENTAGE], got[ENV_PINNED_MEM_LIMIT]) == (threads, memory)


@pytest.mark.parametrize("counts", [(4,), (4, 4), (0, 4), (4, 0, 4)])
def test_whole_gpus_get_no_caps_and_only_their_gpus(counts: tuple[int, ...]) -> None:
    plan = resource("{name: gpu, replicas: 4}", gpus=3)
    grant = ResourceAllocator(plan, SHM).grant_for(ids(*counts))
    assert grant.share.kind is GrantKind.FULL
    assert ENV_THREAD_PERCENTAGE not in grant.envs and ENV_PINNED_MEM_LIMIT not in grant.envs
    assert grant.envs[ENV_VISIBLE_DEVICES] == ",".join(uuid(g) for g, k in enumerate(counts) if k)


def test_a_share_is_said_in_one_wording_on_both_routes() -> None:
    """The logs, `--status` and `--once` say a share one way (`grant_kind.describe_share`): what it holds, of a
    resource's IDs or a claim's memory, then `(whole)` for a full share or a capped one's thread cap."""
    plan = resource("{name: gpu, replicas: 4}", gpus=2)
    assert plan.shares.share_of(ids(1)).describe() == "1/4 of GPU 0, threads 25%"
    assert plan.shares.share_of(ids(4, 4)).describe() == "4/4 of GPU 0, 4/4 of GPU 1 (whole)"
    whole = PreparedDevice(
        request="gpu", pool="n", device="gpu-0", share_id=None, cdi_device_ids=("mpsagent.io/mps-share=0-gpu-0",),
        resource="gpu", gpu=uuid(0), memory_mib=143771, thread_percentage=100, kind=GrantKind.FULL,
    )  # fmt: skip
    assert describe_claim_share(whole) == "143771 MiB (whole)"
    capped = msgspec.structs.replace(
        whole, memory_mib=8192, thread_percentage=5, kind=GrantKind.CAPPED, rounded_off_bytes=1
    )
    assert describe_claim_share(capped) == (
        "8192 MiB (the allocation rounded down to whole MiB: 1 byte left out), threads 5%"
    )


def test_equal_grants_keep_the_nvidia_rule() -> None:
    plan = resource("{name: gpu, replicas: 4}", gpus=2, mps="grants: equal\nfailRequestsGreaterThanOne: false\n")
    for counts in [(1,), (2,), (4,), (4, 3)]:
        got = envs(plan, ids(*counts))
        # The NVIDIA rule's 1/4 on each GPU the container holds (one entry each), whatever it holds.
        expected = ",".join(f"{o}=35942M" for o in range(sum(1 for k in counts if k)))
        assert (got[ENV_THREAD_PERCENTAGE], got[ENV_PINNED_MEM_LIMIT]) == ("25", expected), counts
    assert ENV_THREAD_PERCENTAGE not in envs(plan, ids(4, 4))


# --- exact shares: NVIDIA's arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "memory_bytes", "held", "mib"),
    [
        # The NVIDIA device plugin's figure: the GPU's bytes / replicas / 1024 / 1024, rounded down.
        pytest.param("{name: gpu, replicas: 4}", 81559 * MIB, 1, 20389, id="80GB-of-4"),
        pytest.param("{name: gpu, replicas: 4}", 16 * GIB, 1, 4096, id="16GiB-of-4"),
        pytest.param("{name: gpu, replicas: 3}", 16 * GIB, 1, 5461, id="16GiB-of-3"),
        pytest.param("{name: gpu, replicas: 3}", 16 * GIB, 2, 10922, id="16GiB-2-of-3"),
        pytest.param("{name: gpu, replicas: 4}", 15360 * MIB, 1, 3840, id="T4-15360MiB-of-4"),
        pytest.param("{name: gpu, replicas: 4}", H200_BYTES, 1, 35942, id="H200-of-4"),
        pytest.param("{name: gpu, replicas: 48}", 16 * GIB, 1, 341, id="16GiB-of-48"),
        # Memory units: exactly k units.
        pytest.param("{name: gpu-mem, memoryUnit: 2Gi}", 16 * GIB, 3, 6144, id="2Gi-three-times"),
        pytest.param("{name: gpu-mem, memoryUnit: 1.5Gi}", 16 * GIB, 1, 1536, id="1.5Gi-once"),
        pytest.param("{name: gpu-mem, memoryUnit: 1.5Gi}", 16 * GIB, 3, 4608, id="1.5Gi-three-times"),
        pytest.param("{name: gpu-mem, memoryUnit: 8Gi}", H200_BYTES, 1, 8192, id="8Gi-once"),
    ],
)
def test_a_capped_share_is_the_exact_figure_a_user_computes(entry: str, memory_bytes: int, held: int, mib: int) -> None:
    """No grid: the container's cap and the daemon's ceiling are the exact share, as the NVIDIA plugin gives it."""
    plan = resource(entry, memory_bytes=memory_bytes)
    share = plan.shares.share_of(ids(held))
    assert share.container_memory_mib == (mib,)
    assert plan.shares.ceilings([share]).memory_mib == (mib,)
    assert envs(plan, ids(held))[ENV_PINNED_MEM_LIMIT] == f"0={mib}M"


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.integers(2, 48),
    held=st.integers(1, 47),
    memory_bytes=st.integers(1 * GIB, 192 * GIB),
    rule=st.sampled_from(["proportional", "equal"]),
)
def test_a_share_is_nvidias_arithmetic_for_any_gpu(replicas: int, held: int, memory_bytes: int, rule: str) -> None:
    """One replica is the NVIDIA plugin's figure (floor(bytes / replicas / MiB), 100 // replicas %), under either
    grant rule; k replicas (proportional) floor(bytes * k / replicas / MiB)."""
    held = min(held, replicas - 1)
    mps = f"grants: {rule}\nfailRequestsGreaterThanOne: false\n"
    plan = resource(f"{{name: gpu, replicas: {replicas}}}", mps=mps, memory_bytes=memory_bytes)
    one = plan.shares.share_of(ids(1))
    assert one.container_memory_mib == (memory_bytes // replicas // 1024 // 1024,)
    assert one.thread_percentage == 100 // replicas
    if rule == "proportional":
        share = plan.shares.share_of(ids(held))
        assert share.container_memory_mib == (memory_bytes * held // replicas // MIB,)
        assert share.thread_percentage == max(1, 100 * held // replicas)
    assert plan.shares.smallest_caps().memory_mib == one.container_memory_mib


# --- IDs the resource does not advertise ----------------------------------------------------------------------


def gpu_ids(gpu: int, *indices: int | str) -> list[ReplicaId]:
    return [ReplicaId(f"{uuid(gpu)}::{i}") for i in indices]


QUARTER_OF_16GIB = 4096


@pytest.mark.parametrize(
    ("held", "thread", "memory"),
    [
        # After a restart with 4 replicas instead of 8: 4 of the old 8 (half the GPU) is not the whole GPU.
        pytest.param(gpu_ids(0, 4, 5, 6, 7), 25, (QUARTER_OF_16GIB, 16384), id="old-indices-only"),
        # Not "6 of 4" (24576 MiB of a 16384 MiB GPU): the smallest share of both GPUs it names.
        pytest.param(
            gpu_ids(0, 0, 1, 2, 3, 4, 5) + gpu_ids(1, 0), 25, (QUARTER_OF_16GIB, QUARTER_OF_16GIB), id="six-of-four"
        ),
        pytest.param(gpu_ids(0, 0, 1, 9), 25, (QUARTER_OF_16GIB, 16384), id="one-old-index-among-current-ones"),
        pytest.param(gpu_ids(0, "01", "x", "-1", "", "9" * 5000), 25, (QUARTER_OF_16GIB, 16384), id="no-index"),
        # A GPU outside the resource: the smallest caps of every GPU, as before.
        pytest.param(
            [ReplicaId("GPU-gone::0"), ReplicaId("not an id")],
            25,
            (QUARTER_OF_16GIB, QUARTER_OF_16GIB),
            id="no-gpu-of-the-resource",
        ),
    ],
)
def test_ids_the_resource_does_not_advertise_count_as_the_smallest_share(
    held: list[ReplicaId], thread: int, memory: tuple[int, int]
) -> None:
    plan = resource("{name: gpu, replicas: 4}", gpus=2, memory_bytes=16 * GIB)
    share = plan.shares.share_of(held)
    assert share.kind is GrantKind.CAPPED
    assert plan.shares.ceilings([share]) == Ceilings(thread_percentage=thread, memory_mib=memory)
    assert all(plan.shares.advertises(r) is False for r in held if not r.endswith(("::0", "::1", "::2", "::3")))
    assert all(plan.shares.advertises(r) for r in plan.device_ids)


def test_ids_known_distinct_get_the_share_of_any_listing_of_them() -> None:
    """An Allocate's checked request is counted as given (`distinct`); a listing with repeats is deduplicated."""
    plan = resource("{name: gpu, replicas: 4}", gpus=2, memory_bytes=16 * GIB)
    held = ids(3, 1)
    assert plan.shares.share_of(held, distinct=True) == plan.shares.share_of(held + held[:2])
    assert plan.shares.share_of(held, distinct=True) is plan.shares.share_of(tuple(reversed(held)), distinct=True)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    layout=st.tuples(st.sampled_from([1, 2, 3, 4, 8, 48]), st.integers(1, 3)),
    units=st.booleans(),
)
def test_no_listing_of_any_ids_lifts_a_ceiling_above_its_gpu(data: st.DataObject, layout, units: bool) -> None:
    """Whatever IDs a grant names (indices beyond the resource's, duplicates, GPUs outside it, no IDs at all), no
    share asks more than a GPU has and no ceiling is above a GPU's memory."""
    replicas, gpus = layout
    entry = "{name: gpu-mem, memoryUnit: 4Gi}" if units else f"{{name: gpu, replicas: {replicas}}}"
    plan = resource(entry, gpus=gpus, memory_bytes=16 * GIB)
    anything = st.builds(
        lambda g, i: ReplicaId(f"{uuid(g)}::{i}"), st.integers(0, 3), st.integers(0, 60) | st.text(max_size=3)
    )
    live = [
        plan.shares.share_of(data.draw(st.lists(anything | st.sampled_from(plan.device_ids), max_size=12)))
        for _ in range(data.draw(st.integers(0, 4)))
    ]
    for share in live:
        assert 1 <= share.thread_percentage <= 100
        assert all(held.held <= held.of for held in share.gpus)
        caps = tuple((gpu.ordinal, mib) for gpu, mib in zip(share.gpus, share.container_memory_mib, strict=False))
        for ordinal, mib in (*share.bounds, *caps):
            assert mib <= plan.shares.gpus[ordinal].memory_mib
        # One entry per GPU the container holds, never one for a GPU it cannot see.
        assert len(share.container_memory_mib) in (0, len(share.gpus))
    ceilings = plan.shares.ceilings(live)
    full = plan.shares.full_hardware()
    assert all(c <= f for c, f in zip(ceilings.memory_mib, full.memory_mib, strict=True))
    assert ceilings.thread_percentage <= 100


# --- ceilings and the escape bound -----------------------------------------------------------------------------


def test_ceilings_follow_the_largest_live_share_per_gpu_and_resource() -> None:
    plan = resource("{name: gpu, replicas: 4}", gpus=2)
    shares = plan.shares
    quarter, half, whole1 = (shares.share_of(ids(*c)) for c in [(1,), (2,), (0, 4)])
    full, q, h = H200_BYTES // MIB, 35942, 71885
    assert shares.ceilings([]) == Ceilings(thread_percentage=100, memory_mib=(full, full))
    assert shares.ceilings([quarter]) == Ceilings(thread_percentage=25, memory_mib=(q, full))
    assert shares.ceilings([quarter, half]) == Ceilings(thread_percentage=50, memory_mib=(h, full))
    assert shares.ceilings([quarter, half, whole1]) == Ceilings(thread_percentage=100, memory_mib=(h, full))
    bounds = shares.escape_bounds(shares.ceilings([quarter, half]), [quarter, half])
    assert [(b.live_grants, b.memory_ceiling_mib, b.memory_escape_mib, b.thread_escape) for b in bounds] == [
        (2, h, h - q, 25),
        (0, full, 0, 0),
    ]


def test_without_enforcement_the_daemon_holds_the_full_hardware() -> None:
    plan = resource("{name: gpu, replicas: 4}", mps="enforceCaps: false\n")
    assert plan.shares.ceilings([plan.shares.share_of(ids(1))]) == plan.shares.full_hardware()
    assert plan.shares.unreconciled_ceilings() == plan.shares.full_hardware()


def test_until_the_grants_are_known_the_daemon_holds_the_smallest_share() -> None:
    plan = resource("{name: gpu, replicas: 4}", gpus=2)
    q = 35942
    assert plan.shares.unreconciled_ceilings() == Ceilings(thread_percentage=25, memory_mib=(q, q))
    units = resource("{name: gpu-mem, memoryUnit: 8Gi}")
    assert units.shares.unreconciled_ceilings() == Ceilings(thread_percentage=5, memory_mib=(8192,))


# --- memory units -------------------------------------------------------------------------------------------


def test_a_memory_unit_resource_advertises_what_fits() -> None:
    plan = resource("{name: gpu-mem, memoryUnit: 8Gi}", gpus=2)
    assert plan.name == "nvidia.com/gpu-mem"
    assert len(plan.device_ids) == 2 * (H200_BYTES // (8 * GIB)) == 34
    assert plan.device_ids[0] == f"{uuid(0)}::0" and plan.device_ids[-1] == f"{uuid(1)}::16"
    got = envs(plan, ids(2))
    assert got[ENV_PINNED_MEM_LIMIT] == "0=16384M"
    assert got[ENV_THREAD_PERCENTAGE] == str(100 * 2 // 17)
    assert envs(plan, ids(7))[ENV_PINNED_MEM_LIMIT] == "0=57344M"
    assert ENV_PINNED_MEM_LIMIT not in envs(plan, ids(17))


@pytest.mark.parametrize(
    ("unit", "mib"),
    [
        ("1Gi", 1024),
        ("512Mi", 512),
        ("8G", 7629),
        ("1.5Gi", 1536),
        ("2Gi", 2048),
        (1073741824, 1024),
        # The exponent form Kubernetes accepts too (1e9 bytes is 953 MiB), and its other number forms.
        ("1e9", 953),
        ("1E9", 953),
        ("2.5e9", 2384),
        ("25e+8", 2384),
        ("3000e-3M", None),
        (".5Gi", 512),
        ("+1Gi", 1024),
        ("4294967296e-1", 409),
        ('"8e9"', 7629),
    ],
)
def test_memory_units_are_kubernetes_quantities(unit: str | int, mib: int | None) -> None:
    if mib is None:  # an exponent with a suffix is not a quantity
        with pytest.raises(ConfigError, match="is not a Kubernetes quantity"):
            resource(f"{{name: gpu-mem, memoryUnit: {unit}}}", memory_bytes=T4_BYTES)
        return
    plan = resource(f"{{name: gpu-mem, memoryUnit: {unit}}}", memory_bytes=T4_BYTES)
    assert envs(plan, ids(1))[ENV_PINNED_MEM_LIMIT] == f"0={mib}M"


def test_a_memory_unit_in_json_may_be_a_number_in_exponent_form() -> None:
    """JSON (and so a config file written as JSON) carries 1.5e9 as a number; Kubernetes reads it as 1500000000."""
    text = '{"version": "v1", "sharing": {"mps": {"resources": [{"name": "m", "memoryUnit": 1.5e9}]}}}'
    (spec,) = check_config(parse_config(text, "config.json")).resources
    assert spec.memory_unit_bytes == 1_500_000_000


@pytest.mark.parametrize(
    ("entry", "phrase"),
    [
        ("{name: m, memoryUnit: 8Gi, replicas: 2}", "either `replicas` or `memoryUnit`, not both"),
        ("{name: m, memoryUnit: 0}", "at least 1Mi"),
        ("{name: m, memoryUnit: eight}", "`eight` is not a Kubernetes quantity"),
        ("{name: m, memoryUnit: 8GB}", "`8GB` is not a Kubernetes quantity"),
        ("{name: m, memoryUnit: 1e3}", "`1e3` is less than 1Mi"),
        ("{name: m, memoryUnit: -1Gi}", "`-1Gi` is less than 1Mi"),
        ("{name: m, memoryUnit: 1e99999}", "`1e99999` is not a Kubernetes quantity"),
        ("{name: m, memoryUnit: 1e30}", "larger than GPU 0's memory (143771 MiB)"),
        ("{name: m, memoryUnit: 200Gi}", "larger than GPU 0's memory (143771 MiB)"),
        (
            "{name: m, memoryUnit: 1Mi}",
            "makes GPU 0 advertise 143771 device IDs, more than the 256 a GPU may have; use a unit of at least 562Mi",
        ),
    ],
)
def test_memory_unit_errors_name_the_key(entry: str, phrase: str) -> None:
    with pytest.raises(ConfigError) as refused:
        resource(entry)
    assert refused.value.path == "sharing.mps.resources[0].memoryUnit"
    assert phrase in refused.value.message


def test_grants_must_be_proportional_or_equal() -> None:
    with pytest.raises(ConfigError) as refused:
        resource("{name: gpu, replicas: 4}", mps="grants: fair\n")
    assert refused.value.path == "sharing.mps.grants"
    assert "use one of: proportional, equal" in refused.value.message


def test_fail_requests_greater_than_one_is_about_replicas_only() -> None:
    units = ResourceAllocator(resource("{name: gpu-mem, memoryUnit: 8Gi}", mps=""), SHM)
    assert len(units.grant_for(ids(3)).replica_ids) == 3
    replicas = ResourceAllocator(resource("{name: gpu, replicas: 4}", mps=""), SHM)
    with pytest.raises(RequestError, match=r"a request of 3 replicas is refused: sharing\.mps\.failRequests"):
        replicas.grant_for(ids(3))


# --- the 48-client limit ------------------------------------------------------------------------------------


def test_the_49th_live_grant_on_a_gpu_is_refused_with_nothing_changed() -> None:
    plan = resource("{name: gpu-mem, memoryUnit: 1Gi}", gpus=2)  # 140 units a GPU
    allocator = ResourceAllocator(plan, SHM)
    for i in range(48):
        allocator.allocate([[format_replica_id(uuid(0), i)]])
    before = (allocator.ledger.version, allocator.ledger.statistics(), allocator.ceilings())
    with pytest.raises(RequestError) as refused:
        allocator.allocate([[format_replica_id(uuid(1), 0)], [format_replica_id(uuid(0), 48)]])
    assert str(refused.value) == (
        f"nvidia.com/gpu-mem: GPU {uuid(0)} would hold 49 MPS clients (device-plugin grants and claims), but MPS "
        f"serves at most 48; nothing was granted (asked: '{format_replica_id(uuid(1), 0)}', "
        f"'{format_replica_id(uuid(0), 48)}'): ask for IDs of another GPU, or wait for a container or claim on it "
        "to end"
    )
    assert (allocator.ledger.version, allocator.ledger.statistics(), allocator.ceilings()) == before
    # A grant that replaces one of the 48 (its replica granted again: that container ended) is no 49th.
    allocator.allocate([[format_replica_id(uuid(0), 0), format_replica_id(uuid(0), 100)]])
    # GetPreferredAllocation avoids the full GPU.
    available = [r for r in plan.device_ids if allocator.ledger.holder(r) is None]
    assert {r.split("::")[0] for r in allocator.preferred(available, [], 2)} == {uuid(1)}


# --- placement of memory units ---------------------------------------------------------------------------------


def test_memory_units_go_to_the_fullest_gpu_that_fits_else_the_fewest_gpus() -> None:
    plan = resource("{name: gpu-mem, memoryUnit: 8Gi}", gpus=3)  # 17 units a GPU
    allocator = ResourceAllocator(plan, SHM)
    allocator.allocate([list(ids(0, 10)[:0]) + [format_replica_id(uuid(1), i) for i in range(10)]])
    allocator.allocate([[format_replica_id(uuid(2), i) for i in range(4)]])
    available = [r for r in plan.device_ids if allocator.ledger.holder(r) is None]  # free: 17, 7, 13

    def gpus_of(chosen: list[ReplicaId]) -> list[str]:
        return sorted({r.split("::")[0] for r in chosen})

    assert gpus_of(allocator.preferred(available, [], 7)) == [uuid(1)]  # best fit: exactly full
    assert gpus_of(allocator.preferred(available, [], 8)) == [uuid(2)]
    assert gpus_of(allocator.preferred(available, [], 14)) == [uuid(0)]
    chosen = allocator.preferred(available, [], 30)  # no GPU fits: the roomiest first
    assert len(chosen) == 30 and gpus_of(chosen) == [uuid(0), uuid(2)]


# --- properties -----------------------------------------------------------------------------------------------

layouts = st.tuples(st.sampled_from([1, 2, 4, 10, 48]), st.integers(1, 3))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), layout=layouts)
def test_no_share_exceeds_its_gpu_and_live_caps_never_sum_above_memory(data: st.DataObject, layout) -> None:
    replicas, gpus = layout
    plan = resource(f"{{name: gpu, replicas: {replicas}}}", gpus=gpus)
    allocator = ResourceAllocator(plan, SHM)
    free = list(plan.device_ids)
    for _ in range(data.draw(st.integers(0, 6))):
        if not free:
            break
        chosen = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True))
        allocator.allocate([chosen])
        free = [r for r in free if r not in chosen]
        if data.draw(st.booleans()):  # a container ends
            live_ids = [g.grant_id for g in allocator.ledger.live_grants()]
            allocator.ledger.release([data.draw(st.sampled_from(live_ids))])
    live = tuple(g.share for g in allocator.ledger.live_grants())
    # The ledger's running tally gives what a fresh count of the live grants gives.
    assert allocator.ceilings() == plan.shares.ceilings(live)
    for gpu in plan.shares.gpus:
        on_gpu = [held for share in live for held in share.gpus if held.ordinal == gpu.ordinal]
        assert all(held.held <= held.of for held in on_gpu)
        assert sum(held.memory_mib for held in on_gpu) <= gpu.memory_mib
    for share in live:
        assert 1 <= share.thread_percentage <= 100
    ceilings = allocator.ceilings()
    assert all(c <= g.memory_mib for c, g in zip(ceilings.memory_mib, plan.shares.gpus, strict=True))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_refused_request_changes_nothing(data: st.DataObject) -> None:
    plan = resource("{name: gpu-mem, memoryUnit: 2Gi}", gpus=2, memory_bytes=T4_BYTES)  # 8 units a GPU
    allocator = ResourceAllocator(plan, SHM)
    for _ in range(data.draw(st.integers(0, 4))):
        allocator.allocate([data.draw(st.lists(st.sampled_from(plan.device_ids), min_size=1, max_size=4, unique=True))])
    before = (
        sorted((g.grant_id, g.replica_ids) for g in allocator.ledger.live_grants()),
        allocator.ledger.statistics(),
        allocator.ceilings(),
    )
    good = data.draw(st.lists(st.sampled_from(plan.device_ids), min_size=1, max_size=3, unique=True))
    with pytest.raises(RequestError):
        allocator.allocate([good, [*good[:1], "GPU-unknown::0"]])
    after = (
        sorted((g.grant_id, g.replica_ids) for g in allocator.ledger.live_grants()),
        allocator.ledger.statistics(),
        allocator.ceilings(),
    )
    assert after == before


# --- daemon.json ------------------------------------------------------------------------------------------------


def test_daemon_state_records_the_ceilings_and_reads_an_older_agents_mode() -> None:
    plan = resource("{name: gpu, replicas: 4}", gpus=2)
    shares = plan.shares
    half = shares.ceilings([shares.share_of(ids(2))])
    state = daemon_state(
        pid=4242, visible_devices="x", ceilings=half, shares=shares, multi_user=True, original_compute_modes={}
    )
    written = msgspec.json.decode(msgspec.json.encode(state))
    assert written["mode"] == "capped"
    assert written["ceilings"] == {"threadPercentage": 50, "memoryMib": [71885, 143771]}
    assert recorded_ceilings(msgspec.json.decode(msgspec.json.encode(state), type=DaemonState), shares) == half
    older = b'{"pid": 4242, "visibleDevices": "x", "mode": "%s"}'
    assert recorded_ceilings(msgspec.json.decode(older % b"full", type=DaemonState), shares) == shares.full_hardware()
    capped = msgspec.json.decode(older % b"capped", type=DaemonState)
    assert recorded_ceilings(capped, shares) == shares.smallest_caps()
    assert recorded_ceilings(msgspec.json.decode(older % b"odd", type=DaemonState), shares) is None
    # Ceilings of a daemon that served other GPUs do not fit this resource: not adopted as its ceilings.
    other = resource("{name: gpu, replicas: 4}", gpus=1).shares
    assert recorded_ceilings(msgspec.json.decode(msgspec.json.encode(state), type=DaemonState), other) is None


# --- the figures a user computes, everywhere they show ------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "memory_bytes", "held", "figure", "once_figure"),
    [
        pytest.param("{name: gpu, replicas: 4}", 81559 * MIB, 1, "20389M", "20389M", id="80GB-of-4"),
        pytest.param("{name: gpu, replicas: 4}", 16 * GIB, 1, "4096M", "4096M", id="16GiB-of-4"),
        pytest.param("{name: gpu, replicas: 3}", 16 * GIB, 1, "5461M", "5461M", id="16GiB-of-3"),
        # The dry run shows 1 unit, 7 units and a whole GPU: 7 x 2Gi.
        pytest.param("{name: gpu-mem, memoryUnit: 2Gi}", 16 * GIB, 3, "6144M", "14336M", id="three-2Gi-units"),
    ],
)
def test_a_device_plugin_share_is_one_figure_in_the_env_the_daemons_defaults_and_once(
    entry: str, memory_bytes: int, held: int, figure: str, once_figure: str
) -> None:
    plan = resource(entry, memory_bytes=memory_bytes)
    share = plan.shares.share_of(ids(held))
    assert envs(plan, ids(held))[ENV_PINNED_MEM_LIMIT] == f"0={figure}"
    assert f"set_default_device_pinned_mem_limit 0 {figure}" in daemon_default_commands(plan.shares.ceilings([share]))
    report = plan_report(
        node_plan(h200s(1, memory_bytes), entry),
        control_bin="nvidia-cuda-mps-control",
        manages_compute_mode=True,
        multi_user_offered=True,
    )
    once = render_text(report)
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={once_figure}" in once
    assert f", memory 0={once_figure}" in once  # the example's daemon ceilings


def test_a_40gi_claim_is_40960m_in_its_env_the_daemons_defaults_and_once() -> None:
    plan = node_plan(h200s(1, 81559 * MIB), "{name: gpu, replicas: 4}")
    device = ClaimDevice(request="gpu", pool="n", device="gpu-0", memory_bytes=40 * GIB)
    (share,) = claim_shares(
        plan, ClaimAllocation(claim=ClaimRef(namespace="a", name="b", uid="0"), devices=(device,)), "n"
    )
    assert share.edits.envs[ENV_PINNED_MEM_LIMIT] == "0=40960M"
    ceilings = plan.resources[0].shares.ceilings([share.share])
    assert "set_default_device_pinned_mem_limit 0 40960M" in daemon_default_commands(ceilings)
    (example,) = [e for e in dra_report(plan, "n").examples if e.title == "40Gi"]
    assert (example.memory_mib, example.envs[ENV_PINNED_MEM_LIMIT]) == (40960, "0=40960M")
    assert example.ceilings == "threads 50%, memory 0=40960M"
