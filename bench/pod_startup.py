"""Pod start-up on the real node: how long a pod that asks for one device takes from its creation at the API server
to Running, through the agent (`nvidia.com/gpu`, 1 of 4 replicas of a fake GPU: GetPreferredAllocation, Allocate
with the daemon's ceilings, PreStartContainer) against a device plugin that does nothing
(`mpsagent_testing.cluster.noop_plugin`, `example.com/noop`). The two kinds of pod alternate, one pod at a time,
each deleted before the next; the agent is a host process with the real MPS control daemon and the fake NVML
library. Target: the agent's pod at most 1.10 times the do-nothing plugin's pod next to it (the median of the
pairs' ratios; the ratio of the two medians is printed too).

    .venv/bin/python bench/pod_startup.py [--pods 40] [--json bench/results/pod-startup.json]

Brings the node up (`scripts/e2e-cluster up`) unless it is up, and takes it down again if it brought it up."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mpsagent_testing.cluster import kubectl, node, pods
from mpsagent_testing.cluster.host_agent import HostAgents, fake_gpu
from mpsagent_testing.repo import ROOT, commit

GPU = "nvidia.com/gpu"
NOOP = "example.com/noop"
TARGET_RATIO = 1.10
CONFIG = f"version: v1\nsharing:\n  mps:\n    resources:\n    - name: {GPU}\n      replicas: 4\n"
SETTLE_S = 1.5


def quiet_pod(name: str, resource: str) -> dict[str, Any]:
    """The tests' pod, asking one `resource`, with a container that only sleeps."""
    manifest = pods.manifest(name, {resource: 1})
    manifest["spec"]["containers"][0]["command"] = ["/bin/sleep", "3600"]
    return manifest


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_s": statistics.median(ordered),
        "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
        "mean_s": statistics.fmean(ordered),
        "min_s": ordered[0],
        "max_s": ordered[-1],
    }


def measure(count: int) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mpa-bench-pods-", dir="/tmp"))
    agents = HostAgents(directory, [fake_gpu(0), fake_gpu(1)])
    noop = subprocess.Popen([sys.executable, "-m", "mpsagent_testing.cluster.noop_plugin", NOOP, "8"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        agent = agents.start(CONFIG, "--reconcile-grace-seconds", "10")
        agent.wait_log("registered with kubelet", timeout=30)
        name = node.node_name()
        kubectl.wait_for(lambda: pods.allocatable(name, GPU) == 8 and pods.allocatable(name, NOOP) == 8, 30,
                         "both resources allocatable")  # fmt: skip
        samples: dict[str, list[float]] = {GPU: [], NOOP: []}
        for i in range(count + 2):  # the first two of each warm up the node's caches and are not counted
            for resource in (GPU, NOOP) if i % 2 == 0 else (NOOP, GPU):
                pod = f"bench-{resource.split('/')[1]}-{i}"
                took = pods.time_to_running(quiet_pod(pod, resource))
                pods.delete(pod)
                # The kubelet tears the sandbox down after the API object is gone: let that end before the next pod.
                time.sleep(SETTLE_S)
                if i >= 2:
                    samples[resource].append(took)
        agent.stop()
    finally:
        noop.terminate()
        noop.wait(10)
        pods.delete_all()
        agents.close()
        shutil.rmtree(directory, ignore_errors=True)
    agent_stats, noop_stats = summary(samples[GPU]), summary(samples[NOOP])
    # Each agent pod against the do-nothing pod next to it: the node's own drift (its caches, its other work on two
    # cores) moves both alike.
    paired = statistics.median(a / b for a, b in zip(samples[GPU], samples[NOOP], strict=True))
    ratio = agent_stats["median_s"] / noop_stats["median_s"]
    return {
        "pods_each": count,
        "agent": agent_stats,
        "noop": noop_stats,
        "ratio_median": ratio,
        "ratio_paired_median": paired,
        "target_ratio": TARGET_RATIO,
        "pass": paired <= TARGET_RATIO,
        "samples": samples,
        "commit": commit(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=40, help="pods of each kind counted (default 40)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "pod-startup.json")
    args = parser.parse_args()
    with node.up_meanwhile():
        result = measure(args.pods)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"{'pod created -> Running':<28} {'median':>8} {'p90':>8} {'mean':>8}")
    for label, key in (("agent (nvidia.com/gpu: 1)", "agent"), ("do-nothing plugin", "noop")):
        stats = result[key]
        print(f"{label:<28} {stats['median_s']:>7.3f}s {stats['p90_s']:>7.3f}s {stats['mean_s']:>7.3f}s")
    verdict = "pass" if result["pass"] else "FAIL"
    print(f"agent / do-nothing: median of pairs {result['ratio_paired_median']:.3f} (of medians "
          f"{result['ratio_median']:.3f})  target <= {TARGET_RATIO}  {verdict}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
