"""DRA domain code (no sockets): the node's ResourceSlice (`node_slice`), a claim's share of each allocated GPU
(`claim_shares`), its opaque parameters (`share_parameters`), and the ceilings of claims' shares in a ledger."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsagent.base.devices import MIB, format_replica_id
from mpsagent.base.errors import RequestError
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.claim_shares import (
    ENV_CLIENT_PRIORITY,
    PARAMETERS_API_VERSION,
    PARAMETERS_KIND,
    ClaimShare,
    claim_shares,
    node_slice,
    share_parameters,
)
from mpsagent.domain.claims import (
    DRA_DRIVER,
    CapacityPolicy,
    ClaimAllocation,
    ClaimDevice,
    ClaimRef,
    OpaqueConfig,
)
from mpsagent.domain.container import (
    ENV_PINNED_MEM_LIMIT,
    ENV_PIPE_DIRECTORY,
    ENV_THREAD_PERCENTAGE,
    ENV_VISIBLE_DEVICES,
)
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.ledger import Ledger
from mpsagent.domain.plan import NodePlan, ResourcePlan
from mpsagent.domain.shares import Share
from mpsagent_testing.domain import H100, T4, gpu, gpus_of, node_gpus, node_plan, uuid

GIB = 1024**3
WHOLE_MIB = 81920
GPU_BYTES = 80 * GIB + 512 * 1024
"""An 80 GiB GPU with half a MiB more: the slice's memory is whole MiB, floored."""
WHOLE_BYTES = WHOLE_MIB * MIB
NODE = "node-a"
CLAIM = ClaimRef(namespace="ml", name="train-gpu", uid="0b5f1c52-8f5e-4a55-9b0e-3f8a1c2d4e6f")
CAP_ENVS = (ENV_THREAD_PERCENTAGE, ENV_PINNED_MEM_LIMIT, ENV_CLIENT_PRIORITY)


def three_gpus(driver_version: str = "580.65.06", *, order: tuple[int, ...] = (0, 1, 2)) -> NodePlan:
    """Two GPUs (0 and 1) in resource `gpu`, GPU 2 in resource `other`; `order` lists the resources' GPUs so that
    the slice's order can be told apart from the plan's."""
    first, second = sorted(order[:2]), order[2]
    return node_plan(
        node_gpus(*gpus_of(3, H100, memory_bytes=GPU_BYTES), driver_version=driver_version),
        f"{{name: other, replicas: 2, devices: [{second}]}}",
        f"{{name: gpu, replicas: 4, devices: [{first[0]}, {first[1]}]}}",
    )


PLAN = three_gpus()
GPU_RESOURCE = next(r for r in PLAN.resources if r.name.endswith("/gpu"))
OTHER_RESOURCE = next(r for r in PLAN.resources if r.name.endswith("/other"))


def device(
    name: str = "gpu-0",
    *,
    memory: int | None = 30 * GIB,
    compute: int | None = None,
    pool: str = NODE,
    request: str = "gpu",
) -> ClaimDevice:
    return ClaimDevice(request=request, pool=pool, device=name, memory_bytes=memory, compute=compute)


def allocation(*devices: ClaimDevice, configs: tuple[OpaqueConfig, ...] = ()) -> ClaimAllocation:
    return ClaimAllocation(claim=CLAIM, devices=devices, configs=configs)


def one_share(dev: ClaimDevice, configs: tuple[OpaqueConfig, ...] = ()) -> ClaimShare:
    (share,) = claim_shares(PLAN, allocation(dev, configs=configs), NODE)
    return share


def parameters(source: str = "claim", requests: tuple[str, ...] = (), **fields: object) -> OpaqueConfig:
    document = {"apiVersion": PARAMETERS_API_VERSION, "kind": PARAMETERS_KIND, **fields}
    return OpaqueConfig(requests=requests, parameters=json.dumps(document).encode(), source=source)


def raw(text: str | bytes, source: str = "claim") -> OpaqueConfig:
    data = text.encode() if isinstance(text, str) else text
    return OpaqueConfig(requests=(), parameters=data, source=source)


# --- the node's ResourceSlice -----------------------------------------------------------------------------------


