"""A rack on one machine: N agents (`--dra on`, each with its own fake NVML of 8 80 GiB GPUs, node name, kubelet
directory, MPS root and daemon, and service account) against the real node's API server, scheduler and
controller-manager, on nodes that no kubelet runs, kept Ready by Lease heartbeats (`mpsagent_testing.rack`). It
measures:

- the time from each agent's start to its ResourceSlice at the API server (all started at once), and from a
  device-plugin grant (one replica of GPU 7, made on each agent through the grpcio kubelet stand-in) to the slice
  offering less of that GPU;
- each agent's requests as the API server's audit log records them (writes, reads, watches started, watches held),
  per second, idle before any claim, under churn, and idle again with the claims held; its CPU and RSS in each;
- the churn: pods of one claim each of random memory (1 to 64 GiB) and compute (none, or 5 to 50 %), one in ten
  asking 96 GiB (more than any GPU), `--pods-per-agent` x N at first, then `--waves` times a third of them deleted
  and as many new ones, each wave settled (every pod placed and its claim prepared through the agent, as the
  kubelet would, or Pending with the scheduler's reason where its claim fits no device; no container runs: the
  nodes have no kubelet); at every change of a claim or a slice the API server showed, no device
  holding more than its slice offers (memory, compute) or more than 48 MPS clients; every pod left Pending told
  why by the scheduler.

    .venv/bin/python bench/rack.py [--agents 16] [--pods-per-agent 20] [--waves 2] [--idle-seconds 60]
        [--seed 1] [--json bench/results/rack-16.json]

Brings the node up (`scripts/e2e-cluster up`) unless it is up, and takes it down again if it brought it up; never
beside the e2e tests (one node per machine). Prints the figures, each target with pass or FAIL (no device over its
offer, no prepare refused, every Pending pod told why, no write and no read but the watch while idle), and writes
them as JSON; exits 0 whether or not the targets are met."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from machine import machine_info

from mpsagent_testing.cluster import node
from mpsagent_testing.processes import cpu_times
from mpsagent_testing.rack.audit import Requests
from mpsagent_testing.rack.capacity import MAX_CLIENTS
from mpsagent_testing.rack.rack import Rack, Window
from mpsagent_testing.rack.workload import UNSCHEDULABLE, unschedulable
from mpsagent_testing.repo import ROOT, commit

GRANT_GPU = 7
NODE_PARTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "etcd")


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1]}


def node_cpu() -> dict[str, float]:
    """CPU seconds each of the node's parts has spent."""
    return {name: cpu_times(p.pid).own_s for name, p in node.recorded().items() if name in NODE_PARTS}


def window_summary(window: Window, node_before: dict[str, float], node_after: dict[str, float]) -> dict[str, Any]:
    """Per agent per second, the median and the largest over the agents; what the node's parts spent."""
    seconds = window.seconds
    requests = window.requests.values()
    return {
        "seconds": round(seconds, 1),
        "writes_per_s": spread([r.writes / seconds for r in requests]),
        "reads_per_s": spread([r.reads / seconds for r in requests]),
        "watches_started_per_s": spread([r.watches / seconds for r in requests]),
        "requests_per_s": spread([r.total / seconds for r in requests]),
        "watches_held": spread([float(r.held) for r in requests]),
        "writes": sum(r.writes for r in requests),
        "reads": sum(r.reads for r in requests),
        "by_kind": dict(sum((r.by_kind for r in requests), Counter())),
        "agent_cpu_percent": spread(list(window.cpu_percent.values())),
        "agent_rss_mb": spread([b / 1e6 for b in window.rss_bytes.values()]),
        "node_cpu_percent": {
            name: round(100 * (node_after[name] - node_before[name]) / seconds, 1) for name in node_after
        },
    }


def measured(rack: Rack, seconds: float = 0.0, during: Callable[[], object] | None = None) -> dict[str, Any]:
    before = node_cpu()
    window = rack.window(seconds, during)
    return window_summary(window, before, node_cpu())


