"""DRA on a real node: the agent as a host process with `--dra on`, the real kubelet, scheduler (with consumable
capacity), controller-manager (claims from templates) and containerd 2.x, which applies the claims' CDI specs. GPUs
from the fake NVML library: two 80 GiB GPUs of `nvidia.com/gpu-mps`, and a 16 GiB pre-Volta GPU (16 MPS clients at
most) of `nvidia.com/gpu-old`. The scenarios run in order on one node and one agent (a later one restarts both)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsagent_testing.agents import AgentProcess
from mpsagent_testing.cgroups import pod_cgroup
from mpsagent_testing.cluster import claims, kubectl, node, pods
from mpsagent_testing.cluster.host_agent import GIB, HostAgents, dra_status, fake_gpu, pipe_directory, status
from mpsagent_testing.mps.daemon import require_real_control, silent_connection

require_real_control()

GPU_MPS = "nvidia.com/gpu-mps"
GPU_OLD = "nvidia.com/gpu-old"
OLD_CLIENTS = 16
CONFIG = f"""\
version: v1
sharing:
  mps:
    failRequestsGreaterThanOne: false
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


RECOVERY_S = "3"
"""`--health-recovery-seconds`: a GPU whose Xid is over is healthy again after this quiet time."""
PROBE_INTERVAL_S = "1"
"""`--probe-interval-seconds`: a daemon that stops answering is seen within this and a second."""
RECONCILE_S = "10"
"""`--reconcile-grace-seconds`, its least: a deleted pod's device-plugin grants are freed this long after, so that
the next scenario finds its GPUs empty sooner."""


def start(agents: HostAgents, cluster: str) -> AgentProcess:
    agent = agents.start_dra(
        CONFIG,
        cluster,
        "--health-recovery-seconds", RECOVERY_S,
        "--reconcile-grace-seconds", RECONCILE_S,
        "--probe-interval-seconds", PROBE_INTERVAL_S,
    )  # fmt: skip
    # A restarted agent may find its slice as it should be, and write nothing.
    kubectl.wait_for(_listed_slices, 30, "the node's ResourceSlice")
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
    kubectl.wait_for(
        lambda: not any(r["grants"] for r in status()["resources"]),
        float(RECONCILE_S) + UNPREPARE_S,
        "every device-plugin grant to be freed",
    )


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
    assert got["c30"].env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=30720M"
    assert got["c40"].env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M"
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

    # Deleted as a user would: a force-deleted pod frees its claim in the API before the kubelet unprepares it, and
    # the prepare that races it is refused and retried only at the kubelet's next pod sync (1 to 1.5 min).
    pods.delete("c30", "c40", graceful=True)
    wait_unprepared("c30")
    wait_unprepared("c40")
    pods.wait_running("c75", timeout=SCHEDULER_S + 30)  # the capacity freed is the next claim's
    assert claims.allocated_device("c75") == first
    assert pods.report("c75").env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=76800M"
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
    assert device["kind"] == "full"


def test_device_plugin_grants_and_claims_share_one_ledger_daemon_and_client_limit(
    cluster: str, agent: AgentProcess
) -> None:
    # One pod of 14 containers: 14 device-plugin grants (MPS clients, 1 GiB of the 16 GiB GPU each).
    many = pods.manifest("dp14", {GPU_OLD: 1})
    app = many["spec"]["containers"][0]
    many["spec"]["containers"] = [{**app, "name": f"app{i}"} for i in range(OLD_CLIENTS - 2)]
    kubectl.apply(many)
    pods.wait_phase("dp14", "Running")
    claims.create_pod("old-a", {"memory": "512Mi"}, selector=ON_OLD_GPU)
    claims.create_pod("old-b", {"memory": "512Mi"}, selector=ON_OLD_GPU)
    pods.wait_running("old-a")
    pods.wait_running("old-b")
    old = gpu_status(GPU_OLD, 0)
    assert old["liveGrants"] == OLD_CLIENTS
    assert (old["grantMemoryMiB"], old["claimMemoryMiB"]) == (14336, 1024), "one accounting of the GPU"
    assert old["memoryCeilingMiB"] == 1024, "the grants' 1/16 of 16Gi is the largest cap beside the claims' 512Mi"
    kinds = [bool(g.get("claim")) for r in status()["resources"] if r["name"] == GPU_OLD for g in r["grants"]]
    assert sorted(kinds) == [False] * (OLD_CLIENTS - 2) + [True, True], "one ledger holds both routes' grants"

    # Memory left (1 GiB of the slice's 2 GiB), no MPS client left: the slice offered the claims the 2 clients the
    # grants left, the scheduler allocated both, and places no third claim there (it used to, and the prepare
    # refused it).
    clients = kubectl.wait_for(lambda: _device(2)["capacity"].get("clients"), 5, "the slice offering clients")
    assert clients["value"] == "2", clients
    claims.create_pod("one-too-many", {"memory": "256Mi"}, selector=ON_OLD_GPU)
    reason = kubectl.wait_for(
        lambda: claims.unschedulable_reason("one-too-many"), SCHEDULER_S, "the scheduler's reason"
    )
    assert "cannot allocate all claims" in reason, reason
    assert pods.get("one-too-many")["status"].get("phase") == "Pending"
    assert "one-too-many" not in prepared()
    assert gpu_status(GPU_OLD, 0)["liveGrants"] == OLD_CLIENTS