def test_the_slice_has_one_device_per_shared_gpu_with_its_attributes() -> None:
    slice_ = node_slice(PLAN, NODE)
    assert (slice_.driver, slice_.node, slice_.pool) == (DRA_DRIVER, NODE, NODE)
    assert [(d.name, d.index, d.uuid, d.resource) for d in slice_.devices] == [
        ("gpu-0", 0, uuid(0), GPU_RESOURCE.name),
        ("gpu-1", 1, uuid(1), GPU_RESOURCE.name),
        ("gpu-2", 2, uuid(2), OTHER_RESOURCE.name),
    ]
    for dev in slice_.devices:
        assert dev.product_name == "NVIDIA H100 80GB HBM3"
        assert dev.compute_capability == "9.0.0"
        assert dev.driver_version == "580.65.6"


def test_the_slice_offers_each_gpus_whole_memory_in_mib_steps_and_compute_in_per_cent() -> None:
    for dev in node_slice(PLAN, NODE).devices:
        assert dev.memory == CapacityPolicy(
            value=WHOLE_BYTES, default=WHOLE_BYTES, minimum=MIB, maximum=WHOLE_BYTES, step=MIB
        )
        assert dev.memory.value < GPU_BYTES  # floored to whole MiB
        assert dev.compute == CapacityPolicy(value=100, default=0, minimum=0, maximum=100, step=1)


def test_each_claim_consumes_one_of_the_mps_clients_a_gpus_server_takes() -> None:
    """48 from Volta on, 16 before: the scheduler places no more claims on a GPU than its MPS server serves (a
    request cannot ask another number: the only valid one is 1)."""
    plan = node_plan(node_gpus(gpu(0, H100), gpu(1, T4, compute_capability=(6, 1))), "{name: gpu, replicas: 2}")
    assert [dev.clients for dev in node_slice(plan, NODE).devices] == [
        CapacityPolicy(value=48, default=1, minimum=1, maximum=1, step=1),
        CapacityPolicy(value=16, default=1, minimum=1, maximum=1, step=1),
    ]


def test_the_slice_lists_its_devices_by_host_index_whatever_the_resources_order() -> None:
    """The plan lists resource `other` (GPU 1) before `gpu` (GPUs 0 and 2)."""
    plan = three_gpus(order=(0, 2, 1))
    assert [[g.index for g in r.gpus] for r in plan.resources] == [[1], [0, 2]]
    devices = node_slice(plan, NODE).devices
    assert [(d.name, d.uuid, d.resource.rsplit("/", 1)[1]) for d in devices] == [
        ("gpu-0", uuid(0), "gpu"),
        ("gpu-1", uuid(1), "other"),
        ("gpu-2", uuid(2), "gpu"),
    ]


@pytest.mark.parametrize(
    ("driver", "semver"),
    [
        pytest.param("580.65.06", "580.65.6", id="leading-zero-stripped"),
        pytest.param("550.54.15", "550.54.15", id="three-parts"),
        pytest.param("535.104.05", "535.104.5", id="three-digit-minor"),
        pytest.param("470.82", "470.82.0", id="two-parts-padded"),
        pytest.param("0550.0054.0015.0001", "550.54.15", id="four-parts-cut"),
        pytest.param("unknown", "0.0.0", id="unknown"),
    ],
)
def test_the_driver_version_is_a_semantic_version(driver: str, semver: str) -> None:
    assert {d.driver_version for d in node_slice(three_gpus(driver), NODE).devices} == {semver}


# --- a claim's share of a GPU ---------------------------------------------------------------------------------


def test_a_claim_of_30gi_is_capped_at_exactly_30gi_with_threads_in_proportion() -> None:
    share = one_share(device("gpu-0"))
    assert (share.resource.name, share.gpu.uuid) == (GPU_RESOURCE.name, uuid(0))
    assert share.share.kind is GrantKind.CAPPED
    assert share.share.thread_percentage == 100 * 30720 // WHOLE_MIB == 37
    assert share.share.bounds == ((0, 30720),)
    assert [(g.ordinal, g.uuid, g.memory_mib) for g in share.share.gpus] == [(0, uuid(0), 30720)]
    # The container sees one GPU, its ordinal 0: one entry, not one per GPU of the two-GPU resource.
    assert share.edits.envs[ENV_PINNED_MEM_LIMIT] == "0=30720M"
    assert share.edits.envs[ENV_THREAD_PERCENTAGE] == "37"
    assert ENV_CLIENT_PRIORITY not in share.edits.envs


