"""Stowaways: a process on a GPU whose pod holds no grant or claim there (a privileged pod with the MPS pipe mounted,
a process on the host) is found from NVML's process list, placed in its pod by its cgroup, named through the
kubelet's container log links, logged once as a warning naming the pod, and shown in `--status` and the metrics
until it ends. The decisions as plain data first, then an agent over the real nvidia-ml-py and the fake NVML, with
real processes in cgroups named like pods' containers and a grpcio stand-in for the kubelet."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from mpsagent.base.devices import ContainerRef, GpuUuid
from mpsagent.domain.claims import ClaimRef, PreparedClaim, PreparedDevice
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.stowaways import GpuUsers, SeenProcess, gpu_users, judge
from mpsagent.kubelet.container_logs import MAX_LINKS, container_names
from mpsagent_testing.agents import AgentLauncher, AgentProcess, serve, status, status_json
from mpsagent_testing.cgroups import PodCgroup, pod_cgroup
from mpsagent_testing.cluster.host_agent import fake_gpu, fake_nvml_config
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.kubelet.podresources import FakePodResources, listed
from mpsagent_testing.metrics import value
from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.node import RESOURCE, config
from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.nvml.control import FakeNvmlDriver

require_real_control()

GPU0, GPU1 = GpuUuid(fake_gpu(0)["uuid"]), GpuUuid(fake_gpu(1)["uuid"])
POD_UID = "0f3c9a52-6c1e-4d8e-9b0a-3d2f1e4c5b6a"
CONTAINER_ID = "ab" * 32
FOUND = "process on a gpu without a grant or claim there"
PROBE_S = 1.0


# --- the decisions -----------------------------------------------------------------------------------------


def seen(
    gpu: GpuUuid = GPU0, *, pod: str | None = "ml/web", pid: int = 100, ancestors: tuple[int, ...] = (1,)
) -> SeenProcess:
    if pod is None:
        return SeenProcess(gpu=gpu, pid=pid, used_bytes=None, ancestors=ancestors)
    namespace, name = pod.split("/")
    return SeenProcess(
        gpu=gpu,
        pid=pid,
        used_bytes=1 << 20,
        ancestors=ancestors,
        pod_uid=POD_UID,
        container_id=CONTAINER_ID,
        container=ContainerRef(namespace=namespace, pod=name, container="main"),
    )


UNNAMED = SeenProcess(gpu=GPU0, pid=7, used_bytes=0, pod_uid=POD_UID, container_id=CONTAINER_ID)


@pytest.mark.parametrize(
    ("process", "users", "names_readable", "verdict"),
    [
        (seen(), {GPU0: GpuUsers(pods=frozenset({"ml/web"}))}, True, "fine"),
        (seen(GPU1), {GPU0: GpuUsers(pods=frozenset({"ml/web"}))}, True, "stowaway"),  # its pod's share is GPU0's
        (seen(pod="ml/other"), {GPU0: GpuUsers(pods=frozenset({"ml/web"}))}, True, "stowaway"),
        (seen(pod="ml/other"), {GPU0: GpuUsers(pods=frozenset({"ml/web"}), unlisted_grants=1)}, True, "undecided"),
        (seen(pod=None), {GPU0: GpuUsers(unlisted_grants=1)}, True, "stowaway"),  # the host's: no grant is its
        (seen(pod=None, ancestors=(55, 1)), {}, True, "server"),  # a child of the agent's daemon (PID 55)
        (seen(pod="ml/other", ancestors=(55, 1)), {}, True, "server"),
        (seen(pod="ml/other"), {}, False, "undecided"),  # no names: no pod can be judged
        (UNNAMED, {}, True, "stowaway"),  # every container the kubelet starts has a link: this one it did not
        (UNNAMED, {GPU0: GpuUsers(pods=frozenset({"ml/web"}))}, True, "stowaway"),
    ],
)
def test_a_process_is_a_stowaway_only_when_its_pod_holds_no_share_of_its_gpu(
    process: SeenProcess, users: dict[GpuUuid, GpuUsers], names_readable: bool, verdict: str
) -> None:
    judged = judge([process], users, daemon_pids=frozenset({55}), names_readable=names_readable)
    found = {
        "stowaway": judged.stowaways,
        "undecided": judged.undecided,
        "server": judged.servers,
    }
    assert {name for name, processes in found.items() if processes} == ({verdict} if verdict != "fine" else set())


def test_who_may_use_a_gpu_comes_from_the_listed_grants_and_the_claims_pods() -> None:
    def claim(uid: str, gpu: str, *pods: str) -> PreparedClaim:
        device = PreparedDevice(
            request="gpu", pool="n", device="gpu-0", share_id=None, cdi_device_ids=(), resource=RESOURCE, gpu=gpu,
            memory_mib=1024, thread_percentage=10, kind=GrantKind.CAPPED,
        )  # fmt: skip
        return PreparedClaim(claim=ClaimRef(namespace="ml", name=uid, uid=uid), devices=(device,), pods=pods)

    users = gpu_users([], [claim("c1", GPU0, "ml/a", "ml/b"), claim("c2", GPU1, "ml/c")])
    assert users[GpuUuid(GPU0)] == GpuUsers(pods=frozenset({"ml/a", "ml/b"}), claims=frozenset({"c1"}))
    assert users[GpuUuid(GPU1)].pods == frozenset({"ml/c"})


# --- the kubelet's container names --------------------------------------------------------------------------


def link(directory: Path, name: str, target: str) -> None:
    (directory / name).symlink_to(target)


def test_container_names_come_from_the_kubelets_log_links_whatever_their_names_were_cut_to(tmp_path: Path) -> None:
    other = "cd" * 32
    link(tmp_path, f"web-0_ml_main-{CONTAINER_ID}.log", f"/var/log/pods/ml_web-0_{POD_UID}/main/0.log")
    # The kubelet cuts a name past 255 bytes: the target has the whole names.
    link(tmp_path, f"a-very-long-po_ml_side-{other}.log", f"/var/log/pods/ml_a-very-long-pod.name_{POD_UID}/side/3.log")
    link(tmp_path, f"x_y_z-{'ef' * 32}.log", "/elsewhere/0.log")  # not the kubelet's: skipped
    (tmp_path / f"x_y_z-{'01' * 32}.log").write_text("")  # a plain file: skipped
    names = container_names(tmp_path)
    assert {key: (value.pod_uid, str(value.ref)) for key, value in names.items()} == {
        CONTAINER_ID: (POD_UID, "ml/web-0/main"),
        other: (POD_UID, "ml/a-very-long-pod.name/side"),
    }
    with pytest.raises(OSError):
        container_names(tmp_path / "missing")


def test_container_names_are_read_from_a_bounded_number_of_entries(tmp_path: Path) -> None:
    for index in range(MAX_LINKS + 10):
        (tmp_path / f"{index}").touch()
    assert container_names(tmp_path) == {}


# --- the agent ----------------------------------------------------------------------------------------------


class Node:
    """The fake NVML of a two-GPU node, the kubelet's container log links, and processes in pods' cgroups."""

    def __init__(self, directory: Path, library: Path) -> None:
        self.config = directory / "nvml.json"
        self.config.write_text(fake_nvml_config([fake_gpu(0), fake_gpu(1)]))
        self.driver = FakeNvmlDriver(directory / "nvml-state.json")
        self.library = library
        self.links = directory / "containers"
        self.links.mkdir()
        self._stack = ExitStack()

    def env(self) -> dict[str, str]:
        return fake_nvml_env(self.library, self.config, self.driver.state_path)

    def container(self, namespace: str, pod: str, name: str = "main") -> tuple[PodCgroup, subprocess.Popen[bytes]]:
        """A process in a cgroup named like a pod's container, which the kubelet's link names."""
        cgroup = self._stack.enter_context(pod_cgroup())
        process = subprocess.Popen(cgroup.command("sleep", "600"))
        self._stack.callback(process.wait, 10)
        self._stack.callback(process.kill)
        wait_for(lambda: str(process.pid) in (cgroup.path / "cgroup.procs").read_text(), 5, "it in its cgroup")
        target = f"/var/log/pods/{namespace}_{pod}_{cgroup.pod_uid}/{name}/0.log"
        link(self.links, f"{pod}_{namespace}_{name}-{cgroup.container_id}.log", target)
        return cgroup, process

    def host_process(self) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(["sleep", "600"])
        self._stack.callback(process.wait, 10)
        self._stack.callback(process.kill)
        return process

    def close(self) -> None:
        self._stack.close()


@pytest.fixture
def node(short_dir: Path, fake_nvml_library: Path) -> Iterator[Node]:
    made = Node(short_dir, fake_nvml_library)
    yield made
    made.close()


def start_agent(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node) -> tuple[AgentProcess, str]:
    agent, base = serve(
        agents, kubelet, short_dir,
        "--probe-interval-seconds", str(PROBE_S),
        "--container-logs-dir", str(node.links),
        "--cdi-hook", "",
        text=config(), env=node.env(), nvml=True,
    )  # fmt: skip
    kubelet.wait_registered(RESOURCE)
    agent.wait_log("mps daemon healthy")
    return agent, base


def found_events(agent: AgentProcess) -> list[dict[str, object]]:
    return [e for e in agent.log_events() if e.get("event") == FOUND]


def test_a_pod_without_a_share_of_the_gpu_is_reported_within_one_probe_interval_with_its_name(
    agents: AgentLauncher, kubelet: FakeKubelet, pod_resources: FakePodResources, short_dir: Path, node: Node
) -> None:
    agent, base = start_agent(agents, kubelet, short_dir, node)
    # A pod holding a grant of GPU0, as the kubelet lists it, and a pod holding nothing.
    allocate(kubelet.plugins[0], [f"{GPU0}::1"])
    pod_resources.set_containers(listed("granted", [f"{GPU0}::1"]))
    _, granted = node.container("ml", "granted")
    _, stowaway = node.container("ml", "sneaky", "cuda")
    wait_for(
        lambda: any(g.get("container") for g in status_json(short_dir)["resources"][0]["grants"]), 10, "grant listed"
    )
    put = time.monotonic()
    node.driver.set_processes(GPU0, [(granted.pid, 1 << 30), (stowaway.pid, 2 << 30)], mps=True)
    (event,) = wait_for(lambda: found_events(agent), 10, "the stowaway reported")
    waited = time.monotonic() - put
    print(f"stowaway reported {waited:.2f} s after it appeared (probe interval {PROBE_S:g} s)")
    assert waited <= PROBE_S + 0.5
    assert (event["level"], event["gpu"], event["pid"]) == ("warning", GPU0, stowaway.pid)
    assert (event["pod"], event["container"]) == ("ml/sneaky", "cuda")
    # Once: the next looks find it again and say nothing more.
    time.sleep(2 * PROBE_S)
    assert len(found_events(agent)) == 1
    (shown,) = status_json(short_dir)["stowaways"]["stowaways"]
    assert (shown["namespace"], shown["pod"], shown["usedBytes"]) == ("ml", "sneaky", 2 << 30)
    text = status(short_dir).stdout
    assert f"PID {stowaway.pid} in pod ml/sneaky (container cuda) on {GPU0}, using 2048 MiB" in text
    labels = {"gpu": GPU0, "pod_namespace": "ml", "pod_name": "sneaky"}
    assert value(base, "mpsagent_stowaway_processes", pod_uid=shown["podUid"], **labels) == 1
    assert value(base, "mpsagent_stowaways_found_total") == 1
    # The granted pod on the GPU it holds nothing of is one too; the stowaway that ended is gone.
    node.driver.set_processes(GPU0, [], mps=True)
    node.driver.set_processes(GPU1, [(granted.pid, 1 << 30)], mps=True)
    wait_for(lambda: len(found_events(agent)) == 2, 10, "the granted pod's process on the other GPU")
    wait_for(lambda: [s["gpu"] for s in status_json(short_dir)["stowaways"]["stowaways"]] == [GPU1], 5, "status")


def test_a_process_on_the_host_is_reported(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node
) -> None:
    """(A child of the agent's daemon, an MPS server, is not: the decision's table above; the daemon runs no server
    without a GPU.)"""
    agent, _ = start_agent(agents, kubelet, short_dir, node)
    host = node.host_process()
    node.driver.set_processes(GPU1, [(host.pid, None)])
    (event,) = wait_for(lambda: found_events(agent), 10, "the host's process reported")
    assert event["pid"] == host.pid and event["process"] == f"PID {host.pid}, a process on the host"
    assert event["pod"] is None


def test_without_the_kubelets_names_processes_in_pods_are_not_judged_and_the_status_says_why(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node
) -> None:
    _, stowaway = node.container("ml", "sneaky")
    node.links.rename(node.links.with_name("moved"))
    agent, base = start_agent(agents, kubelet, short_dir, node)
    # Said at once, before any process runs on a GPU.
    unchecked = agent.wait_log("processes in pods on the gpus not judged: the kubelet's container names cannot be read")
    assert str(node.links) in str(unchecked["reason"])
    wait_for(lambda: value(base, "mpsagent_stowaways_unchecked") == 1, 5, "the metric")
    node.driver.set_processes(GPU0, [(stowaway.pid, 1 << 20)], mps=True)
    time.sleep(2 * PROBE_S)
    assert "processes in pods NOT judged" in status(short_dir).stdout
    assert not found_events(agent)
