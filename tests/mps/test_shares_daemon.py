"""Proportional shares through the agent's socket, with the real control daemon: the daemon's per-ordinal ceilings
follow the live grants (Allocate and reconciliation), `--status` shows each grant's share and each GPU's escape
bound, and an agent restarted while pod-resources lists proportional grants rebuilds their ceilings before serving."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from mpsagent_testing.agents import GRACE_S, AgentLauncher, start, status
from mpsagent_testing.kubelet.calls import allocate, preferred
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.kubelet.podresources import FakePodResources, listed
from mpsagent_testing.mps.daemon import control, pipe_of, require_real_control
from mpsagent_testing.node import GPU0, GPU1, RESOURCE, config, ids

require_real_control()  # the agents these tests start run the real MPS control daemon


def ceilings(short_dir: Path) -> tuple[str, str, str]:
    """The daemon's defaults: thread percentage, pinned memory of ordinals 0 and 1 (16 GiB T4s)."""
    pipe = pipe_of(short_dir)
    return (
        control(pipe, "get_default_active_thread_percentage"),
        control(pipe, "get_default_device_pinned_mem_limit 0"),
        control(pipe, "get_default_device_pinned_mem_limit 1"),
    )


def resource_status(short_dir: Path) -> dict[str, object]:
    return json.loads((short_dir / "mps" / "status.json").read_text())["resources"][0]


def with_grants(short_dir: Path, count: int, *, owned: bool = False) -> dict[str, object] | None:
    """The resource's status once it shows `count` grants (`owned`: each with its container)."""
    res = resource_status(short_dir)
    grants = res["grants"]
    return res if len(grants) == count and (not owned or all(g["container"] for g in grants)) else None


def test_per_ordinal_ceilings_follow_the_grants_as_they_come_and_go(
    agents: AgentLauncher, kubelet: FakeKubelet, pod_resources: FakePodResources, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir, "--reconcile-grace-seconds", str(GRACE_S), text=config())
    plugin = kubelet.wait_registered(RESOURCE)
    assert ceilings(short_dir) == ("100.0", "16G", "16G")

    quarter = allocate(plugin, ids(GPU0, 0)).container_responses[0].envs
    assert (quarter["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], quarter["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == (
        "25",
        "0=4096M",
    )
    assert ceilings(short_dir) == ("25.0", "4G", "16G")

    half = allocate(plugin, ids(GPU0, 1, 2)).container_responses[0].envs
    assert (half["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], half["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == (
        "50",
        "0=8192M",
    )
    assert ceilings(short_dir) == ("50.0", "8G", "16G")

    whole = allocate(plugin, ids(GPU1, 0, 1, 2, 3)).container_responses[0].envs
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in whole and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in whole
    assert whole["NVIDIA_VISIBLE_DEVICES"] == GPU1
    assert ceilings(short_dir) == ("100.0", "8G", "16G")

    res = wait_for(lambda: with_grants(short_dir, 3), 5, "the status with three grants")
    assert [g["share"] for g in res["grants"]] == [
        "1/4 of GPU 0, threads 25%",
        "2/4 of GPU 0, threads 50%",
        "4/4 of GPU 1 (whole)",
    ]
    shown = status(short_dir).stdout
    assert f"GPU 0 ({GPU0}): 2 live grants; ceilings 8192 of 16384 MiB, threads 100%; escape bound: +4096 MiB" in shown
    assert f"[2/4 of GPU 0, threads 50%, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M]: {GPU0}::1, {GPU0}::2" in shown
    gpu0 = res["gpus"][GPU0]
    assert (gpu0["liveGrants"], gpu0["memoryCeilingMiB"], gpu0["memoryEscapeMiB"], gpu0["threadEscape"]) == (
        2,
        8192,
        4096,
        75,
    )

    # The kubelet lists the three containers; then the 2/4 one is gone: once the kubelet has not listed it for the
    # grace period, its ceiling goes with it. (Unlisted from the start, its grace would count from its grant.)
    pod_resources.set_containers(
        listed("quarter", ids(GPU0, 0)), listed("half", ids(GPU0, 1, 2)), listed("whole", ids(GPU1, 0, 1, 2, 3))
    )
    wait_for(lambda: with_grants(short_dir, 3, owned=True), 10, "the three grants owned by their containers")
    pod_resources.set_containers(listed("quarter", ids(GPU0, 0)), listed("whole", ids(GPU1, 0, 1, 2, 3)))
    gone_at = time.monotonic()
    agent.wait_log("grant released: its container is gone", timeout=3 * GRACE_S)
    assert time.monotonic() - gone_at >= GRACE_S - 0.1
    wait_for(lambda: ceilings(short_dir) == ("100.0", "4G", "16G"), 10, "GPU 0's ceiling back at 1/4")


def test_an_agent_restarted_while_proportional_grants_are_listed_rebuilds_their_ceilings_before_serving(
    agents: AgentLauncher, kubelet: FakeKubelet, pod_resources: FakePodResources, short_dir: Path
) -> None:
    first = start(agents, kubelet, short_dir, text=config())
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0, 1))
    assert ceilings(short_dir) == ("50.0", "8G", "16G")
    assert first.stop() == 0

    # Meanwhile a container of 1/4 of GPU 1 was admitted (say, by an agent that has since been replaced).
    pod_resources.set_containers(listed("half", ids(GPU0, 0, 1)), listed("quarter", ids(GPU1, 3)))
    start(agents, kubelet, short_dir, text=config())
    kubelet.wait_registered(RESOURCE, count=2)
    assert ceilings(short_dir) == ("50.0", "8G", "4G")


UNITS = (
    "version: v1\nflags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n"
    "sharing:\n  mps:\n    resources:\n    - name: gpu\n      memoryUnit: 256Mi\n"
)


def test_the_49th_live_grant_on_a_gpu_is_refused_and_preferred_allocation_avoids_the_full_gpu(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    start(agents, kubelet, short_dir, text=UNITS)  # 64 units of 256 MiB on each 16 GiB GPU
    plugin = kubelet.wait_registered(RESOURCE)
    for unit in range(48):
        allocate(plugin, ids(GPU0, unit))
    assert ceilings(short_dir) == ("1.0", "256M", "16G")
    with pytest.raises(grpc.RpcError) as refused:
        allocate(plugin, ids(GPU1, 0), ids(GPU0, 48))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        f"{RESOURCE}: GPU {GPU0} would hold 49 MPS clients (device-plugin grants and claims), but MPS serves at "
        f"most 48; nothing was granted (asked: '{GPU1}::0', '{GPU0}::48'): ask for IDs of another GPU, or wait for a "
        "container or claim on it to end"
    )
    res = wait_for(lambda: with_grants(short_dir, 48), 5, "the status with 48 grants")
    assert res["gpus"][GPU0]["liveGrants"] == 48 and res["gpus"][GPU1]["liveGrants"] == 0
    # Packed would pick the busiest GPU; GPU 0 is at the limit, so the request goes to GPU 1.
    free = [*ids(GPU0, *range(48, 64)), *ids(GPU1, *range(64))]
    chosen = preferred(plugin, free, 7)
    assert chosen == ids(GPU1, *range(7))
