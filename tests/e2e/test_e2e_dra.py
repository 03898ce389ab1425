"""DRA on a real node: the agent as a host process with `--dra on`, the real kubelet, scheduler (with consumable
capacity), controller-manager (claims from templates) and containerd 2.x, which applies the claims' CDI specs. GPUs
from the fake NVML library: two 80 GiB GPUs of `nvidia.com/gpu-mps`, and a 16 GiB pre-Volta GPU (16 MPS clients at
most) of `nvidia.com/gpu-old`. The scenarios run in order on one node and one agent (a later one restarts both)."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsagent_testing.agents import AgentProcess
from mpsagent_testing.cluster import claims, kubectl, node, pods
from mpsagent_testing.cluster.host_agent import GIB, HostAgents, fake_gpu, status
from mpsagent_testing.cluster.layout import KUBECONFIG
from mpsagent_testing.mps.daemon import require_real_control

require_real_control()

GPU_MPS = "nvidia.com/gpu-mps"
GPU_OLD = "nvidia.com/gpu-old"
OLD_CLIENTS = 16
CONFIG = f"""\
version: v1
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      rename: gpu-mps
      replicas: 4
      devices: [0, 1]
    - name: nvidia.com/gpu
      rename: gpu-old
      replicas: {OLD_CLIENTS}
      devices: [2]
"""
ON_MPS_GPUS = f'device.attributes["{claims.DRIVER}"].mpsResource == "{GPU_MPS}"'
ON_OLD_GPU = f'device.attributes["{claims.DRIVER}"].mpsResource == "{GPU_OLD}"'
CDI_DIR = Path("/var/run/cdi")
SCHEDULER_S = 30.0
UNPREPARE_S = 30.0


def _old_gpu() -> dict[str, Any]:
    gpu = fake_gpu(2, 16 * GIB)
    gpu["name"], gpu["major"] = "Tesla P100-PCIE-16GB", 6
    return gpu


@pytest.fixture(scope="module")
def agents(cluster: str) -> Iterator[HostAgents]:
    directory = Path(tempfile.mkdtemp(prefix="mpa-dra-", dir="/tmp"))
    launcher = HostAgents(directory, [fake_gpu(0, 80 * GIB), fake_gpu(1, 80 * GIB), _old_gpu()])
    claims.apply_file(claims.DEVICE_CLASS_FILE)
    yield launcher
    pods.delete_all()
    claims.delete_templates()
    launcher.close()
    kubectl.run("delete", "-f", str(claims.DEVICE_CLASS_FILE), "--ignore-not-found", check=False)
    shutil.rmtree(directory, ignore_errors=True)


def start(agents: HostAgents, cluster: str) -> AgentProcess:
    agent = agents.start(
        CONFIG, "--dra", "on", "--kubeconfig", str(KUBECONFIG), "--node-name", cluster, "--metrics-address", ""
    )
    agent.wait_log("resource slice published", timeout=30)
    kubectl.wait_for(lambda: dra_status().get("registered"), 30, "the DRA driver to be registered with the kubelet")
    return agent


@pytest.fixture(scope="module")
def agent(agents: HostAgents, cluster: str) -> AgentProcess:
    return start(agents, cluster)


@pytest.fixture(autouse=True)
def _clean(cluster: str) -> Iterator[None]:
    yield
    pods.delete_all()
    claims.delete_templates()
    # The kubelet unprepares a deleted pod's claims a moment after the pod is gone.
    kubectl.wait_for(lambda: not dra_status().get("claims"), UNPREPARE_S, "every claim to be unprepared")


def dra_status() -> dict[str, Any]:
    found: dict[str, Any] = status().get("dra") or {}
    return found


def prepared() -> dict[str, dict[str, Any]]:
    """The agent's prepared claims by the pod they are reserved for."""
    return {claim["pods"][0].split("/")[1]: claim for claim in dra_status().get("claims", []) if claim.get("pods")}


def gpu_status(resource: str, index: int) -> dict[str, Any]:
    entry = next(r for r in status()["resources"] if r["name"] == resource)
    gpu: dict[str, Any] = next(g for g in entry["gpus"].values() if g.get("ordinal") == index)
    return gpu


def wait_unprepared(pod: str) -> None:
    kubectl.wait_for(lambda: pod not in prepared(), UNPREPARE_S, f"the claim of {pod} to be unprepared")


