"""The plan and what follows from it: device selection, per-GPU checks, the daemon's commands (`mps.commands`),
container grants (`container`, as the allocator answers a request) and node labels (`nfd`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mpsagent.base.config import DeviceIdStrategy, DeviceListStrategy
from mpsagent.base.devices import MIB, Gpu, NodeGpus, ReplicaId, format_replica_id
from mpsagent.base.errors import ConfigError
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.container import (
    ENV_PINNED_MEM_LIMIT,
    ENV_PIPE_DIRECTORY,
    ENV_THREAD_PERCENTAGE,
    ENV_VISIBLE_DEVICES,
    ContainerSetup,
    container_pipe_directory,
)
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.plan import ResourcePlan
from mpsagent.domain.shares import Ceilings
from mpsagent.mps.commands import daemon_default_commands, daemon_launch
from mpsagent.node.nfd import node_labels
from mpsagent_testing.domain import (
    H100,
    MPS_ROOT,
    T4,
    gpu,
    gpus_of,
    node_gpus,
    node_plan,
    replica_id,
    resource_plan,
    uuid,
)

GIB = 1024**3
T4_BYTES = T4.memory_bytes
SHM = MPS_ROOT / "shm"


def t4_node(count: int = 4) -> NodeGpus:
    return node_gpus(*gpus_of(count))


EQUAL = "grants: equal"
MANY = "failRequestsGreaterThanOne: false"
"""A container may ask for more than one ID."""


def granted(resource: ResourcePlan, replica_ids: tuple[ReplicaId, ...]) -> ContainerSetup:
    """What a container asking for these IDs is given: the allocator's answer, as an Allocate and `--once`'s
    examples get it (recording nothing)."""
    return ResourceAllocator(resource, SHM).grant_for(replica_ids)


def ceilings_of(resource: ResourcePlan, mode: str) -> Ceilings:
    """What today's (equal) rule calls the capped mode: the smallest share on every GPU; full: the hardware."""
    return resource.shares.smallest_caps() if mode == "capped" else resource.shares.full_hardware()


def ids(*pairs: tuple[int, int]) -> tuple[ReplicaId, ...]:
    """Replica IDs by (host GPU index, replica number)."""
    return tuple(replica_id(index, replica) for index, replica in pairs)


# --- device selection ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "indices"),
    [
        pytest.param(None, [0, 1, 2, 3], id="omitted-means-all"),
        pytest.param("all", [0, 1, 2, 3], id="all"),
        pytest.param("1", [0], id="count-1"),
        pytest.param("3", [0, 1, 2], id="count-3"),
        pytest.param("4", [0, 1, 2, 3], id="count-all"),
        pytest.param("[2]", [2], id="one-index"),
        pytest.param("[3, 1]", [1, 3], id="indices-sorted-by-host-index"),
        pytest.param(f"[{uuid(2)}, {uuid(0)}]", [0, 2], id="uuids"),
        pytest.param('["3", "0"]', [0, 3], id="digit-strings"),
        pytest.param(f'[1, "2", {uuid(3)}]', [1, 2, 3], id="mixed"),
    ],
)
def test_device_selectors(devices: str | None, indices: list[int]) -> None:
    entry = "{name: gpu, replicas: 2" + (f", devices: {devices}" if devices is not None else "") + "}"
    resource = resource_plan(t4_node(4), entry)
    assert [g.index for g in resource.gpus] == indices
    assert {g.uuid: g.ordinal for g in resource.shares.gpus} == {uuid(i): o for o, i in enumerate(indices)}
    assert resource.device_ids == tuple(format_replica_id(uuid(i), r) for i in indices for r in range(2))


