"""The host route on a real node: the agent as a host process (as the systemd unit runs it), the real kubelet,
scheduler and containerd, GPUs from the fake NVML library and the real `nvidia-cuda-mps-control`. The scenarios
run in order on one node and one agent (a later one restarts it); each deletes the pods it made."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from mpsagent_testing.agents import AgentProcess
from mpsagent_testing.cluster import kubectl, node, pods
from mpsagent_testing.cluster.host_agent import HostAgents, fake_gpu, grants, pipe_directory, status, status_text
from mpsagent_testing.cluster.layout import POD_RESOURCES_SOCKET
from mpsagent_testing.kubelet.stubs import pr_grpc, pr_pb2
from mpsagent_testing.mps.daemon import control, require_real_control
from mpsagent_testing.processes import busy_cpus

require_real_control()

GPU = "nvidia.com/gpu"
GPU_MEM = "nvidia.com/gpu-mem"
GRACE_S = 10
CONFIG = f"""\
version: v1
sharing:
  mps:
    failRequestsGreaterThanOne: {{fail}}
    resources:
    - name: {GPU}
      replicas: 4
      devices: [0, 1]
    - name: {GPU_MEM}
      memoryUnit: 2Gi
      devices: [2]
"""
"""Three fake 16 GiB GPUs: two of four replicas each, one of eight 2 GiB memory units."""
RELEASE_S = 1.5 * GRACE_S + 10
"""A grant no listing names is released within 1.5 grace periods (seen gone within 0.4 of one, released by the
lookup due at the end of its grace period), and the test's own polling on top."""
POD_DELETE_S = 60.0
"""A pod's deletion reaches the kubelet and its containers are stopped (busybox ends at SIGTERM)."""
ALLOCATABLE_S = 30.0
"""Registration reaches node allocatable at the kubelet's next status update (2 s on this node)."""


@pytest.fixture(scope="module")
def agents(cluster: str) -> Iterator[HostAgents]:
    directory = Path(tempfile.mkdtemp(prefix="mpa-e2e-", dir="/tmp"))
    launcher = HostAgents(directory, [fake_gpu(0), fake_gpu(1), fake_gpu(2)])
    yield launcher
    pods.delete_all()
    launcher.close()
    shutil.rmtree(directory, ignore_errors=True)


def start(agents: HostAgents, fail: bool = False) -> AgentProcess:
    agent = agents.start(CONFIG.format(fail=str(fail).lower()), "--reconcile-grace-seconds", str(GRACE_S))
    agent.wait_log("registered with kubelet", timeout=30)
    return agent


@pytest.fixture(scope="module")
def agent(agents: HostAgents) -> AgentProcess:
    return start(agents)


@pytest.fixture(autouse=True)
def _clean_pods(cluster: str) -> Iterator[None]:
    yield
    pods.delete_all()


def wait_allocatable(node_name: str, resource: str, count: int) -> None:
    kubectl.wait_for(lambda: pods.allocatable(node_name, resource) == count, ALLOCATABLE_S,
                     f"{resource} allocatable to be {count}")  # fmt: skip


def grant_of(container: str, resource: str = GPU) -> dict[str, Any]:
    """The agent's grant held by `namespace/pod/container`, once `--status` names it."""
    return kubectl.wait_for(
        lambda: next((g for g in grants(resource) if g.get("container") == container), None),
        10,
        f"--status to name {container}",
    )


def released(agent: AgentProcess, container: str) -> bool:
    """Whether the agent logged the release of `container`'s grant."""
    return any(
        e.get("event") == "grant released: its container is gone" and e.get("container") == container
        for e in agent.log_events()
    )


def ceilings(resource: str, ordinals: int) -> tuple[str, list[str]]:
    """The daemon's default ceilings read back through the real control front-end: threads and memory per ordinal."""
    pipe = pipe_directory(resource)
    threads = control(pipe, "get_default_active_thread_percentage")
    memory = [control(pipe, f"get_default_device_pinned_mem_limit {o}") for o in range(ordinals)]
    return threads, memory


def test_node_allocatable_shows_every_replica(cluster: str, agent: AgentProcess) -> None:
    wait_allocatable(cluster, GPU, 8)
    wait_allocatable(cluster, GPU_MEM, 8)


def test_one_replica_gets_a_quarter_with_the_pipe_and_shm_mounted(cluster: str, agent: AgentProcess) -> None:
    wait_allocatable(cluster, GPU, 8)
    pods.create("one", {GPU: 1})
    pods.wait_running("one")
    seen = pods.report("one")
    assert seen.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert seen.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert seen.env["CUDA_MPS_PIPE_DIRECTORY"] == f"/mps/{GPU}/pipe"
    assert f"/mps/{GPU}/pipe" in seen.mounts
    assert "/dev/shm" in seen.mounts
    assert "control" in seen.pipe, f"the daemon's control socket is not in the container's pipe dir: {seen.pipe}"
    grant = grant_of("default/one/app")
    (held,) = {device.split("::")[0] for device in grant["deviceIds"]}
    assert seen.env["NVIDIA_VISIBLE_DEVICES"] == held
    ordinal = [fake_gpu(i)["uuid"] for i in range(2)].index(held)
    threads, memory = ceilings(GPU, 2)
    assert threads == "25.0"
    assert memory[ordinal] == "4G" and memory[1 - ordinal] == "16G"  # 4096M


