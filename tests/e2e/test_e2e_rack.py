"""A rack on one machine, small (a large one's figures: bench/rack.py, docs/performance.md): three agents (`--dra on`,
each with its own fake NVML of 8 80 GiB GPUs, node name and MPS daemon) on nodes that no kubelet runs, kept Ready,
against the node's real API server and scheduler (`mpsagent_testing.rack`). Pods of one claim each of random memory
and compute, one in ten too big for any GPU, placed by the scheduler and prepared through the agents as the kubelet
would, a third of them replaced."""

from __future__ import annotations

from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.rack.rack import Rack
from mpsagent_testing.rack.workload import UNSCHEDULABLE, unschedulable

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
