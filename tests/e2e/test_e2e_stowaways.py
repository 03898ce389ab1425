"""Processes on a GPU without a share of it, on a real node: the agent (a host process, `--dra on`) over the fake
NVML, whose process lists the tests fill with the host PIDs of real pods' processes (containerd's, in the cgroups
the kubelet and runc made), named through the kubelet's own links in /var/log/containers."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsagent_testing.agents import AgentProcess
from mpsagent_testing.cluster import claims, kubectl, pods
from mpsagent_testing.cluster.host_agent import GIB, HostAgents, dra_status, fake_gpu, status
from mpsagent_testing.mps.daemon import require_real_control

require_real_control()

GPU = "nvidia.com/gpu"
CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
PROBE_S = 1.0
FOUND = "process on a gpu without a grant or claim there"
UNPREPARE_S = 30.0
RECONCILE_S = 10


@pytest.fixture(scope="module")
def agents(cluster: str) -> Iterator[HostAgents]:
    directory = Path(tempfile.mkdtemp(prefix="mpa-stow-", dir="/tmp"))
    launcher = HostAgents(directory, [fake_gpu(0, 16 * GIB), fake_gpu(1, 16 * GIB)])
    claims.apply_file(claims.DEVICE_CLASS_FILE)
    yield launcher
    pods.delete_all()
    kubectl.run("delete", "resourceclaim", "--all", "-n", pods.NAMESPACE, "--ignore-not-found", check=False)
    launcher.close()
    kubectl.run("delete", "-f", str(claims.DEVICE_CLASS_FILE), "--ignore-not-found", check=False)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(agents: HostAgents, cluster: str) -> AgentProcess:
    return agents.start_dra(
        CONFIG, cluster, "--reconcile-grace-seconds", str(RECONCILE_S), "--probe-interval-seconds", str(PROBE_S)
    )


@pytest.fixture(autouse=True)
def _clean(agents: HostAgents, cluster: str) -> Iterator[None]:
    yield
    for gpu in agents.gpus:
        agents.driver.set_processes(gpu["uuid"], [], mps=True)
    pods.delete_all()
    kubectl.run("delete", "resourceclaim", "--all", "-n", pods.NAMESPACE, "--ignore-not-found", check=False)
    kubectl.wait_for(lambda: not dra_status().get("claims"), UNPREPARE_S, "every claim unprepared")


def sleeper(pod: str) -> int:
    """The host PID of the pod's `sleep` (its container's last command: the report's `exec sleep`)."""
    (container,) = pods.get(pod)["status"]["containerStatuses"]
    container_id = str(container["containerID"]).rpartition("://")[2]

    def find() -> int | None:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if container_id in (entry / "cgroup").read_text() and (entry / "comm").read_text() == "sleep\n":
                        return int(entry.name)
                except OSError:
                    continue
        return None

    return kubectl.wait_for(find, 10, f"the sleep of pod {pod}")


def found(agent: AgentProcess) -> list[dict[str, object]]:
    return [e for e in agent.log_events() if e.get("event") == FOUND]


def stowaways() -> list[dict[str, Any]]:
    shown: list[dict[str, Any]] = (status().get("stowaways") or {}).get("stowaways", [])
    return shown


def test_a_pod_that_holds_nothing_is_reported_with_its_name_within_one_probe_interval(
    agents: HostAgents, agent: AgentProcess
) -> None:
    """A pod with no grant and no claim (as a privileged pod that mounts the MPS pipe directory would be): its process
    on a GPU is reported with its pod's name; a pod granted a share of that GPU beside it is not."""
    kubectl.apply([pods.manifest("holds-nothing", {}), pods.manifest("holds-a-share", {GPU: 1})])
    pods.wait_running("holds-nothing")
    pods.wait_running("holds-a-share")
    uuid = pods.report("holds-a-share").env["NVIDIA_VISIBLE_DEVICES"]
    kubectl.wait_for(
        lambda: any(g.get("container") for r in status()["resources"] for g in r["grants"]), 10, "the grant listed"
    )
    before = len(found(agent))
    put = time.monotonic()
    agents.driver.set_processes(uuid, [(sleeper("holds-a-share"), GIB), (sleeper("holds-nothing"), 2 * GIB)], mps=True)
    event = kubectl.wait_for(lambda: found(agent)[before:], 10, "the stowaway reported")[0]
    waited = time.monotonic() - put
    print(f"a pod's process without a share reported {waited:.2f} s after NVML listed it (probe {PROBE_S:g} s)")
    assert waited <= PROBE_S + 0.5
    assert (event["gpu"], event["pod"], event["container"]) == (uuid, f"{pods.NAMESPACE}/holds-nothing", "app")
    (shown,) = kubectl.wait_for(stowaways, 5, "the status")
    assert (shown["pod"], shown["usedBytes"]) == ("holds-nothing", 2 * GIB)
    # Gone with its pod.
    pods.delete("holds-nothing")
    kubectl.wait_for(lambda: not stowaways(), 10, "the stowaway forgotten")


def test_a_pod_that_shares_a_claim_prepared_for_another_is_not_a_stowaway(
    agents: HostAgents, agent: AgentProcess
) -> None:
    """The kubelet prepares a claim once per node: the second pod that shares it is never told to the driver. The
    agent reads the claim's reservedFor again before it calls that pod's process a stowaway."""
    spec = claims.template("unused", {"memory": "4Gi"})["spec"]["spec"]
    shared = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "shared", "namespace": pods.NAMESPACE},
        "spec": spec,
    }
    first, second = (pods.manifest(name, {}) for name in ("first", "second"))
    for pod in (first, second):
        pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": claims.CLAIM}]}
        pod["spec"]["resourceClaims"] = [{"name": claims.CLAIM, "resourceClaimName": "shared"}]
    kubectl.apply([shared, first])
    pods.wait_running("first")
    kubectl.apply(second)
    pods.wait_running("second")
    (claim,) = dra_status()["claims"]
    assert claim["pods"] == [f"{pods.NAMESPACE}/first"], "prepared once, for the first pod"
    uuid = pods.report("second").env["NVIDIA_VISIBLE_DEVICES"]
    before = len(found(agent))
    agents.driver.set_processes(uuid, [(sleeper("first"), GIB), (sleeper("second"), GIB)], mps=True)
    read = agent.wait_log("claim's pods read again", timeout=10)
    assert sorted(read["pods"]) == [f"{pods.NAMESPACE}/first", f"{pods.NAMESPACE}/second"]
    time.sleep(3 * PROBE_S)
    assert found(agent)[before:] == []
    assert stowaways() == []