@pytest.mark.parametrize(
    ("entries", "path", "phrase"),
    [
        pytest.param(
            ["{name: gpu, replicas: 2, devices: [0, 7]}"],
            "sharing.mps.resources[0].devices[1]",
            "`7` matches no GPU on this node (indices 0, 1, 2, 3",
            id="index-out-of-range",
        ),
        pytest.param(
            ["{name: gpu, replicas: 2, devices: [0, GPU-nope]}"],
            "sharing.mps.resources[0].devices[1]",
            "`GPU-nope` matches no GPU",
            id="unknown-uuid",
        ),
        pytest.param(
            ['{name: gpu, replicas: 2, devices: ["9"]}'],
            "sharing.mps.resources[0].devices[0]",
            "`9` matches no GPU",
            id="digit-string-out-of-range",
        ),
        pytest.param(
            ["{name: gpu, replicas: 2, devices: [-1]}"],
            "sharing.mps.resources[0].devices[0]",
            "`-1` matches no GPU",
            id="negative-index",
        ),
        pytest.param(
            ['{name: gpu, replicas: 2, devices: ["²"]}'],
            "sharing.mps.resources[0].devices[0]",
            "matches no GPU",
            id="unicode-digit",
        ),
        pytest.param(
            ["{name: gpu, replicas: 2, devices: 5}"],
            "sharing.mps.resources[0].devices",
            "asks for 5 GPUs but this node has 4",
            id="count-too-large",
        ),
        pytest.param(
            [f"{{name: gpu, replicas: 2, devices: [1, {uuid(1)}]}}"],
            "sharing.mps.resources[0].devices[1]",
            "GPU 1 (GPU-00000001-aaaa-bbbb-cccc-dddddddddddd) is listed twice",
            id="listed-twice",
        ),
        pytest.param(
            ["{name: a, replicas: 2, devices: [0, 1]}", "{name: b, replicas: 2, devices: [1, 2]}"],
            "sharing.mps.resources[1].devices",
            "GPU 1 (GPU-00000001-aaaa-bbbb-cccc-dddddddddddd) is already shared by sharing.mps.resources[0]",
            id="in-two-resources",
        ),
        pytest.param(
            ["{name: a, replicas: 2, devices: [3]}", "{name: b, replicas: 2}"],
            "sharing.mps.resources[1].devices",
            "GPU 3",
            id="all-after-a-list",
        ),
        pytest.param(
            ["{name: a, replicas: 2, devices: [0]}", "{name: b, replicas: 2, devices: 2}"],
            "sharing.mps.resources[1].devices",
            "already shared",
            id="count-overlaps-a-list",
        ),
    ],
)
def test_device_selection_refusals(entries: list[str], path: str, phrase: str) -> None:
    with pytest.raises(ConfigError) as info:
        node_plan(t4_node(4), *entries)
    assert info.value.path == path
    assert phrase in info.value.message


def test_one_gpu_asked_of_a_node_without_any_is_said_in_the_singular() -> None:
    with pytest.raises(ConfigError) as info:
        node_plan(node_gpus(), "{name: gpu, replicas: 2, devices: 1}")
    assert info.value.message == "asks for 1 GPU but this node has 0"


def test_a_gpu_in_two_resources_says_each_gpu_is_in_one_resource_only() -> None:
    with pytest.raises(ConfigError, match="already shared") as info:
        node_plan(t4_node(2), "{name: a, replicas: 2}", "{name: b, replicas: 2, devices: [1]}")
    assert "each GPU can be in one resource only" in info.value.message


@pytest.mark.parametrize(
    ("gpus", "entry", "path", "phrase"),
    [
        pytest.param(
            (gpu(0), gpu(1, mig_enabled=True)),
            "{name: gpu, replicas: 2}",
            "sharing.mps.resources[0].devices",
            "GPU 1 (GPU-00000001-aaaa-bbbb-cccc-dddddddddddd) has MIG enabled",
            id="mig-enabled",
        ),
        pytest.param(
            (gpu(0, compute_capability=(6, 0)),),
            "{name: gpu, replicas: 17}",
            "sharing.mps.resources[0].replicas",
            "compute capability 6.0, where MPS allows at most 16 clients; 17 is too many",
            id="pascal-17",
        ),
        pytest.param(
            (gpu(0), gpu(1, compute_capability=(6, 1))),
            "{name: gpu, replicas: 48}",
            "sharing.mps.resources[0].replicas",
            "GPU 1 has compute capability 6.1",
            id="one-pascal-among-turing",
        ),
        pytest.param(
            (gpu(0), gpu(1, memory_bytes=47 * MIB)),
            "{name: gpu, replicas: 48}",
            "sharing.mps.resources[0].replicas",
            "gives GPU 1 (GPU-00000001-aaaa-bbbb-cccc-dddddddddddd, 47 MiB) a memory cap of 0 MiB for one replica, "
            "which MPS reads as no limit at all; use at most 47 replicas, or leave the GPU out of this resource",
            id="a-0-MiB-cap",
        ),
        pytest.param(
            (gpu(0, memory_bytes=47 * MIB),),
            "{name: gpu, replicas: 48}",
            "sharing.mps.resources[0].replicas",
            "gives GPU 0 (GPU-00000000-aaaa-bbbb-cccc-dddddddddddd, 47 MiB) a memory cap of 0 MiB for one replica",
            id="a-0-MiB-cap-on-the-only-gpu",
        ),
    ],
)
def test_per_gpu_refusals(gpus: tuple[Gpu, ...], entry: str, path: str, phrase: str) -> None:
    with pytest.raises(ConfigError) as info:
        node_plan(node_gpus(*gpus), entry)
    assert info.value.path == path
    assert phrase in info.value.message