def _on_gpu(index: int) -> str:
    return f'device.attributes["{claims.DRIVER}"].uuid == "{fake_gpu(index)["uuid"]}"'


def _grant_gpu(pod: str) -> int:
    """The ordinal of the GPU the device-plugin grant of `pod` holds."""
    grant = kubectl.wait_for(
        lambda: next((g for g in _grants(GPU_MPS) if (g.get("container") or "").startswith(f"default/{pod}/")), None),
        30,
        f"the grant of {pod} listed",
    )
    return int(grant["share"].split(" of GPU ")[1].split(",")[0].split(" ")[0])


def _grants(resource: str) -> list[dict[str, Any]]:
    return [g for r in status()["resources"] if r["name"] == resource for g in r["grants"]]


def test_a_device_plugin_grant_then_a_claim_never_hold_more_than_the_gpu(cluster: str, agent: AgentProcess) -> None:
    pods.create("dp-half", {GPU_MPS: 2})
    pods.wait_running("dp-half")
    gpu = _grant_gpu("dp-half")
    offered = kubectl.wait_for(lambda: _slice_memory(gpu) == 40 * GIB and _slice_memory(gpu), 5, "the slice to shrink")
    assert offered == 40 * GIB, "the slice offers what the device-plugin grant leaves"

    claims.create_pod("too-big", {"memory": "80Gi"}, selector=_on_gpu(gpu))
    reason = kubectl.wait_for(lambda: claims.unschedulable_reason("too-big"), SCHEDULER_S, "the scheduler's reason")
    assert "claim" in reason.lower(), reason
    claims.create_pod("fits", {"memory": "40Gi"}, selector=_on_gpu(gpu))
    pods.wait_running("fits")
    assert pods.report("fits").env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M"
    held = gpu_status(GPU_MPS, gpu)
    assert held["grantMemoryMiB"] + held["claimMemoryMiB"] == 81920
    assert pods.get("too-big")["status"].get("phase") == "Pending"


def test_claims_then_device_plugin_grants_never_hold_more_than_the_gpus(cluster: str, agent: AgentProcess) -> None:
    for index in (0, 1):
        claims.create_pod(f"big-{index}", {"memory": "70Gi"}, selector=_on_gpu(index))
    for index in (0, 1):
        pods.wait_running(f"big-{index}")
    # 10 GiB left on each GPU, and a replica is 20 GiB: every free replica is withheld from the kubelet.
    kubectl.wait_for(
        lambda: all(gpu_status(GPU_MPS, i).get("withheld") == 4 for i in (0, 1)), 10, "the replicas withheld"
    )
    kubectl.wait_for(lambda: pods.allocatable(cluster, GPU_MPS) == 0, 30, "the node's allocatable to follow")
    pods.create("dp-after", {GPU_MPS: 1})
    reason = kubectl.wait_for(lambda: claims.unschedulable_reason("dp-after"), SCHEDULER_S, "the scheduler's reason")
    assert f"Insufficient {GPU_MPS}" in reason, reason
    for index in (0, 1):
        held = gpu_status(GPU_MPS, index)
        assert held["grantMemoryMiB"] + held["claimMemoryMiB"] <= 81920
    assert "free replicas WITHHELD from the kubelet" in node_status_text(), "--status says why they are not offered"

    pods.delete("big-0", graceful=True)
    wait_unprepared("big-0")
    pods.wait_running("dp-after", timeout=SCHEDULER_S + 30)  # the memory freed is the grant's