def test_a_whole_gpu_request_gets_one_gpu_uncapped(cluster: str, agent: AgentProcess) -> None:
    wait_allocatable(cluster, GPU, 8)
    pods.create("whole", {GPU: 4})
    pods.wait_running("whole")
    seen = pods.report("whole")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in seen.env
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in seen.env
    grant = grant_of("default/whole/app")
    held = {device.split("::")[0] for device in grant["deviceIds"]}
    assert len(held) == 1, f"the kubelet's GetPreferredAllocation should keep 4 replicas on one GPU: {grant}"
    assert seen.env["NVIDIA_VISIBLE_DEVICES"] == held.pop()
    assert grant["kind"] == "full"


def test_two_of_four_get_half(cluster: str, agent: AgentProcess) -> None:
    wait_allocatable(cluster, GPU, 8)
    pods.create("half", {GPU: 2})
    pods.wait_running("half")
    seen = pods.report("half")
    assert seen.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert seen.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    threads, _ = ceilings(GPU, 2)
    assert threads == "50.0"


def test_memory_units_are_capped_at_their_memory(cluster: str, agent: AgentProcess) -> None:
    wait_allocatable(cluster, GPU_MEM, 8)
    pods.create("units", {GPU_MEM: 3})
    pods.wait_running("units")
    seen = pods.report("units")
    assert seen.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"  # exactly 3 units of 2 GiB
    assert seen.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "37"
    assert seen.env["CUDA_MPS_PIPE_DIRECTORY"] == f"/mps/{GPU_MEM}/pipe"
    threads, memory = ceilings(GPU_MEM, 1)
    assert (threads, memory) == ("37.0", ["6G"])


def test_a_pod_over_capacity_is_refused_with_the_reason(cluster: str, agent: AgentProcess) -> None:
    wait_allocatable(cluster, GPU, 8)
    # Through the scheduler: Pending, with the scheduler's reason.
    pods.create("too-big", {GPU: 9})
    message = kubectl.wait_for(
        lambda: next((c.get("message") for c in pods.get("too-big")["status"].get("conditions", [])
                      if c.get("reason") == "Unschedulable"), None),
        30, "the scheduler's reason",
    )  # fmt: skip
    assert f"Insufficient {GPU}" in message
    assert pods.get("too-big")["status"]["phase"] == "Pending"
    # Past the scheduler (spec.nodeName): the kubelet refuses it at admission.
    pods.create("too-big-bound", {GPU: 9}, node_name=cluster)
    failed = pods.wait_phase("too-big-bound", "Failed")
    assert failed["status"]["reason"] == "UnexpectedAdmissionError"
    refusal = f"requested number of devices unavailable for {GPU}. Requested: 9, Available: 8"
    assert refusal in failed["status"]["message"]


def listed_at_pod_resources(container: str) -> bool:
    """Whether the node's kubelet lists `namespace/pod/container` with a device in its pod-resources API."""
    with grpc.insecure_channel(f"unix://{POD_RESOURCES_SOCKET}") as channel:
        answer = pr_grpc.PodResourcesListerStub(channel).List(pr_pb2.ListPodResourcesRequest(), timeout=5)
    return any(
        f"{pod.namespace}/{pod.name}/{listed.name}" == container and listed.devices
        for pod in answer.pod_resources
        for listed in pod.containers
    )


def test_a_deleted_pods_grant_is_released_within_one_and_a_half_grace_periods_on_a_busy_node(
    cluster: str, agent: AgentProcess
) -> None:
    """The docs' promise with every CPU of the node kept busy: timed from the moment the kubelet's pod-resources
    stops listing the container (the test asks every 0.1 s) to the release's own log time; then the ceilings are
    back to the whole GPU."""
    wait_allocatable(cluster, GPU, 8)
    # The earlier scenarios' pods are gone; their grants end within 1.5 grace periods too.
    kubectl.wait_for(lambda: not grants(GPU), RELEASE_S, "the earlier scenarios' grants to be released")
    container = "default/leaving/app"
    pods.create("leaving", {GPU: 2})
    pods.wait_running("leaving")
    grant_of(container)
    assert ceilings(GPU, 2)[0] == "50.0"
    with busy_cpus():
        pods.delete("leaving", wait=False)
        dropped_at = kubectl.wait_for(
            lambda: None if listed_at_pod_resources(container) else time.time(),
            POD_DELETE_S,
            "pod-resources to drop the container",
        )
        kubectl.wait_for(lambda: released(agent, container), RELEASE_S, "the grant to be released")
    (event,) = [
        e for e in agent.log_events()
        if e.get("event") == "grant released: its container is gone" and e.get("container") == container
    ]  # fmt: skip
    after_s = datetime.fromisoformat(str(event["timestamp"])).timestamp() - dropped_at
    assert after_s <= 1.5 * GRACE_S, f"released {after_s:.2f} s after pod-resources dropped the container"
    kubectl.wait_for(lambda: not grants(GPU), 5, "the grant to leave --status")
    assert ceilings(GPU, 2) == ("100.0", ["16G", "16G"])