@pytest.mark.parametrize(
    ("gpus", "entry"),
    [
        pytest.param((gpu(0, compute_capability=(6, 0)),), "{name: gpu, replicas: 16}", id="pascal-16"),
        pytest.param((gpu(0, compute_capability=(7, 0)),), "{name: gpu, replicas: 48}", id="volta-48"),
        pytest.param((gpu(0, compute_capability=(9, 0)),), "{name: gpu, replicas: 48}", id="hopper-48"),
        # A MIG-enabled or pre-Volta GPU left out of every resource is no concern.
        pytest.param((gpu(0), gpu(1, mig_enabled=True)), "{name: gpu, replicas: 4, devices: [0]}", id="mig-left-out"),
        pytest.param(
            (gpu(0), gpu(1, compute_capability=(6, 0))), "{name: gpu, replicas: 48, devices: [0]}", id="pascal-left-out"
        ),
    ],
)
def test_per_gpu_acceptances(gpus: tuple[Gpu, ...], entry: str) -> None:
    resource = resource_plan(node_gpus(*gpus), entry)
    assert resource.gpus == gpus[: len(resource.gpus)]


# --- two resources on one node ------------------------------------------------------------------------------

SPLIT = ("{name: low, replicas: 4, devices: [0, 1, 2, 3]}", "{name: high, replicas: 2, devices: [7, 6, 5, 4]}")


def test_two_resources_split_eight_gpus() -> None:
    gpus = node_gpus(*gpus_of(8, H100))
    low, high = node_plan(gpus, *SPLIT).resources
    assert [g.index for g in low.gpus] == [0, 1, 2, 3]
    assert [g.index for g in high.gpus] == [4, 5, 6, 7]
    assert (low.name, high.name) == ("nvidia.com/low", "nvidia.com/high")
    assert high.config_path == "sharing.mps.resources[1]"
    # The second daemon sees only GPUs 4..7, numbered from 0: its ordinals are 0..3, not the host indices.
    assert {g.uuid: g.ordinal for g in high.shares.gpus} == {uuid(4): 0, uuid(5): 1, uuid(6): 2, uuid(7): 3}
    assert len(high.shares.smallest_caps().memory_mib) == 4
    assert daemon_default_commands(high.shares.smallest_caps())[1:] == tuple(
        f"set_default_device_pinned_mem_limit {o} 40779M" for o in range(4)
    )
    assert high.visible_devices == ",".join(uuid(i) for i in (4, 5, 6, 7))
    assert low.visible_devices == ",".join(uuid(i) for i in (0, 1, 2, 3))
    assert daemon_launch(high, "nvidia-cuda-mps-control", multi_user=False).env == {
        "CUDA_VISIBLE_DEVICES": high.visible_devices,
        "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps/nvidia.com/high/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/run/nvidia/mps/nvidia.com/high/log",
    }
    assert len(low.device_ids) == 16
    assert len(high.device_ids) == 8


def test_a_grant_on_the_second_resource_uses_its_own_ordinals() -> None:
    _, high = node_plan(t4_node(8), *SPLIT, mps=EQUAL).resources
    grant = granted(high, ids((6, 0)))
    assert grant.envs[ENV_VISIBLE_DEVICES] == uuid(6)
    assert grant.envs[ENV_PINNED_MEM_LIMIT] == "0=8192M"  # the one GPU the container sees, as its ordinal 0
    assert grant.envs[ENV_THREAD_PERCENTAGE] == "50"


