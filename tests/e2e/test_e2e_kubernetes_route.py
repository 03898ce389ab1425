"""The Kubernetes route on a real node: both DaemonSets of `packaging/kubernetes` (through a test overlay that only
adds the fake NVML library, the image and the loopback network), run by the real DaemonSet controller, scheduler,
kubelet and containerd from the project's venv image; then the agent's pod deleted, a rolling update of the agent,
and the daemon host's pod deleted, each as docs/operations.md says."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpsagent_testing.cgroups import pod_cgroup
from mpsagent_testing.cluster import kubectl, pods
from mpsagent_testing.cluster.kube_route import (
    AGENT_DS,
    DAEMON_DS,
    MPS_ROOT,
    NAMESPACE,
    daemon_pid,
    daemonset_ready,
    e2e_overlay,
    import_image,
    logs,
    pod_of,
    prepared_node,
)
from mpsagent_testing.mps.daemon import require_real_control, silent_connection

require_real_control()

GPU = "nvidia.com/gpu"
READY_S = 120.0
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def deployed(cluster: str, venv_image: str) -> Iterator[Path]:
    """`kubectl apply -k` of the test overlay, both DaemonSets Ready and the replicas allocatable."""
    import_image(venv_image)
    with prepared_node(cluster) as fake:
        overlay = e2e_overlay(fake, venv_image)
        try:
            kubectl.run("apply", "-k", str(overlay), timeout=120)
            kubectl.wait_for(lambda: daemonset_ready(DAEMON_DS) and daemonset_ready(AGENT_DS), READY_S,
                             "both DaemonSets to be Ready")  # fmt: skip
            kubectl.wait_for(lambda: pods.allocatable(cluster, GPU) == 8, 60, f"{GPU} allocatable to be 8")
            yield overlay
        finally:
            pods.delete_all()
            kubectl.run("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=120s", check=False, timeout=150)
            shutil.rmtree(overlay, ignore_errors=True)


def test_the_agent_registers_from_its_container_and_a_pod_gets_its_share(cluster: str, deployed: Path) -> None:
    assert "registered with kubelet" in logs(AGENT_DS)
    assert "mps daemon started" in logs(DAEMON_DS)
    pods.create("workload", {GPU: 1})
    pods.wait_running("workload")
    seen = pods.report("workload")
    assert seen.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert seen.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert "control" in seen.pipe
    assert "/dev/shm" in seen.mounts


def _container_id(name: str) -> str:
    (container,) = pods.get(name)["status"]["containerStatuses"]
    assert container["restartCount"] == 0
    return str(container["containerID"])


def _agent_replaced(old_uid: str) -> bool:
    pod = pod_of(AGENT_DS)
    return pod is not None and pod["metadata"]["uid"] != old_uid and daemonset_ready(AGENT_DS)


def test_the_agents_pod_deleted_keeps_the_daemon_and_the_workload(cluster: str, deployed: Path) -> None:
    pods.create("survivor", {GPU: 1})
    pods.wait_running("survivor")
    workload, daemon = _container_id("survivor"), daemon_pid()
    old = pod_of(AGENT_DS)
    assert old is not None and daemon is not None
    kubectl.run("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=false")
    kubectl.wait_for(lambda: _agent_replaced(old["metadata"]["uid"]), READY_S, "a new agent pod to be Ready")
    assert daemon_pid() == daemon
    assert _container_id("survivor") == workload
    kubectl.wait_for(lambda: "mps daemon adopted" in logs(AGENT_DS), 30, "the new agent to adopt the daemon")
    pods.create("after-replace", {GPU: 2})
    pods.wait_running("after-replace")
    assert pods.report("after-replace").env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_a_rolling_update_of_the_agent_keeps_the_daemon_and_the_workload(cluster: str, deployed: Path) -> None:
    pods.create("through-update", {GPU: 1})
    pods.wait_running("through-update")
    workload, daemon = _container_id("through-update"), daemon_pid()
    old = pod_of(AGENT_DS)
    assert old is not None
    kubectl.run("rollout", "restart", f"daemonset/{AGENT_DS}", "-n", NAMESPACE)
    # How long the node offers fewer replicas than it has: from the old agent's stop until the new one registered
    # and the kubelet reported it (docs/operations.md quotes this).
    started, short_since, short_s = time.monotonic(), None, 0.0
    while not (_agent_replaced(old["metadata"]["uid"]) and pods.allocatable(cluster, GPU) == 8):
        assert time.monotonic() - started < READY_S, "the update did not end with every replica allocatable"
        count, now = pods.allocatable(cluster, GPU), time.monotonic()
        if count < 8 and short_since is None:
            short_since = now
        elif count == 8 and short_since is not None:
            short_s, short_since = short_s + now - short_since, None
        time.sleep(0.1)
    if short_since is not None:
        short_s += time.monotonic() - short_since
    print(f"rolling update: {GPU} allocatable below 8 for {short_s:.1f} s")
    assert short_s < 30
    assert daemon_pid() == daemon
    assert _container_id("through-update") == workload


def test_the_agent_in_its_pod_ends_a_pods_hold_on_the_daemon_hosts_control_socket(cluster: str, deployed: Path) -> None:
    """The chart's hostPID and SYS_PTRACE let the agent see into the daemon host's daemon (another pod, other
    capabilities): a connection that sends nothing, from a process in a pod's cgroup, is ended; the daemon kept."""
    daemon = daemon_pid()
    assert daemon is not None
    pipe = MPS_ROOT / "nvidia.com" / "gpu" / "pipe"
    with pod_cgroup() as pod, silent_connection(pipe, pod=pod) as holder:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ended", "the agent did not end the pod's connection"
    ended = [line for line in logs(AGENT_DS).splitlines() if "its connection is ended" in line]
    assert ended and pod.pod_uid in ended[-1] and f'"holder_pid": {holder.pid}' in ended[-1]
    assert "cannot be seen" not in logs(AGENT_DS)
    assert daemon_pid() == daemon and "mps daemon restarting" not in logs(DAEMON_DS)


def test_the_daemon_hosts_pod_deleted_starts_a_new_daemon_that_the_agent_adopts(cluster: str, deployed: Path) -> None:
    daemon = daemon_pid()
    old = pod_of(DAEMON_DS)
    assert old is not None and daemon is not None
    adopted_before = logs(AGENT_DS).count("mps daemon adopted")
    kubectl.run("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=true", timeout=90)

    def replaced() -> bool:
        pod = pod_of(DAEMON_DS)
        return pod is not None and pod["metadata"]["uid"] != old["metadata"]["uid"] and daemonset_ready(DAEMON_DS)

    kubectl.wait_for(replaced, READY_S, "a new daemon host pod to be Ready")
    kubectl.wait_for(lambda: (pid := daemon_pid()) is not None and pid != daemon, 60, "a new MPS daemon")
    # The agent may adopt the new daemon before this looks: count from before the deletion.
    kubectl.wait_for(lambda: logs(AGENT_DS).count("mps daemon adopted") > adopted_before, 60,
                     "the agent to adopt the new daemon")  # fmt: skip
    assert "waiting for the mps daemon host" in logs(AGENT_DS)
    kubectl.wait_for(lambda: pods.allocatable(cluster, GPU) == 8, 60, "the replicas to be back")
    pods.create("after-daemon", {GPU: 1})
    pods.wait_running("after-daemon")