def test_claims_are_placed_by_capacity_capped_at_their_memory_and_the_ceilings_follow(
    cluster: str, agent: AgentProcess
) -> None:
    claims.create_pod("c30", {"memory": "30Gi"}, selector=ON_MPS_GPUS)
    claims.create_pod("c40", {"memory": "40Gi"}, selector=ON_MPS_GPUS)
    got = {name: pods.report(name) for name in ("c30", "c40") if pods.wait_running(name)}
    first = claims.allocated_device("c30")
    assert claims.allocated_device("c40") == first, "30Gi and 40Gi fit one 80Gi GPU: the scheduler packs them"
    assert got["c30"].env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=30720M,1=30720M"
    assert got["c40"].env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M,1=40960M"
    assert got["c30"].env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "37"  # in proportion to 30 of 80 GiB
    assert got["c40"].env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert got["c30"].pipe, "the daemon's pipe directory is mounted"
    ordinal = int(first.removeprefix("gpu-"))
    held = gpu_status(GPU_MPS, ordinal)
    assert (held["memoryCeilingMiB"], held["threadCeiling"], held["liveGrants"]) == (40960, 50, 2)

    claims.create_pod("c20", {"memory": "20Gi"}, selector=ON_MPS_GPUS)
    pods.wait_running("c20")
    assert claims.allocated_device("c20") != first, "20Gi no longer fits beside 70Gi: the scheduler takes the other"

    claims.create_pod("c75", {"memory": "75Gi"}, selector=ON_MPS_GPUS)
    reason = kubectl.wait_for(lambda: claims.unschedulable_reason("c75"), SCHEDULER_S, "the scheduler's reason")
    assert "claim" in reason.lower(), reason
    assert pods.get("c75")["status"].get("phase") == "Pending"

    pods.delete("c30", "c40")
    wait_unprepared("c30")
    wait_unprepared("c40")
    pods.wait_running("c75", timeout=SCHEDULER_S + 30)  # the capacity freed is the next claim's
    assert claims.allocated_device("c75") == first
    assert pods.report("c75").env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=76800M,1=76800M"
    assert gpu_status(GPU_MPS, ordinal)["memoryCeilingMiB"] == 76800, "the ceilings follow the live shares down"

    pods.delete("c75", "c20")
    wait_unprepared("c75")
    wait_unprepared("c20")
    for index in (0, 1):
        back = gpu_status(GPU_MPS, index)
        assert (back["memoryCeilingMiB"], back["liveGrants"]) == (81920, 0), "no live share: the GPU's whole memory"


def test_a_claim_without_capacity_gets_a_whole_gpu_uncapped(cluster: str, agent: AgentProcess) -> None:
    claims.create_pod("whole", None, selector=ON_MPS_GPUS)
    pods.wait_running("whole")
    env = pods.report("whole").env
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-e2e")
    (device,) = prepared()["whole"]["devices"]
    assert device["whole"] is True


def test_device_plugin_grants_and_claims_share_one_ledger_daemon_and_client_limit(
    cluster: str, agent: AgentProcess
) -> None:
    # One pod of 15 containers: 15 device-plugin grants (MPS clients) on the 16-client GPU.
    many = pods.manifest("dp15", {GPU_OLD: 1})
    app = many["spec"]["containers"][0]
    many["spec"]["containers"] = [{**app, "name": f"app{i}"} for i in range(OLD_CLIENTS - 1)]
    kubectl.apply(many)
    pods.wait_phase("dp15", "Running")
    claims.create_pod("old-share", {"memory": "2Gi"}, selector=ON_OLD_GPU)
    pods.wait_running("old-share")
    old = gpu_status(GPU_OLD, 0)
    assert old["liveGrants"] == OLD_CLIENTS
    assert old["memoryCeilingMiB"] == 2048, "the claim's 2Gi is the largest cap beside 1/16 of 16Gi (1023 MiB)"
    kinds = [bool(g.get("claim")) for r in status()["resources"] if r["name"] == GPU_OLD for g in r["grants"]]
    assert sorted(kinds) == [False] * (OLD_CLIENTS - 1) + [True], "one ledger holds both routes' grants"

    claims.create_pod("one-too-many", {"memory": "1Gi"}, selector=ON_OLD_GPU)

    def refused() -> str | None:
        return next((e for e in claims.events("one-too-many") if "at most 16" in e), None)

    event = kubectl.wait_for(refused, SCHEDULER_S, "the prepare refused at the client limit")
    assert "device-plugin grants and claims" in event, event
    assert "one-too-many" not in prepared()
    assert gpu_status(GPU_OLD, 0)["liveGrants"] == OLD_CLIENTS, "a refused prepare holds nothing"


