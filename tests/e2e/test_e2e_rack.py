"""A rack on one machine, small (a large one's figures: bench/rack.py, docs/performance.md): three agents (`--dra on`,
each with its own fake NVML of 8 80 GiB GPUs, node name and MPS daemon) on nodes that no kubelet runs, kept Ready,
against the node's real API server and scheduler (`mpsagent_testing.rack`). Pods of one claim each of random memory
and compute, one in ten too big for any GPU, placed by the scheduler and prepared through the agents as the kubelet
would, a third of them replaced."""

from __future__ import annotations

from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.rack.rack import Rack
from mpsagent_testing.rack.workload import UNSCHEDULABLE, Size, unschedulable

require_real_control()

AGENTS = 3
PODS = 30
SEED = 36
IDLE_S = 10.0
SETTLE_S = 60.0
GRANT_GPU = 7


def test_a_rack_places_random_claims_without_oversubscribing_a_gpu_and_its_idle_agents_write_nothing(
    cluster: str,
) -> None:
    with Rack(AGENTS, seed=SEED) as rack:
        rack.wait_slices()
        rack.grant_followed(rack.agents.agents[0], GRANT_GPU)  # fails unless the slice offers less after it
        names = rack.submit(PODS)
        rack.settle(SETTLE_S)
        replaced = names[1::3]
        rack.delete(replaced)
        rack.submit(len(replaced))
        pods = rack.settle(SETTLE_S)
        idle = rack.window(IDLE_S)

        assert rack.capacity.violations == [], "no device ever holds more than its slice offers, or 48 clients"
        assert rack.capacity.checks > 2 * PODS, "every allocation and release was checked"
        assert rack.kubelet is not None
        assert rack.kubelet.failures == []
        prepared = rack.kubelet.prepared()
        placed = {name: pod["spec"]["nodeName"] for name, pod in pods.items() if pod["spec"].get("nodeName")}
        assert set(placed.values()) == set(rack.names), "the scheduler places claims across the rack"
        for name in placed:
            assert prepared[name].error == "", f"{name}: the agent refused what the scheduler allocated"
            assert prepared[name].devices == (rack.allocated_device(name),), "the agent prepares the allocation"

        too_big = [name for name in pods if rack.workload.sizes[name].too_big]
        assert too_big, "the workload has claims that fit no GPU"
        for name in too_big:
            assert name not in placed
            reason = unschedulable(pods[name])
            assert reason is not None and UNSCHEDULABLE in reason, f"{name}: {reason}"

        for node, requests in idle.requests.items():
            assert (requests.writes, requests.reads, requests.watches) == (0, 0, 0), f"{node}: {requests.by_kind}"
            assert requests.held >= 1, f"{node} holds its slice's watch"


def test_a_gpu_takes_no_more_claims_than_its_mps_server_has_clients_beside_the_device_plugins(cluster: str) -> None:
    """One agent with one 80 GiB GPU and a device-plugin grant on it; 48 claims of 1 GiB each (memory and SMs to
    spare): the slice offers 47 clients, so the scheduler places 47 and leaves the 48th Pending with its reason,
    instead of allocating what the agent must refuse at prepare (MPS serves 48 clients a GPU). A claim that goes
    makes room for it."""
    with Rack(1, seed=SEED, gpus=1) as rack:
        rack.wait_slices()
        rack.grant_followed(rack.agents.agents[0], 0)
        names = rack.submit(48, Size(1, None))
        pods = rack.settle(SETTLE_S)

        assert rack.capacity.violations == [], "no GPU ever holds more than 48 MPS clients"
        assert rack.kubelet is not None
        assert rack.kubelet.failures == []
        prepared = rack.kubelet.prepared()
        placed = [name for name in names if pods[name]["spec"].get("nodeName")]
        assert len(placed) == 47, "the grant's client and 47 claims' are all MPS serves"
        assert all(prepared[name].error == "" for name in placed), "the agent prepares every claim it is given"
        (waiting,) = set(names) - set(placed)
        reason = unschedulable(pods[waiting])
        assert reason is not None and UNSCHEDULABLE in reason, f"{waiting}: {reason}"

        rack.delete(placed[:1])
        pods = rack.settle(SETTLE_S)
        assert pods[waiting]["spec"].get("nodeName") == rack.names[0]
        assert rack.kubelet.prepared()[waiting].error == ""
        assert rack.capacity.violations == []