def kubelet_version(cluster: str) -> tuple[int, int]:
    """The node's kubelet release (1, 37), from the Node's status (`v1.37.2`)."""
    major, minor = kubectl.get("node", cluster)["status"]["nodeInfo"]["kubeletVersion"].lstrip("v").split(".")[:2]
    return int(major), int(minor)


def health_service_called(cluster: str) -> str:
    """The health service the node's kubelet calls: 1.37 and later take v1 when the registration lists it (and the
    agent lists both), 1.36 knows only v1alpha1."""
    return "v1.DRAResourceHealth" if kubelet_version(cluster) >= (1, 37) else "v1alpha1.DRAResourceHealth"


def test_an_xid_taints_the_device_and_the_claims_pod_shows_it_unhealthy_then_healthy(
    cluster: str, agents: HostAgents, agent: AgentProcess
) -> None:
    """Over the health service version the kubelet chose: v1 on 1.37, v1alpha1 on 1.36 (both served)."""
    service = health_service_called(cluster)
    claims.create_pod("sick", {"memory": "4Gi"}, selector=_on_gpu(0))
    pods.wait_running("sick")
    kubectl.wait_for(lambda: claim_health("sick") == "Healthy", 30, "the device's health in the pod's status")
    assert dra_status().get("healthWatched") == [service], dra_status().get("healthWatched")
    watched = [e.get("service") for e in agent.log_events() if e.get("event") == "device health watched"]
    assert watched and set(watched) == {service}, watched

    agents.driver.emit_xid(fake_gpu(0)["uuid"], 79)
    began = time.monotonic()
    kubectl.wait_for(lambda: _taints(0), 10, "the device tainted")
    tainted_after = time.monotonic() - began
    kubectl.wait_for(lambda: claim_health("sick") == "Unhealthy", 10, "the pod's status to show the device Unhealthy")
    unhealthy_after = time.monotonic() - began
    ((key, effect),) = _taints(0)
    assert (key, effect) == ("mps.mpsagent.io/unhealthy", "NoSchedule")
    print(
        f"Xid 79 (kubelet {'.'.join(map(str, kubelet_version(cluster)))}, health over {service}): device tainted "
        f"after {tainted_after:.2f} s, the pod's status Unhealthy after {unhealthy_after:.2f} s"
    )
    assert tainted_after <= 2.0, tainted_after
    assert unhealthy_after <= 2.0, unhealthy_after

    claims.create_pod("on-sick", {"memory": "1Gi"}, selector=_on_gpu(0))
    reason = kubectl.wait_for(lambda: claims.unschedulable_reason("on-sick"), SCHEDULER_S, "the scheduler's reason")
    assert "taint" in reason.lower() or "claim" in reason.lower(), reason

    # Recovered once the GPU stays quiet (--health-recovery-seconds): untainted, Healthy, and the claim placed.
    kubectl.wait_for(lambda: not _taints(0), 30, "the taint removed")
    kubectl.wait_for(lambda: claim_health("sick") == "Healthy", 30, "the pod's status to show the device Healthy")
    pods.wait_running("on-sick", timeout=SCHEDULER_S + 30)