# --- caps ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("memory_bytes", "replicas", "mode", "expected"),
    [
        pytest.param(
            T4_BYTES,
            4,
            "capped",
            ("set_default_active_thread_percentage 25", "set_default_device_pinned_mem_limit 0 4096M"),
            id="16GiB-4-capped",
        ),
        pytest.param(
            T4_BYTES,
            4,
            "full",
            ("set_default_active_thread_percentage 100", "set_default_device_pinned_mem_limit 0 16384M"),
            id="16GiB-4-full",
        ),
        pytest.param(
            H100.memory_bytes,
            4,
            "capped",
            ("set_default_active_thread_percentage 25", "set_default_device_pinned_mem_limit 0 20389M"),
            id="h100-4-capped",
        ),
        pytest.param(
            H100.memory_bytes,
            4,
            "full",
            ("set_default_active_thread_percentage 100", "set_default_device_pinned_mem_limit 0 81559M"),
            id="h100-4-full",
        ),
        pytest.param(
            T4_BYTES,
            3,
            "capped",
            ("set_default_active_thread_percentage 33", "set_default_device_pinned_mem_limit 0 5461M"),
            id="16GiB-3-capped",
        ),
        pytest.param(
            T4_BYTES,
            1,
            "capped",
            ("set_default_active_thread_percentage 100", "set_default_device_pinned_mem_limit 0 16384M"),
            id="16GiB-1-capped",
        ),
        pytest.param(
            T4_BYTES,
            48,
            "capped",
            ("set_default_active_thread_percentage 2", "set_default_device_pinned_mem_limit 0 341M"),
            id="16GiB-48-capped",
        ),
    ],
)
def test_daemon_default_commands(memory_bytes: int, replicas: int, mode: str, expected: tuple[str, ...]) -> None:
    resource = resource_plan(node_gpus(gpu(0, memory_bytes=memory_bytes)), f"{{name: gpu, replicas: {replicas}}}")
    assert daemon_default_commands(ceilings_of(resource, mode)) == expected


@pytest.mark.parametrize("grants", ["proportional", "equal"])
def test_a_container_is_capped_on_the_gpus_it_sees_only_numbered_as_it_sees_them(grants: str) -> None:
    """1 of 4 replicas of GPU 3 on an 8-GPU node: one entry, `0=20389M`, never one for the 7 GPUs it cannot see (a
    client whose variable names a GPU it cannot see drops every pinned limit: NVIDIA, driver 615)."""
    h100s = node_gpus(*gpus_of(8, H100))
    resource = resource_plan(h100s, "{name: gpu, replicas: 4}", mps=f"grants: {grants}")
    grant = granted(resource, ids((3, 0)))
    assert grant.envs[ENV_VISIBLE_DEVICES] == uuid(3)
    assert grant.envs[ENV_PINNED_MEM_LIMIT] == "0=20389M"
    # The daemon's own per-ordinal defaults are unchanged: every GPU of the resource.
    assert len(resource.shares.ceilings([grant.share]).memory_mib) == 8


def test_a_container_holding_gpus_at_different_caps_gets_each_its_own_in_the_daemons_order() -> None:
    gpus = node_gpus(gpu(0, memory_bytes=T4_BYTES), gpu(1, memory_bytes=8 * GIB), gpu(2, memory_bytes=T4_BYTES))
    resource = resource_plan(gpus, "{name: gpu, replicas: 4}", mps=MANY)
    # 3 of GPU 2's 4 and 1 of GPU 0's, named in that order: GPU 0 is the container's ordinal 0, GPU 2 its 1.
    grant = granted(resource, (*ids((2, 0), (2, 1), (2, 2)), *ids((0, 3))))
    assert grant.envs[ENV_VISIBLE_DEVICES] == f"{uuid(0)},{uuid(2)}"
    assert grant.envs[ENV_PINNED_MEM_LIMIT] == "0=4096M,1=12288M"


def test_caps_cover_every_gpu_in_ordinal_order() -> None:
    gpus = node_gpus(gpu(0, memory_bytes=T4_BYTES), gpu(1, memory_bytes=8 * GIB), gpu(2, memory_bytes=T4_BYTES))
    resource = resource_plan(gpus, "{name: gpu, replicas: 4, devices: [2, 1]}")
    assert daemon_default_commands(resource.shares.smallest_caps()) == (
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 2048M",
        "set_default_device_pinned_mem_limit 1 4096M",
    )
    assert resource.shares.full_hardware() == Ceilings(thread_percentage=100, memory_mib=(8192, 16384))