def run(args: argparse.Namespace) -> dict[str, Any]:
    choose = random.Random(args.seed)
    with Rack(args.agents, seed=args.seed) as rack:
        appeared = rack.wait_slices()
        all_appeared = max(appeared[n] + rack.started_at[i] for i, n in enumerate(rack.names)) - min(rack.started_at)
        followed = [rack.grant_followed(agent, GRANT_GPU) for agent in rack.agents.agents]
        idle = measured(rack, args.idle_seconds)
        live: list[str] = []
        submitted = 0

        def churn() -> None:
            nonlocal submitted
            live.extend(rack.submit(args.pods_per_agent * args.agents))
            submitted += len(live)
            rack.settle()
            for _ in range(args.waves):
                gone = choose.sample(live, len(live) // 3)
                rack.delete(gone)
                for name in gone:
                    live.remove(name)
                live.extend(rack.submit(len(gone)))
                submitted += len(gone)
                rack.settle()

        busy = measured(rack, during=churn)
        held = measured(rack, args.idle_seconds)
        pods = rack.settle()
        run_s = time.time() - min(rack.started_at)
        whole = rack.audit.window(min(rack.started_at), time.time())
        mine = [whole.get(agent.user, Requests()) for agent in rack.agents.agents]
        assert rack.kubelet is not None
        outcomes = rack.kubelet.outcomes
        refused = [f"{o.pod} on {o.node}: {o.error}" for o in outcomes if o.error]
        pending = {name: unschedulable(pod) for name, pod in pods.items() if not pod["spec"].get("nodeName")}
        sizes = rack.workload.sizes
        placed_on = [pod["spec"]["nodeName"] for pod in pods.values() if pod["spec"].get("nodeName")]
        return {
            "agents": args.agents,
            "gpus": args.agents * 8,
            "seed": args.seed,
            "slice_appeared_s": spread(list(appeared.values())),
            "all_slices_appeared_s": round(all_appeared, 2),
            "grant_followed_s": spread(followed),
            "idle": idle,
            "churn": busy,
            "idle_with_claims": held,
            "whole_run": {
                "seconds": round(run_s, 1),
                "requests_per_s": spread([r.total / run_s for r in mine]),
                "writes": spread([float(r.writes) for r in mine]),
                "by_kind": dict(sum((r.by_kind for r in mine), Counter())),
            },
            "pods_submitted": submitted,
            "pods_live": len(pods),
            "pods_placed": len(placed_on),
            "nodes_used": len(set(placed_on)),
            "pods_pending": len(pending),
            "pending_too_big": sum(1 for name in pending if sizes[name].too_big),
            "pending_without_reason": sorted(
                name for name, why in pending.items() if not why or UNSCHEDULABLE not in why
            ),
            "pending_that_fit_now": sorted(
                name
                for name in pending
                if not sizes[name].too_big and rack.capacity.fits_somewhere(*sizes[name].consumes())
            ),
            "pending_reason_example": next(iter(pending.values()), None),
            "prepares": len(outcomes),
            "prepare_ms": spread([1000 * o.seconds for o in outcomes]) if outcomes else None,
            "refused": refused,
            "stand_in_failures": rack.kubelet.failures,
            "states_checked": rack.capacity.checks,
            "oversubscribed": rack.capacity.violations,
            "fullest": rack.capacity.highest,
        }


def print_report(result: dict[str, Any]) -> None:
    def ms(value: dict[str, float], seconds: float = 1.0) -> str:
        return f"{value['median'] * seconds * 1000:.0f} ms (max {value['max'] * seconds * 1000:.0f})"

    def verdict(met: bool) -> str:
        return "(target 0: pass)" if met else "(target 0: FAIL)"

    fullest = result["fullest"]
    print(f"rack: {result['agents']} agents, {result['gpus']} GPUs; commit {result['commit'][:7]}")
    print(
        f"slice at the API server after the agent's start: {result['slice_appeared_s']['median']:.2f} s median, "
        f"{result['slice_appeared_s']['max']:.2f} s max; all {result['agents']} after "
        f"{result['all_slices_appeared_s']:.2f} s"
    )
    print(f"slice follows a device-plugin grant: {ms(result['grant_followed_s'])}")
    for title, key in (("idle", "idle"), ("churn", "churn"), ("idle, claims held", "idle_with_claims")):
        w = result[key]
        quiet = "" if key == "churn" else " " + verdict(w["writes"] == 0 and w["reads"] == 0)
        print(
            f"{title} ({w['seconds']:.0f} s): per agent per second, median (max): "
            f"writes {w['writes_per_s']['median']:.3f} ({w['writes_per_s']['max']:.3f}), "
            f"reads {w['reads_per_s']['median']:.3f} ({w['reads_per_s']['max']:.3f}), "
            f"watches started {w['watches_started_per_s']['median']:.3f}{quiet}; watches held "
            f"{w['watches_held']['median']:.0f} ({w['watches_held']['max']:.0f}); agent CPU "
            f"{w['agent_cpu_percent']['median']:.2f} % ({w['agent_cpu_percent']['max']:.2f} %), RSS "
            f"{w['agent_rss_mb']['median']:.1f} MB ({w['agent_rss_mb']['max']:.1f}); {w['by_kind']}"
        )
        print(f"  node, per cent of a core: {w['node_cpu_percent']}")
    whole = result["whole_run"]
    print(
        f"whole run ({whole['seconds']:.0f} s from the first start): per agent {whole['requests_per_s']['median']:.3f} "
        f"requests/s median, writes {whole['writes']['median']:.0f} (max {whole['writes']['max']:.0f}); "
        f"{whole['by_kind']}"
    )
    print(
        f"pods: {result['pods_submitted']} submitted, {result['pods_live']} live at the end: {result['pods_placed']} "
        f"placed on {result['nodes_used']} nodes, {result['pods_pending']} Pending ({result['pending_too_big']} "
        f"too big for any GPU; {len(result['pending_that_fit_now'])} that would fit now; "
        f"{len(result['pending_without_reason'])} without the scheduler's reason "
        f"{verdict(not result['pending_without_reason'])})"
    )
    prepare = ms(result["prepare_ms"], 1e-3) if result["prepare_ms"] else "-"
    print(
        f"prepares {result['prepares']} (the round trip {prepare}), refused {len(result['refused'])} "
        f"{verdict(not result['refused'])}, the stand-in's failures {len(result['stand_in_failures'])}"
    )
    print(
        f"oversubscribed: {len(result['oversubscribed'])} in {result['states_checked']} states checked "
        f"{verdict(not result['oversubscribed'])}; the fullest devices: memory {fullest['memory']:.3f} of the offer, "
        f"compute {fullest['compute']:.2f} of the offer, clients {fullest['clients']:.0f} of {MAX_CLIENTS}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--pods-per-agent", type=int, default=20, help="pods submitted at first, per agent (20)")
    parser.add_argument("--waves", type=int, default=2, help="times a third of the pods are replaced (2)")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="each idle window (60)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="default bench/results/rack-<agents>.json")
    args = parser.parse_args()
    machine = machine_info()
    with node.up_meanwhile():
        result = run(args)
    result |= {"commit": commit(), "machine": machine, "load_average_end": list(os.getloadavg())}
    path = args.json or ROOT / "bench" / "results" / f"rack-{args.agents}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print_report(result)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