def test_bad_opaque_parameters_and_capacity_outside_the_policy_prepare_nothing(
    cluster: str, agent: AgentProcess
) -> None:
    before = dra_status()["prepared"]
    bad = {"apiVersion": f"{claims.DRIVER}/v1alpha1", "kind": "MpsShareConfig", "clientPriority": 1, "threads": 5}
    claims.create_pod("unknown-field", {"memory": "1Gi"}, selector=ON_MPS_GPUS, parameters=bad)
    out_of_range = {"apiVersion": f"{claims.DRIVER}/v1alpha1", "kind": "MpsShareConfig", "clientPriority": 7}
    claims.create_pod("out-of-range", {"memory": "1Gi"}, selector=ON_MPS_GPUS, parameters=out_of_range)
    claims.create_pod("compute-150", {"memory": "1Gi", "compute": "150"}, selector=ON_MPS_GPUS)

    def event_with(pod: str, text: str) -> str | None:
        return next((e for e in claims.events(pod) if text in e), None)

    unknown = kubectl.wait_for(lambda: event_with("unknown-field", "threads"), SCHEDULER_S, "the unknown field named")
    assert "unknown field" in unknown.lower() or "object contains unknown field" in unknown.lower(), unknown
    ranged = kubectl.wait_for(lambda: event_with("out-of-range", "clientPriority"), SCHEDULER_S, "the range named")
    assert "must be 0" in ranged, ranged
    reason = kubectl.wait_for(lambda: claims.unschedulable_reason("compute-150"), SCHEDULER_S, "the scheduler's reason")
    assert reason, "a capacity request outside the policy is not schedulable"
    assert not {"unknown-field", "out-of-range", "compute-150"} & set(prepared())
    assert dra_status()["prepared"] == before
    for pod in ("unknown-field", "out-of-range"):
        uid = claims.claim_of(pod)["metadata"]["uid"]
        assert not (CDI_DIR / f"mpsagent.io-mps-share_{uid}.json").exists(), "no CDI spec for a claim that failed"

    good = {"apiVersion": f"{claims.DRIVER}/v1alpha1", "kind": "MpsShareConfig", "clientPriority": 1}
    claims.create_pod("low-priority", {"memory": "1Gi"}, selector=ON_MPS_GPUS, parameters=good)
    pods.wait_running("low-priority")
    assert pods.report("low-priority").env["CUDA_MPS_CLIENT_PRIORITY"] == "1"


def test_an_agent_killed_and_a_kubelet_restarted_lose_nothing_and_prepare_nothing_twice(
    cluster: str, agents: HostAgents, agent: AgentProcess
) -> None:
    claims.create_pod("keep-a", {"memory": "10Gi"}, selector=ON_MPS_GPUS)
    claims.create_pod("keep-b", {"memory": "12Gi", "compute": "30"}, selector=ON_MPS_GPUS)
    for name in ("keep-a", "keep-b"):
        pods.wait_running(name)
    before = prepared()
    assert set(before) == {"keep-a", "keep-b"}

    agent.stop(signal.SIGKILL)
    again = start(agents, cluster)
    assert prepared() == before, "the checkpoint holds the prepared claims across a restart"
    live = [g for r in status()["resources"] for g in r["grants"] if g.get("claim")]
    assert len(live) == 2, "each claim's share is held once, in the ledger of its GPU's resource"

    node.restart_kubelet()
    kubectl.wait_for(lambda: dra_status().get("registered"), 60, "the DRA driver registered with the new kubelet")
    for name in ("keep-a", "keep-b"):
        assert pods.get(name)["status"]["phase"] == "Running"
    assert prepared() == before
    assert len([g for r in status()["resources"] for g in r["grants"] if g.get("claim")]) == 2

    pods.delete("keep-a", "keep-b")
    wait_unprepared("keep-a")
    wait_unprepared("keep-b")
    assert not [g for r in status()["resources"] for g in r["grants"] if g.get("claim")]
    assert not list(CDI_DIR.glob("mpsagent.io-mps-share_*.json"))
    assert again.process.poll() is None


def test_a_pod_asking_the_extended_resource_is_served_through_dra(cluster: str, agent: AgentProcess) -> None:
    """KEP-5004: a DeviceClass with `extendedResourceName: nvidia.com/gpu` serves a pod that asks `nvidia.com/gpu: 1`
    (and no claim) through DRA, on a node whose device plugin does not advertise that name: a whole GPU."""
    claims.apply_file(claims.EXTENDED_RESOURCE_CLASS_FILE)
    try:
        pods.create("extended", {"nvidia.com/gpu": 1})
        pods.wait_running("extended")
        env = pods.report("extended").env
        assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-e2e")
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
        (device,) = prepared()["extended"]["devices"]
        assert device["whole"] is True
    finally:
        pods.delete("extended")
        kubectl.run("delete", "-f", str(claims.EXTENDED_RESOURCE_CLASS_FILE), "--ignore-not-found")