def test_a_claim_on_a_one_gpu_resource_caps_its_one_ordinal() -> None:
    share = one_share(device("gpu-2"))
    assert share.resource.name == OTHER_RESOURCE.name
    assert share.edits.envs[ENV_PINNED_MEM_LIMIT] == "0=30720M"
    assert share.share.bounds == ((0, 30720),)


def test_a_claim_on_the_second_gpu_of_a_resource_holds_its_ordinal() -> None:
    share = one_share(device("gpu-1", memory=10 * GIB))
    assert share.share.bounds == ((1, 10240),)
    assert [g.ordinal for g in share.share.gpus] == [1]
    assert share.edits.envs[ENV_PINNED_MEM_LIMIT] == "0=10240M"  # the daemon's GPU 1 is the container's 0
    assert share.edits.envs[ENV_VISIBLE_DEVICES] == uuid(1)


def test_a_claims_memory_is_counted_in_whole_mib() -> None:
    share = one_share(device("gpu-0", memory=MIB + MIB // 2))
    assert share.edits.envs[ENV_PINNED_MEM_LIMIT] == "0=1M"
    assert share.share.thread_percentage == 1  # 100 * 1 // 81920 is 0: never below 1


@pytest.mark.parametrize(("compute", "threads"), [(25, 25), (1, 1), (100, 100), (0, 37), (None, 37)])
def test_a_claims_compute_sets_its_threads_and_none_means_in_proportion(compute: int | None, threads: int) -> None:
    share = one_share(device("gpu-0", compute=compute))
    assert share.share.kind is GrantKind.CAPPED
    assert share.share.thread_percentage == threads
    assert share.edits.envs[ENV_THREAD_PERCENTAGE] == str(threads)
    assert share.edits.envs[ENV_PINNED_MEM_LIMIT] == "0=30720M"


@pytest.mark.parametrize(
    ("memory", "compute"),
    [
        pytest.param(None, None, id="no-capacity"),
        pytest.param(WHOLE_BYTES, None, id="all-memory"),
        pytest.param(WHOLE_BYTES, 0, id="all-memory-compute-0"),
        pytest.param(WHOLE_BYTES, 100, id="all-memory-all-compute"),
        pytest.param(None, 100, id="no-memory-all-compute"),
    ],
)
def test_a_claim_of_the_whole_gpu_gets_no_caps(memory: int | None, compute: int | None) -> None:
    share = one_share(device("gpu-0", memory=memory, compute=compute))
    assert share.share.kind is GrantKind.FULL
    assert share.share.container_memory_mib == ()
    assert share.share.bounds == ((0, WHOLE_MIB),)
    assert not set(CAP_ENVS) & set(share.edits.envs)
    assert share.edits.envs[ENV_VISIBLE_DEVICES] == uuid(0)


@pytest.mark.parametrize("memory", [WHOLE_BYTES, None])
def test_all_the_memory_with_half_the_compute_is_capped_at_half_the_threads(memory: int | None) -> None:
    share = one_share(device("gpu-0", memory=memory, compute=50))
    assert share.share.kind is GrantKind.CAPPED
    assert share.share.thread_percentage == 50
    assert share.edits.envs[ENV_THREAD_PERCENTAGE] == "50"
    assert share.edits.envs[ENV_PINNED_MEM_LIMIT] == f"0={WHOLE_MIB}M"


@pytest.mark.parametrize(
    ("name", "resource"), [("gpu-0", GPU_RESOURCE), ("gpu-1", GPU_RESOURCE), ("gpu-2", OTHER_RESOURCE)]
)
@pytest.mark.parametrize("memory", [30 * GIB, None], ids=["capped", "whole"])
def test_a_claims_container_gets_the_pipe_directory_and_mounts_of_its_resource(
    name: str, resource: ResourcePlan, memory: int | None
) -> None:
    """As a device-plugin grant of the same resource does, and sees exactly the claimed GPU."""
    share = one_share(device(name, memory=memory))
    index = int(name.removeprefix("gpu-"))
    plugin = ResourceAllocator(resource, PLAN.shm_directory).grant_for((format_replica_id(uuid(index), 0),))
    assert share.edits.envs[ENV_PIPE_DIRECTORY] == plugin.envs[ENV_PIPE_DIRECTORY]
    assert share.edits.mounts == plugin.mounts
    assert share.edits.envs[ENV_VISIBLE_DEVICES] == uuid(index)
    assert share.edits.cdi_devices == plugin.cdi_devices == ()


def test_a_claim_of_two_gpus_gets_a_share_of_each() -> None:
    shares = claim_shares(
        PLAN, allocation(device("gpu-0", memory=8 * GIB), device("gpu-2", memory=None, compute=40)), NODE
    )
    assert [(s.gpu.uuid, s.resource.name) for s in shares] == [
        (uuid(0), GPU_RESOURCE.name),
        (uuid(2), OTHER_RESOURCE.name),
    ]
    first, second = shares
    assert (first.edits.envs[ENV_PINNED_MEM_LIMIT], first.share.thread_percentage) == ("0=8192M", 10)
    assert (second.edits.envs[ENV_PINNED_MEM_LIMIT], second.share.thread_percentage) == (f"0={WHOLE_MIB}M", 40)


@pytest.mark.parametrize(
    ("dev", "named"),
    [
        pytest.param(device("gpu-0", pool="node-b"), "`gpu-0` of pool `node-b`", id="another-pool"),
        pytest.param(device("gpu-7"), "`gpu-7` of pool `node-a`", id="unknown-device"),
        pytest.param(device("GPU-0"), "`GPU-0` of pool `node-a`", id="not-our-spelling"),
    ],
)
def test_a_device_this_node_does_not_publish_is_refused(dev: ClaimDevice, named: str) -> None:
    with pytest.raises(RequestError) as error:
        claim_shares(PLAN, allocation(device("gpu-1"), dev), NODE)
    message = str(error.value)
    assert "ml/train-gpu" in message
    assert named in message
    assert "gpu-0, gpu-1, gpu-2" in message


@pytest.mark.parametrize(
    "memory",
    [0, MIB - 1, WHOLE_BYTES + 1, WHOLE_BYTES + MIB, GPU_BYTES, -MIB],
    ids=["zero", "below-1Mi", "a-byte-over", "a-mib-over", "unfloored-whole", "negative"],
)
def test_memory_outside_what_the_gpu_publishes_is_refused(memory: int) -> None:
    with pytest.raises(RequestError, match=rf"claim ml/train-gpu: device gpu-0 .*1Mi to {WHOLE_MIB}Mi"):
        one_share(device("gpu-0", memory=memory))


def test_one_byte_of_memory_is_said_in_the_singular() -> None:
    with pytest.raises(RequestError) as error:
        one_share(device("gpu-0", memory=1))
    assert str(error.value).startswith("claim ml/train-gpu: device gpu-0 was allocated 1 byte of memory; its GPU")


@pytest.mark.parametrize("compute", [-1, 101, 1000])
def test_compute_outside_0_to_100_is_refused(compute: int) -> None:
    with pytest.raises(RequestError, match=r"claim ml/train-gpu: device gpu-0 .*compute .*from 0 to 100"):
        one_share(device("gpu-0", compute=compute))


def test_a_claim_with_no_device_is_refused() -> None:
    with pytest.raises(RequestError, match=rf"claim ml/train-gpu has no device of driver {DRA_DRIVER} on node"):
        claim_shares(PLAN, allocation(), NODE)


# --- a claim's opaque parameters ----------------------------------------------------------------------------


def test_client_priority_1_reaches_the_containers_environment() -> None:
    share = one_share(device("gpu-0"), (parameters(clientPriority=1),))
    assert share.edits.envs[ENV_CLIENT_PRIORITY] == "1"
    whole = one_share(device("gpu-0", memory=None), (parameters(clientPriority=1),))
    assert whole.share.kind is GrantKind.FULL and whole.edits.envs[ENV_CLIENT_PRIORITY] == "1"


def test_parameters_without_a_priority_set_none() -> None:
    assert share_parameters((parameters(),), "gpu", str(CLAIM)) is not None
    assert ENV_CLIENT_PRIORITY not in one_share(device("gpu-0"), (parameters(),)).edits.envs
    assert share_parameters((), "gpu", str(CLAIM)) is None


@pytest.mark.parametrize(
    ("requests", "name", "applies"),
    [
        pytest.param((), "gpu", True, id="every-request"),
        pytest.param(("gpu",), "gpu", True, id="its-request"),
        pytest.param(("other",), "gpu", False, id="another-request"),
        pytest.param(("gpu",), "gpu/small", True, id="the-subrequests-request"),
        pytest.param(("gpu/small",), "gpu/small", True, id="its-subrequest"),
        pytest.param(("gpu/large",), "gpu/small", False, id="another-subrequest"),
    ],
)
def test_a_config_applies_only_to_its_requests(requests: tuple[str, ...], name: str, applies: bool) -> None:
    config = parameters(requests=requests, clientPriority=1)
    chosen = share_parameters((config,), name, str(CLAIM))
    assert (chosen is not None and chosen.client_priority == 1) is applies
    share = one_share(device("gpu-0", request=name), (config,))
    assert (share.edits.envs.get(ENV_CLIENT_PRIORITY) == "1") is applies


def test_the_claims_config_overrides_its_classs() -> None:
    class_config = parameters("class", clientPriority=1)
    claim_config = parameters("claim", clientPriority=0)
    chosen = share_parameters((class_config, claim_config), "gpu", str(CLAIM))
    assert chosen is not None and chosen.client_priority == 0
    assert one_share(device("gpu-0"), (class_config, claim_config)).edits.envs[ENV_CLIENT_PRIORITY] == "0"
    reverse = share_parameters(
        (parameters("class", clientPriority=0), parameters("claim", clientPriority=1)), "gpu", "x"
    )
    assert reverse is not None and reverse.client_priority == 1


@pytest.mark.parametrize("source", ["claim", "class"])
def test_an_unknown_field_is_refused_naming_it_and_where_it_came_from(source: str) -> None:
    with pytest.raises(RequestError) as error:
        one_share(device("gpu-0"), (parameters(source, threads=5),))
    message = str(error.value)
    assert "ml/train-gpu" in message
    assert "threads" in message
    assert f"from the {source}" in message
    assert PARAMETERS_KIND in message


@pytest.mark.parametrize("priority", [2, -1, 100])
def test_a_client_priority_other_than_0_or_1_is_refused(priority: int) -> None:
    with pytest.raises(RequestError, match=rf"ml/train-gpu.*clientPriority must be 0 .* or 1 .*not {priority}"):
        one_share(device("gpu-0"), (parameters(clientPriority=priority),))


@pytest.mark.parametrize(
    "document",
    [
        {"apiVersion": "mps.mpsagent.io/v1", "kind": PARAMETERS_KIND},
        {"apiVersion": "gpu.nvidia.com/v1alpha1", "kind": PARAMETERS_KIND},
        {"apiVersion": PARAMETERS_API_VERSION, "kind": "GpuConfig"},
    ],
    ids=["another-version", "another-group", "another-kind"],
)
def test_another_api_version_or_kind_is_refused_naming_the_expected_ones(document: dict[str, str]) -> None:
    config = OpaqueConfig(requests=(), parameters=json.dumps(document).encode(), source="class")
    with pytest.raises(RequestError) as error:
        share_parameters((config,), "gpu", str(CLAIM))
    message = str(error.value)
    assert "ml/train-gpu" in message and "from the class" in message
    assert f"apiVersion {PARAMETERS_API_VERSION}, kind {PARAMETERS_KIND}" in message
    assert document["apiVersion"] in message and document["kind"] in message


@pytest.mark.parametrize("text", ["", "{", "clientPriority: 1", b"\xff{}"], ids=["empty", "cut", "yaml", "not-utf8"])
def test_parameters_that_are_not_json_are_refused(text: str | bytes) -> None:
    with pytest.raises(RequestError, match=r"claim ml/train-gpu: the opaque parameters from the claim are not JSON"):
        share_parameters((raw(text),), "gpu", str(CLAIM))


@pytest.mark.parametrize("text", ["[]", '"MpsShareConfig"', "{}", '{"apiVersion": 1, "kind": "MpsShareConfig"}'])
def test_json_that_is_not_an_mps_share_config_is_refused(text: str) -> None:
    with pytest.raises(RequestError, match=rf"claim ml/train-gpu: the opaque parameters .* not an {PARAMETERS_KIND}"):
        share_parameters((raw(text),), "gpu", str(CLAIM))


def test_a_bad_config_for_another_request_is_not_read() -> None:
    """Only the configs of the device's request are the claim's word for it."""
    bad = OpaqueConfig(requests=("other",), parameters=b"not json", source="claim")
    assert share_parameters((bad,), "gpu", str(CLAIM)) is None


# --- the ceilings of claims' shares -------------------------------------------------------------------------

DEVICE_NAMES = ("gpu-0", "gpu-1", "gpu-2")
claims = st.tuples(
    st.sampled_from(DEVICE_NAMES),
    st.integers(min_value=MIB, max_value=WHOLE_BYTES),
    st.one_of(st.none(), st.integers(min_value=0, max_value=100)),
)


def cap_on(share: Share, ordinal: int) -> int:
    cap = share.memory_cap(ordinal)
    return WHOLE_MIB if cap is None else cap


@settings(max_examples=150, deadline=None)
@given(held=st.lists(claims, min_size=1, max_size=8), released=st.sets(st.integers(min_value=0, max_value=7)))
def test_a_claims_caps_are_what_it_consumed_and_the_ceilings_cover_every_live_claim(
    held: list[tuple[str, int, int | None]], released: set[int]
) -> None:
    assert GPU_RESOURCE.enforce_caps and OTHER_RESOURCE.enforce_caps
    ledgers = {resource.name: Ledger() for resource in PLAN.resources}
    live: dict[int, tuple[ClaimShare, int]] = {}
    for position, (name, memory, compute) in enumerate(held):
        got = one_share(device(name, memory=memory, compute=compute))
        share = got.share
        assert 1 <= share.thread_percentage <= 100
        if share.kind is GrantKind.FULL:
            assert memory // MIB == WHOLE_MIB and compute in (None, 0, 100)
        else:
            # The container sees the claim's one GPU, as its ordinal 0, whatever the daemon's GPUs.
            assert share.container_memory_mib == (memory // MIB,)
            assert got.edits.envs[ENV_PINNED_MEM_LIMIT] == f"0={memory // MIB}M"
            assert got.edits.envs[ENV_THREAD_PERCENTAGE] == str(share.thread_percentage)
            proportional = max(1, 100 * (memory // MIB) // WHOLE_MIB)
            assert share.thread_percentage == (compute or proportional)
        grant = ledgers[got.resource.name].hold_claim(CLAIM, name, share)
        live[position] = (got, grant.grant_id)
    for position in released & set(live):
        got, grant_id = live.pop(position)
        ledgers[got.resource.name].release([grant_id])
    for resource in PLAN.resources:
        ceilings = resource.shares.ceilings(ledgers[resource.name].tally)
        mine = [got for got, _ in live.values() if got.resource.name == resource.name]
        for got in mine:
            (ordinal,) = (g.ordinal for g in got.share.gpus)
            assert ceilings.memory_mib[ordinal] >= cap_on(got.share, ordinal)
            assert ceilings.thread_percentage >= got.share.thread_percentage
        # And no higher than the largest live claim asks (the whole GPU where none holds it).
        assert ceilings.thread_percentage == max((got.share.thread_percentage for got in mine), default=100)
        for ordinal in range(len(resource.gpus)):
            on = [mib for got in mine for o, mib in got.share.bounds if o == ordinal]
            assert ceilings.memory_mib[ordinal] == max(on, default=WHOLE_MIB)