def test_a_stopped_daemon_taints_its_devices_within_2_s_untainted_within_1_s_of_answering(
    cluster: str, agent: AgentProcess
) -> None:
    claims.create_pod("beside-stopped", {"memory": "4Gi"}, selector=_on_gpu(0))
    pods.wait_running("beside-stopped")
    daemon = int(json.loads((pipe_directory(GPU_MPS).parent / "daemon.json").read_text())["pid"])
    os.kill(daemon, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        kubectl.wait_for(lambda: _taints(0) and _taints(1), 10, "both of its devices tainted")
        tainted_after = time.monotonic() - stopped
        kubectl.wait_for(lambda: claim_health("beside-stopped") == "Unhealthy", 10, "the pod's device Unhealthy")
        logged = agent.log_events()
        time.sleep(0.5)
    finally:
        os.kill(daemon, signal.SIGCONT)
    continued = time.monotonic()
    kubectl.wait_for(lambda: not _taints(0) and not _taints(1), 10, "the taints removed")
    untainted_after = time.monotonic() - continued
    print(f"stopped daemon: tainted after {tainted_after:.2f} s, untainted {untainted_after:.2f} s after SIGCONT")
    assert tainted_after <= 2.0, tainted_after
    assert untainted_after <= 1.0, untainted_after
    assert not _taints(2), "the other resource's daemon answers: its device stays untainted"
    assert any(e.get("event") == "mps daemon does not answer" for e in logged)
    kubectl.wait_for(lambda: claim_health("beside-stopped") == "Healthy", 10, "the pod's device Healthy again")
    assert json.loads((pipe_directory(GPU_MPS).parent / "daemon.json").read_text())["pid"] == daemon


def test_a_pods_hold_on_the_control_socket_is_ended_and_told_on_the_pod(cluster: str, agent: AgentProcess) -> None:
    claims.create_pod("holder", {"memory": "1Gi"}, selector=_on_gpu(0))
    pods.wait_running("holder")
    pod = pods.get("holder")
    (status,) = pod["status"]["containerStatuses"]
    # A process in the pod's container, as the kernel names it (the agent reads the pod and the container from it).
    container_id = status["containerID"].rpartition("://")[2]
    with (
        pod_cgroup(pod_uid=pod["metadata"]["uid"], container_id=container_id) as cgroup,
        silent_connection(pipe_directory(GPU_MPS), pod=cgroup) as held,
    ):
        assert held.stdout is not None and held.stdout.readline().strip() == "ended"
    event = kubectl.wait_for(
        lambda: [e for e in claims.events("holder") if e.startswith("MpsControlSocketHeld:")], 10, "the pod's Event"
    )[0]
    assert f"PID {held.pid}" in event and "the agent ended that connection" in event
    assert any(e.get("event") == "pod event recorded" and e.get("container") == "app" for e in agent.log_events())


def claim_health(pod: str) -> str | None:
    """The health the pod's status shows for its claim's device (KEP-4680: `allocatedResourcesStatus`)."""
    for container in pods.get(pod)["status"].get("containerStatuses", []):
        for entry in container.get("allocatedResourcesStatus") or []:
            if entry.get("name", "").startswith(f"claim:{claims.CLAIM}"):
                for resource in entry.get("resources") or []:
                    return str(resource.get("health"))
    return None


def _node_slice() -> dict[str, Any]:
    listed = kubectl.get("resourceslices", "--field-selector", f"spec.driver={claims.DRIVER}")["items"]
    (found,) = listed
    slice_: dict[str, Any] = found
    return slice_


def _device(index: int) -> dict[str, Any]:
    device: dict[str, Any] = next(d for d in _node_slice()["spec"]["devices"] if d["name"] == f"gpu-{index}")
    return device


def _slice_memory(index: int) -> int:
    value = _device(index)["capacity"]["memory"]["value"]
    return int(value.removesuffix("Mi")) * 1024 * 1024 if value.endswith("Mi") else int(value)


def _taints(index: int) -> list[tuple[str, str]]:
    return [(t["key"], t["effect"]) for t in _device(index).get("taints") or []]


def node_status_text() -> str:
    from mpsagent_testing.cluster.host_agent import status_text  # noqa: PLC0415

    return status_text()


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


IDLE_S = 20.0
"""How long the idle node is watched for slice writes here (bench/dra_slice_quiet.py watches 5 minutes)."""


def test_an_idle_node_writes_no_slice_and_a_deleted_slice_is_back_within_5_s(cluster: str, agent: AgentProcess) -> None:
    name = _node_slice()["metadata"]["name"]
    generation = _node_slice()["spec"]["pool"]["generation"]
    writes = kubectl.api_writes("resourceslices")
    time.sleep(IDLE_S)
    assert kubectl.api_writes("resourceslices") == writes, "an idle node writes no ResourceSlice"

    kubectl.run("delete", "resourceslice", name, "--wait=true")
    began = time.monotonic()
    kubectl.wait_for(lambda: _listed_slices() == [name], 10, "the deleted slice to be back")
    back_after = time.monotonic() - began
    print(f"deleted slice back after {back_after:.2f} s")
    assert back_after <= 5.0, back_after
    assert _node_slice()["spec"]["pool"]["generation"] == generation, "a repair shows the same devices"


ADMIN_RULE = "e2e-gpu-0-maintenance"
ADMIN_TAINT = "example.com/maintenance=planned:NoSchedule"


def _admin_rules() -> list[tuple[str, list[str], str]]:
    """The DeviceTaintRules on the node's devices as --status shows them: (rule, devices, key=value:effect)."""
    return [
        (rule["rule"], rule["devices"], f"{rule['key']}={rule.get('value', '')}:{rule['effect']}")
        for rule in dra_status().get("taintRules", [])
    ]


def test_an_admins_device_taint_rule_keeps_new_claims_off_its_device_and_outlives_the_agents_repairs(
    cluster: str, agent: AgentProcess
) -> None:
    """KEP-5055 as an operator uses it (GA in 1.37): a DeviceTaintRule on gpu-0. The scheduler adds its taint to the
    device (the slice does not carry it), the agent writes nothing for it and shows it in --status, and after the
    agent puts a deleted slice back the rule still keeps new claims off the device."""
    if kubelet_version(cluster) < (1, 37):
        unseen = kubectl.wait_for(lambda: dra_status().get("taintRulesUnseen"), 30, "--status on DeviceTaintRules")
        assert unseen.startswith("the API server serves none"), unseen
        pytest.skip(
            "DeviceTaintRule is resource.k8s.io/v1 from Kubernetes 1.37; a 1.36 node serves none (as --status says)"
        )
    kubectl.wait_for(lambda: dra_status().get("taintRulesUnseen") is None, 30, "the DeviceTaintRules watched")
    name = _node_slice()["metadata"]["name"]
    writes = kubectl.api_writes("resourceslices")
    key_value, effect = ADMIN_TAINT.rsplit(":", 1)
    key, value = key_value.split("=")
    rule = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": ADMIN_RULE},
        "spec": {
            "deviceSelector": {"driver": claims.DRIVER, "pool": cluster, "device": "gpu-0"},
            "taint": {"key": key, "value": value, "effect": effect},
        },
    }
    kubectl.apply(rule)
    try:
        began = time.monotonic()
        expected = [(ADMIN_RULE, ["gpu-0"], ADMIN_TAINT)]
        kubectl.wait_for(lambda: _admin_rules() == expected, 10, "--status to show the rule")
        print(f"DeviceTaintRule in --status after {time.monotonic() - began:.2f} s")

        claims.create_pod("beside-rule", {"memory": "4Gi"}, selector=ON_MPS_GPUS)
        pods.wait_running("beside-rule")
        assert claims.allocated_device("beside-rule") == "gpu-1", "the tainted gpu-0 takes no new claim"
        claims.create_pod("on-ruled", {"memory": "1Gi"}, selector=_on_gpu(0))
        reason = kubectl.wait_for(
            lambda: claims.unschedulable_reason("on-ruled"), SCHEDULER_S, "the scheduler's reason"
        )
        assert "taint" in reason.lower() or "claim" in reason.lower(), reason
        assert not _taints(0), "the slice does not carry the rule's taint: the scheduler adds it"
        assert kubectl.api_writes("resourceslices") == writes, "the agent writes nothing for an administrator's rule"

        kubectl.run("delete", "resourceslice", name, "--wait=true")
        kubectl.wait_for(lambda: _listed_slices() == [name], 10, "the deleted slice to be back")
        time.sleep(3.0)  # the scheduler tries the pending pod again on the slice's return
        assert kubectl.get("devicetaintrule", ADMIN_RULE)["spec"]["deviceSelector"]["device"] == "gpu-0"
        assert claims.unschedulable_reason("on-ruled"), "the rule still keeps the claim off gpu-0"
        assert _admin_rules() == expected
    finally:
        kubectl.run("delete", "devicetaintrule", ADMIN_RULE, "--ignore-not-found")
    pods.wait_running("on-ruled", timeout=SCHEDULER_S + 30)  # the rule, and nothing else, kept it off gpu-0
    assert claims.allocated_device("on-ruled") == "gpu-0"
    kubectl.wait_for(lambda: _admin_rules() == [], 10, "--status without the rule")


def _listed_slices() -> list[str]:
    listed = kubectl.get("resourceslices", "--field-selector", f"spec.driver={claims.DRIVER}")["items"]
    return [item["metadata"]["name"] for item in listed]


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
    # A pod deleted before the restarted kubelet has listed it is an orphan to the kubelet, killed without its claims
    # unprepared; its DRA reconcile loop unprepares them a minute later (measured 60.2 to 60.5 s; 4.3 s once listed).
    kubectl.wait_for(
        lambda: {"default/keep-a", "default/keep-b"} <= node.kubelet_pods(), 30, "the restarted kubelet's pods"
    )
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
        assert device["kind"] == "full"
    finally:
        pods.delete("extended")
        kubectl.run("delete", "-f", str(claims.EXTENDED_RESOURCE_CLASS_FILE), "--ignore-not-found")