def test_a_kubelet_restart_keeps_running_pods_and_their_grants(cluster: str, agent: AgentProcess) -> None:
    wait_allocatable(cluster, GPU, 8)
    pods.create("steady", {GPU: 1})
    before = pods.wait_running("steady")
    grant = grant_of("default/steady/app")
    registrations = sum(1 for e in agent.log_events() if e.get("event") == "registered with kubelet")
    node.restart_kubelet()
    kubectl.wait_for(
        lambda: sum(1 for e in agent.log_events() if e.get("event") == "registered with kubelet") > registrations,
        30, "the agent to register with the new kubelet",
    )  # fmt: skip
    wait_allocatable(cluster, GPU, 8)
    # Past the empty pod-resources window after the restart and a whole lookup period after it.
    kubectl.wait_for(lambda: status()["podResources"]["answers"] > 0 and pods.get("steady")["status"]["phase"], 10,
                     "pod-resources answers")  # fmt: skip
    after = pods.wait_running("steady")
    (was,), (now,) = before["status"]["containerStatuses"], after["status"]["containerStatuses"]
    assert (now["containerID"], now["restartCount"]) == (was["containerID"], 0)
    assert grant["id"] in [g["id"] for g in grants(GPU)]
    assert not released(agent, "default/steady/app")
    # A new pod is admitted, with replicas other than the running pod's.
    pods.create("after-restart", {GPU: 1})
    pods.wait_running("after-restart")
    assert not set(grant_of("default/after-restart/app")["deviceIds"]) & set(grant["deviceIds"])


def test_a_killed_agent_is_replaced_and_the_new_one_adopts_the_grants(
    cluster: str, agents: HostAgents, agent: AgentProcess
) -> None:
    wait_allocatable(cluster, GPU, 8)
    pods.create("kept-a", {GPU: 1})
    pods.create("kept-b", {GPU_MEM: 2})
    pods.wait_running("kept-a")
    pods.wait_running("kept-b")
    grant_of("default/kept-a/app")
    daemon_pids = {entry["name"]: entry["daemon"]["pid"] for entry in status()["resources"]}
    agent.stop(signal.SIGKILL)
    again = start(agents)
    try:
        adopted = grant_of("default/kept-a/app")
        assert adopted["adopted"] is True
        assert grant_of("default/kept-b/app", GPU_MEM)["adopted"] is True
        assert {entry["name"]: entry["daemon"]["pid"] for entry in status()["resources"]} == daemon_pids
        assert ceilings(GPU, 2)[0] == "25.0"
        pods.create("after-kill", {GPU: 2})
        pods.wait_running("after-kill")
        assert pods.report("after-kill").env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        # The status names a new grant's container once the kubelet lists it (within 3 s: docs/operations.md).
        kubectl.wait_for(
            lambda: all(f"default/{pod}/app" in status_text() for pod in ("kept-a", "kept-b", "after-kill")),
            3,
            "the status to name every pod",
        )
    finally:
        again.stop()  # the next scenarios start agents of their own


def test_an_xid_withdraws_the_gpu_and_the_holding_pod_shows_it(cluster: str, agents: HostAgents) -> None:
    agent = start(agents)
    wait_allocatable(cluster, GPU, 8)
    pods.create("on-sick-gpu", {GPU: 4})
    pods.wait_running("on-sick-gpu")
    (held,) = {device.split("::")[0] for device in grant_of("default/on-sick-gpu/app")["deviceIds"]}
    agents.driver.emit_xid(held, 79)
    agent.wait_log("gpu unhealthy; its replicas are withdrawn")
    wait_allocatable(cluster, GPU, 4)

    def unhealthy() -> list[dict[str, Any]] | None:
        statuses = pods.get("on-sick-gpu")["status"]["containerStatuses"][0].get("allocatedResourcesStatus") or []
        found = [r for s in statuses for r in s.get("resources", []) if r.get("health") == "Unhealthy"]
        return found or None

    assert len(kubectl.wait_for(unhealthy, 30, "allocatedResourcesStatus to show the GPU Unhealthy")) == 4
    agent.stop()


def test_fail_requests_greater_than_one_refuses_with_the_key_named(cluster: str, agents: HostAgents) -> None:
    agent = start(agents, fail=True)
    wait_allocatable(cluster, GPU, 8)
    pods.create("two", {GPU: 2})
    failed = pods.wait_phase("two", "Failed")
    assert failed["status"]["reason"] == "UnexpectedAdmissionError"
    assert "sharing.mps.failRequestsGreaterThanOne" in failed["status"]["message"]
    assert GPU in failed["status"]["message"]
    pods.create("one-allowed", {GPU: 1})
    pods.wait_running("one-allowed")
    agent.stop()