@pytest.mark.parametrize(
    ("enforce", "capped_live", "mode"),
    [
        (True, True, "capped"),
        (True, False, "full"),
        (False, True, "full"),
        (False, False, "full"),
    ],
)
def test_daemon_ceilings(enforce: bool, capped_live: bool, mode: str) -> None:
    resource = resource_plan(
        t4_node(1), "{name: gpu, replicas: 4}", mps=f"enforceCaps: {str(enforce).lower()}\ngrants: equal"
    )
    live = [resource.shares.share_of(resource.device_ids[:1])] if capped_live else []
    wanted = resource.shares.smallest_caps() if mode == "capped" else resource.shares.full_hardware()
    assert resource.shares.ceilings(live) == wanted


# --- container grants ---------------------------------------------------------------------------------------


def test_a_full_grant_has_no_caps() -> None:
    resource = resource_plan(t4_node(2), "{name: gpu, replicas: 4}", mps=MANY)
    grant = granted(resource, tuple(reversed(resource.device_ids)))
    assert grant.share.kind is GrantKind.FULL
    assert ENV_THREAD_PERCENTAGE not in grant.envs
    assert ENV_PINNED_MEM_LIMIT not in grant.envs
    assert grant.envs == {
        ENV_PIPE_DIRECTORY: "/mps/nvidia.com/gpu/pipe",
        ENV_VISIBLE_DEVICES: f"{uuid(0)},{uuid(1)}",
    }
    assert grant.cdi_devices == ()
    assert [(m.container_path, m.host_path) for m in grant.mounts] == [
        ("/mps/nvidia.com/gpu/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe"),
        ("/dev/shm", "/run/nvidia/mps/shm"),
    ]


@pytest.mark.parametrize(
    ("pairs", "visible"),
    [
        pytest.param([(0, 0)], [0], id="one-replica"),
        pytest.param([(2, 1), (2, 3)], [2], id="two-on-one-gpu"),
        pytest.param([(3, 0), (1, 0)], [1, 3], id="host-index-order"),
        pytest.param([(i, 0) for i in (3, 2, 1, 0)], [0, 1, 2, 3], id="one-per-gpu"),
        pytest.param([(0, r) for r in range(4)], [0], id="a-whole-gpu-is-still-partial"),
        pytest.param([(i, r) for i in range(4) for r in range(4)][:-1], [0, 1, 2, 3], id="all-but-one"),
    ],
)
def test_a_partial_grant_is_capped_under_equal_grants(pairs: list[tuple[int, int]], visible: list[int]) -> None:
    resource = resource_plan(t4_node(4), "{name: gpu, replicas: 4}", mps=f"{EQUAL}\n{MANY}")
    grant = granted(resource, ids(*pairs))
    assert grant.share.kind is GrantKind.CAPPED
    assert grant.envs[ENV_THREAD_PERCENTAGE] == "25"
    # One entry per GPU the container sees (the NVIDIA rule's 1/4 on each), keyed by its ordinal there: the
    # granted GPUs in the daemon's order, whatever order the request named them in.
    assert grant.envs[ENV_PINNED_MEM_LIMIT] == ",".join(f"{o}=4096M" for o in range(len(visible)))
    assert grant.envs[ENV_VISIBLE_DEVICES] == ",".join(uuid(i) for i in visible)


@pytest.mark.parametrize(
    ("flags", "pairs", "visible_env", "cdi"),
    [
        pytest.param("{plugin: {deviceIDStrategy: index}}", [(2, 0), (0, 1)], "0,2", (), id="index"),
        pytest.param("{plugin: {deviceIDStrategy: uuid}}", [(2, 0), (0, 1)], f"{uuid(0)},{uuid(2)}", (), id="uuid"),
        pytest.param(
            "{plugin: {deviceListStrategy: cdi-cri}}",
            [(2, 0), (0, 1)],
            None,
            (f"nvidia.com/gpu={uuid(0)}", f"nvidia.com/gpu={uuid(2)}"),
            id="cdi-cri",
        ),
        pytest.param(
            "{plugin: {deviceListStrategy: cdi-cri, deviceIDStrategy: index}}",
            [(1, 0)],
            None,
            (f"nvidia.com/gpu={uuid(1)}",),
            id="cdi-cri-ignores-id-strategy",
        ),
    ],
)
def test_device_strategies(
    flags: str, pairs: list[tuple[int, int]], visible_env: str | None, cdi: tuple[str, ...]
) -> None:
    resource = resource_plan(t4_node(4), "{name: gpu, replicas: 4}", mps=MANY, flags=flags)
    grant = granted(resource, ids(*pairs))
    assert grant.envs.get(ENV_VISIBLE_DEVICES) == visible_env
    assert grant.cdi_devices == cdi
    assert grant.envs[ENV_PIPE_DIRECTORY] == "/mps/nvidia.com/gpu/pipe"


