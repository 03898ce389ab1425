"""The node's ResourceSlice on the real node: how many writes the API server answers for ResourceSlices while the node
is idle (its own `apiserver_request_total`: create, update, patch, apply, delete), and how soon a slice deleted
behind the agent is back. The agent is a host process with `--dra on` and two fake 80 GiB GPUs; nothing else on the
node writes ResourceSlices. Targets (docs/dra.md): no write while idle, the deleted slice back within 5 s.

    .venv/bin/python bench/dra_slice_quiet.py [--idle-seconds 300] [--json bench/results/dra-slice-quiet.json]

Brings the node up (`scripts/e2e-cluster up`) unless it is up, and takes it down again if it brought it up."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mpsagent_testing.cluster import claims, kubectl, node
from mpsagent_testing.cluster.host_agent import GIB, HostAgents, fake_gpu, status
from mpsagent_testing.cluster.layout import KUBECONFIG
from mpsagent_testing.repo import ROOT, commit

CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
START_TIMEOUT_S = 30.0
REPAIR_TARGET_S = 5.0
RESOURCE = "resourceslices"


def node_slices() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = kubectl.get(RESOURCE, "--field-selector", f"spec.driver={claims.DRIVER}")["items"]
    return found


def measure(idle_s: float) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mpa-bench-slice-", dir="/tmp"))
    agents = HostAgents(directory, [fake_gpu(0, 80 * GIB), fake_gpu(1, 80 * GIB)])
    name = node.node_name()
    try:
        agent = agents.start(CONFIG, "--dra", "on", "--kubeconfig", str(KUBECONFIG), "--node-name", name,
                             "--metrics-address", "")  # fmt: skip
        agent.wait_log("dra driver serving", timeout=START_TIMEOUT_S)
        kubectl.wait_for(node_slices, START_TIMEOUT_S, "the node's slice")
        kubectl.wait_for(lambda: (status().get("dra") or {}).get("registered"), START_TIMEOUT_S, "the agent registered")
        (published,) = node_slices()
        writes_before = kubectl.api_writes(RESOURCE)
        time.sleep(idle_s)
        idle_writes = kubectl.api_writes(RESOURCE) - writes_before

        kubectl.run("delete", RESOURCE, published["metadata"]["name"], "--wait=true")
        began = time.monotonic()
        kubectl.wait_for(node_slices, 30, "the deleted slice back")
        back_s = time.monotonic() - began
        (again,) = node_slices()
        agent.stop()
    finally:
        agents.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "commit": commit(),
        "idle_s": idle_s,
        "idle_writes": idle_writes,
        "deleted_slice_back_s": round(back_s, 3),
        "generation_before": published["spec"]["pool"]["generation"],
        "generation_after": again["spec"]["pool"]["generation"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-seconds", type=float, default=300.0, help="how long the idle node is watched (300)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "dra-slice-quiet.json")
    args = parser.parse_args()
    with node.up_meanwhile():
        result = measure(args.idle_seconds)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    quiet = "pass" if result["idle_writes"] == 0 else "FAIL"
    repaired = "pass" if result["deleted_slice_back_s"] <= REPAIR_TARGET_S else "FAIL"
    print(f"ResourceSlice writes over {args.idle_seconds:g} s idle: {result['idle_writes']} (target 0: {quiet})")
    print(
        f"deleted slice back after {result['deleted_slice_back_s']:.2f} s (target <= {REPAIR_TARGET_S:g} s: "
        f"{repaired}); pool generation {result['generation_before']} -> {result['generation_after']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
