"""Pods on the e2e node: a busybox pod that asks for extended resources and prints what it was given (its
environment, its mounts and the MPS pipe directory), and the waits and reads the scenarios make on them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from mpsagent_testing.cluster import kubectl, node
from mpsagent_testing.cluster.layout import BUSYBOX_IMAGE

NAMESPACE = "default"
POD_TIMEOUT_S = 60.0
REPORT = """\
echo BEGIN-ENV; env | grep -E '^(CUDA_|NVIDIA_)' | sort; echo END-ENV
echo BEGIN-MOUNTS; grep -E ' (/dev/shm|/mps/[^ ]*) ' /proc/mounts | cut -d' ' -f2 | sort; echo END-MOUNTS
echo BEGIN-PIPE; ls "$CUDA_MPS_PIPE_DIRECTORY" 2>/dev/null | sort; echo END-PIPE
exec sleep 2147483647
"""
"""What the pod's container runs: the CUDA/NVIDIA variables, the MPS mounts and the pipe directory's entries
between markers, then it waits to be deleted."""


def manifest(name: str, resources: dict[str, int], node_name: str | None = None) -> dict[str, Any]:
    """A pod whose one container asks for `resources` (limits) and reports what it got. `node_name` bypasses the
    scheduler (the kubelet alone admits it)."""
    spec: dict[str, Any] = {
        # Loopback only on this node (docs/e2e.md): pods share the host's network.
        "hostNetwork": True,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 0,
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "app",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", REPORT],
                "resources": {"limits": {key: str(value) for key, value in resources.items()}},
            }
        ],
    }
    if node_name is not None:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


def create(name: str, resources: dict[str, int], node_name: str | None = None) -> None:
    kubectl.apply(manifest(name, resources, node_name))


def get(name: str) -> dict[str, Any]:
    pod: dict[str, Any] = kubectl.get("pod", name, "-n", NAMESPACE)
    return pod


def wait_running(name: str, timeout: float = POD_TIMEOUT_S) -> dict[str, Any]:
    """The pod once its container runs and has printed its report; AssertionError with its status if it failed."""

    def running() -> dict[str, Any] | None:
        pod = get(name)
        phase = pod["status"].get("phase")
        if phase == "Failed":
            raise AssertionError(f"pod {name} failed: {json.dumps(pod['status'])[:2000]}")
        if phase == "Running" and "END-PIPE" in logs(name):
            return pod
        return None

    return kubectl.wait_for(running, timeout, f"pod {name} to run")


def wait_phase(name: str, phase: str, timeout: float = POD_TIMEOUT_S) -> dict[str, Any]:
    def in_phase() -> dict[str, Any] | None:
        pod = get(name)
        return pod if pod["status"].get("phase") == phase else None

    return kubectl.wait_for(in_phase, timeout, f"pod {name} to be {phase}")


def logs(name: str) -> str:
    return kubectl.run("logs", name, "-n", NAMESPACE, check=False)


@dataclass(frozen=True)
class Report:
    """What the container saw: its CUDA/NVIDIA variables, its MPS mount points and its pipe directory."""

    env: dict[str, str]
    mounts: list[str]
    pipe: list[str]


def _section(text: str, name: str) -> list[str]:
    body = text.split(f"BEGIN-{name}\n", 1)[1].split(f"END-{name}", 1)[0]
    return [line for line in body.splitlines() if line]


def report(name: str) -> Report:
    text = logs(name)
    env = dict(line.split("=", 1) for line in _section(text, "ENV"))
    return Report(env=env, mounts=_section(text, "MOUNTS"), pipe=_section(text, "PIPE"))


def delete(*names: str, wait: bool = True, graceful: bool = False) -> None:
    """Force-delete the pods (gone from the API at once), or `graceful`ly: the kubelet ends them within 1 s and
    releases what they held (a DRA claim is unprepared) before the pod object goes."""
    if names:
        how = ["--grace-period=1"] if graceful else ["--grace-period=0", "--force"]
        kubectl.run("delete", "pod", "-n", NAMESPACE, "--ignore-not-found", f"--wait={str(wait).lower()}",
                    *how, *names, timeout=90)  # fmt: skip


def delete_all() -> None:
    kubectl.run("delete", "pods", "--all", "-n", NAMESPACE, "--grace-period=0", "--force", "--wait=true", timeout=90)


def allocatable(node: str, resource: str) -> int:
    found = kubectl.get("node", node)["status"].get("allocatable", {}).get(resource, "0")
    return int(found)


RUNNING_TIMEOUT_S = 60


def time_to_running(manifest: dict[str, Any], timeout: float = RUNNING_TIMEOUT_S) -> float:
    """Create the pod and return the seconds from the create request to the watch event that shows it Running (the
    benches' measure: no kubectl process in between)."""
    name = manifest["metadata"]["name"]
    collection = f"/api/v1/namespaces/{NAMESPACE}/pods"
    # resourceVersion=0: from what the API server's watch cache holds (a node just up may not hold the newest yet).
    query = f"?watch=1&resourceVersion=0&fieldSelector=metadata.name%3D{name}&timeoutSeconds={int(timeout)}"
    with node.api_request("GET", collection + query, timeout=timeout) as watch:
        started = time.perf_counter()
        with node.api_request("POST", collection, manifest):
            pass
        for line in watch:
            event = json.loads(line)
            if event["type"] == "ERROR":
                raise RuntimeError(f"watching pod {name}: {event['object'].get('message')}")
            phase = event["object"]["status"].get("phase")
            if phase == "Running":
                return time.perf_counter() - started
            if phase == "Failed":
                raise RuntimeError(f"pod {name} failed: {json.dumps(event['object']['status'])[:1000]}")
    raise TimeoutError(f"pod {name} was not Running within {timeout:g} s")