def test_index_strategy_on_the_second_resource_gives_host_indices() -> None:
    _, high = node_plan(t4_node(8), *SPLIT, mps=MANY, flags="{plugin: {deviceIDStrategy: index}}").resources
    assert high.device_id_strategy is DeviceIdStrategy.INDEX
    grant = granted(high, ids((5, 0), (4, 1)))
    assert grant.envs[ENV_VISIBLE_DEVICES] == "4,5"


def test_cdi_full_grant_has_every_gpu_and_no_caps() -> None:
    resource = resource_plan(
        t4_node(2), "{name: gpu, replicas: 2}", mps=MANY, flags="{plugin: {deviceListStrategy: cdi-cri}}"
    )
    assert resource.device_list_strategy is DeviceListStrategy.CDI_CRI
    grant = granted(resource, resource.device_ids)
    assert grant.share.kind is GrantKind.FULL
    assert grant.cdi_devices == (f"nvidia.com/gpu={uuid(0)}", f"nvidia.com/gpu={uuid(1)}")
    assert set(grant.envs) == {ENV_PIPE_DIRECTORY}


# --- labels -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mps", "product"),
    [
        pytest.param("", "Tesla-T4-SHARED", id="default"),
        pytest.param("renameByDefault: false", "Tesla-T4-SHARED", id="rename-by-default-false"),
        pytest.param("renameByDefault: true", "Tesla-T4", id="rename-by-default-true"),
    ],
)
def test_labels_for_four_t4s(mps: str, product: str) -> None:
    result = node_plan(t4_node(4), "{name: nvidia.com/gpu, replicas: 4}", mps=mps)
    assert node_labels(result.gpus, result.resources) == {
        "nvidia.com/gpu.count": "4",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.sharing-strategy": "mps",
        "nvidia.com/mps.capable": "true",
        # Who holds a capped container to its memory on each GPU: MPS alone where the driver has no limits.
        **{f"mpsagent.io/memory-enforcement.gpu-{i}": "mps" for i in range(4)},
    }
    assert sum(len(r.device_ids) for r in result.resources) == 16


def test_a_gpu_whose_driver_limits_memory_is_labelled_so() -> None:
    gpus = node_gpus(gpu(0), replace(gpu(1), memory_limits_unavailable=None))
    result = node_plan(gpus, "{name: nvidia.com/gpu, replicas: 4}")
    labels = node_labels(result.gpus, result.resources)
    assert labels["mpsagent.io/memory-enforcement.gpu-0"] == "mps"
    assert labels["mpsagent.io/memory-enforcement.gpu-1"] == "driver"


@pytest.mark.parametrize(
    ("name", "product"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3-SHARED"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB-SHARED"),
        ("Quadro RTX 6000 (rev/2)", "Quadro-RTX-6000-rev2-SHARED"),
    ],
)
def test_product_label_is_a_valid_label_value(name: str, product: str) -> None:
    result = node_plan(node_gpus(gpu(0, replace(T4, name=name))), "{name: gpu, replicas: 2}")
    assert node_labels(result.gpus, result.resources)["nvidia.com/gpu.product"] == product


def test_labels_count_every_gpu_and_take_replicas_from_the_first_resource() -> None:
    result = node_plan(t4_node(8), *SPLIT)
    labels = node_labels(result.gpus, result.resources)
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.replicas"] == "4"


def test_node_plan_paths() -> None:
    result = node_plan(t4_node(1), "{name: gpu, replicas: 2}")
    (resource,) = result.resources
    assert result.shm_directory == Path("/run/nvidia/mps/shm")
    assert resource.directory == Path("/run/nvidia/mps/nvidia.com/gpu")
    assert str(container_pipe_directory(resource)) == "/mps/nvidia.com/gpu/pipe"
    assert result.driver_version == "550.54.15"
    assert result.gpu_source == "test"
