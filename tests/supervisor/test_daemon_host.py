"""The Kubernetes route: the MPS daemon lives in the daemon host's container (`mpsagent --daemon-host`), so that
the agent's container can be killed whole, as a container runtime kills it, while the daemon and its clients
keep running; the next agent adopts the daemon and its caps. The old route (the daemon as the agent's child) is
run through the same scenario to show that it loses the daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpsagent_testing.agents import AgentLauncher, AgentProcess, status
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.kubelet.podresources import FakePodResources, ListedContainer
from mpsagent_testing.mps.daemon import control, daemon_pid, pipe_of, require_real_control
from mpsagent_testing.node import GPU0, RESOURCE, config, ids, small_node, write_config
from mpsagent_testing.processes import alive, kill_container
from mpsagent_testing.repo import ROOT

require_real_control()  # the agents these tests start run the real MPS control daemon

# A CUDA client dies with its daemon (its context fails). The stand-in, in a session of its own as a client pod
# is, waits on the daemon's PID and records the moment it would have died.
CLIENT_STAND_IN = """
import os, select, sys, pathlib
fd = os.pidfd_open(int(sys.argv[1]))
pathlib.Path(sys.argv[2]).write_text("connected")
select.select([fd], [], [])
pathlib.Path(sys.argv[2]).write_text("lost its daemon")
"""


class Node:
    """One node's files and the processes a test starts on it: the agent's container, the daemon host's."""

    def __init__(self, directory: Path, agents: AgentLauncher, kubelet: FakeKubelet) -> None:
        self.directory = directory
        self.agents = agents
        self.kubelet = kubelet
        self.config = write_config(directory / "config.yaml", config())
        self.snapshot = small_node(directory / "node.json")
        self.started: list[subprocess.Popen[bytes]] = []

    def common(self) -> list[str]:
        return [
            "--config-file",
            str(self.config),
            "--node-snapshot",
            str(self.snapshot),
            "--mps-root",
            str(self.directory / "mps"),
        ]

    def start_agent(self, *extra: str) -> AgentProcess:
        return self.agents.start(*self.common(), "--kubelet-socket", str(self.kubelet.socket_path), *extra)

    def start_daemon_host(self, *extra: str) -> AgentProcess:
        log_path = self.directory / f"daemon-host-{len(self.started)}.log"
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "mpsagent", "--daemon-host", "--log-format", "json", *self.common(), *extra],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        self.started.append(process)
        return AgentProcess(process, log_path)

    def start_client(self, pid: int) -> Path:
        mark = self.directory / f"client-{pid}"
        client = subprocess.Popen([sys.executable, "-c", CLIENT_STAND_IN, str(pid), str(mark)], start_new_session=True)
        self.started.append(client)
        wait_for(mark.exists, 10, "the client stand-in connected")
        return mark

    def close(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
            process.wait(10)


@pytest.fixture
def node(short_dir: Path, agents: AgentLauncher, kubelet: FakeKubelet) -> Iterator[Node]:
    started = Node(short_dir, agents, kubelet)
    yield started
    started.close()


def list_grant(pod_resources: FakePodResources, *device_ids: str) -> None:
    pod_resources.set_containers(ListedContainer("default", "train", "main", RESOURCE, tuple(device_ids)))


def test_agent_container_killed_whole_leaves_the_daemon_and_its_client_running(
    node: Node, kubelet: FakeKubelet, pod_resources: FakePodResources, short_dir: Path
) -> None:
    host = node.start_daemon_host()
    host.wait_log("daemon host running")
    # The keeper's first ceilings are the smallest share (1/4 of each 16 GiB GPU), recorded for the agent.
    assert host.wait_log("mps daemon started")["ceilings"] == "threads 25%, memory 0=4096M,1=4096M"
    state = json.loads((short_dir / "mps" / "nvidia.com" / "gpu" / "daemon.json").read_text())
    assert (state["mode"], state["ceilings"]) == ("capped", {"threadPercentage": 25, "memoryMib": [4096, 4096]})
    agent = node.start_agent("--mps-daemon", "host")
    plugin = kubelet.wait_registered(RESOURCE)
    agent.wait_log("mps daemon healthy")
    pid = daemon_pid(short_dir)
    assert agent.wait_log("mps daemon adopted")["pid"] == pid
    allocate(plugin, ids(GPU0, 0))
    list_grant(pod_resources, *ids(GPU0, 0))
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "25.0"
    client = node.start_client(pid)

    killed = kill_container(agent.process.pid)
    assert pid not in killed  # the daemon is not in the agent's container
    agent.process.wait(10)

    again = node.start_agent("--mps-daemon", "host")
    kubelet.wait_registered(RESOURCE, count=2)
    assert again.wait_log("mps daemon adopted")["pid"] == pid
    again.wait_log("mps daemon healthy")
    assert alive(pid) and daemon_pid(short_dir) == pid
    assert client.read_text() == "connected"
    # The listed capped grant keeps the daemon capped under the new agent.
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "25.0"
    assert "mps daemon restarting" not in host.log()


def test_the_old_route_loses_the_daemon_and_its_client_with_the_agents_container(
    node: Node, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = node.start_agent()
    kubelet.wait_registered(RESOURCE)
    pid = daemon_pid(short_dir)
    client = node.start_client(pid)
    assert pid in kill_container(agent.process.pid)
    wait_for(lambda: client.read_text() == "lost its daemon", 10, "the client stand-in to lose its daemon")
    assert not alive(pid)


def test_daemon_host_restarts_a_daemon_that_exits_and_the_agent_adopts_the_new_one(
    node: Node, kubelet: FakeKubelet, short_dir: Path
) -> None:
    host = node.start_daemon_host()
    host.wait_log("daemon host running")
    agent = node.start_agent("--mps-daemon", "host")
    plugin = kubelet.wait_registered(RESOURCE)
    agent.wait_log("mps daemon healthy")
    allocate(plugin, ids(GPU0, 0))
    first = daemon_pid(short_dir)
    os.kill(first, signal.SIGKILL)
    restart = host.wait_log("mps daemon restarting")
    assert "exited" in str(restart["reason"])
    wait_for(lambda: daemon_pid(short_dir) != first, 10, "a new daemon recorded")
    second = daemon_pid(short_dir)
    wait_for(
        lambda: [e for e in agent.log_events() if e.get("event") == "mps daemon adopted" and e["pid"] == second],
        10,
        "the agent to adopt the new daemon",
    )
    # The agent's live capped grant holds the new daemon capped too.
    wait_for(lambda: control(pipe_of(short_dir), "get_default_active_thread_percentage") == "25.0", 10, "caps")


def test_agent_waits_for_the_daemon_host_and_serves_unhealthy_meanwhile(
    node: Node, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = node.start_agent("--mps-daemon", "host")
    plugin = kubelet.wait_registered(RESOURCE)
    agent.wait_log("waiting for the mps daemon host")
    wait_for(lambda: {d[1] for d in plugin.latest()} == {"Unhealthy"}, 5, "replicas Unhealthy")
    host = node.start_daemon_host()
    host.wait_log("daemon host running")
    wait_for(lambda: {d[1] for d in plugin.latest()} == {"Healthy"}, 15, "replicas Healthy once the daemon is up")
    # An agent stop never stops the host's daemon, whatever it was asked.
    pid = daemon_pid(short_dir)
    assert agent.stop() == 0
    assert alive(pid)
    assert "mps daemon left to the daemon host" in agent.log()


def test_one_daemon_owner_per_resource(node: Node, kubelet: FakeKubelet, short_dir: Path) -> None:
    host = node.start_daemon_host()
    host.wait_log("daemon host running")
    owning_agent = node.start_agent()  # --mps-daemon agent would start a daemon of its own
    assert owning_agent.process.wait(20) == 1
    assert f"another mpsagent (PID {host.process.pid}) already runs the MPS daemon of {RESOURCE}" in owning_agent.log()
    second_host = node.start_daemon_host()
    assert second_host.process.wait(20) == 1
    assert f"(PID {host.process.pid}) already runs the MPS daemon" in second_host.log()


def test_daemon_host_quits_its_daemon_on_sigterm(node: Node, short_dir: Path) -> None:
    host = node.start_daemon_host()
    host.wait_log("daemon host running")
    pid = daemon_pid(short_dir)
    host.stop(signal.SIGTERM, timeout=30)
    assert host.process.returncode == 0
    assert not alive(pid)
    assert not (short_dir / "mps" / "nvidia.com" / "gpu" / "daemon.json").exists()
    assert "mps daemon quitting: its clients end with it" in host.log()


def record_of(short_dir: Path) -> Path:
    return short_dir / "mps" / "nvidia.com" / "gpu" / "daemon.json"


DAMAGED_RECORD = '{"pid": 12'  # cut short, as a full disk or a hand edit leaves it


def test_a_running_daemon_host_rewrites_a_damaged_record_and_the_agent_adopts_its_daemon(
    node: Node, kubelet: FakeKubelet, short_dir: Path
) -> None:
    host = node.start_daemon_host()
    host.wait_log("daemon host running")
    pid = daemon_pid(short_dir)
    record_of(short_dir).write_text(DAMAGED_RECORD)
    damaged = host.wait_log("daemon state damaged")
    assert damaged["path"] == str(record_of(short_dir))
    assert "does not decode" in str(damaged["problem"])
    assert host.wait_log("daemon state rewritten")["pid"] == pid
    assert daemon_pid(short_dir) == pid
    agent = node.start_agent("--mps-daemon", "host")
    kubelet.wait_registered(RESOURCE)
    assert agent.wait_log("mps daemon adopted")["pid"] == pid
    assert "mps daemon restarting" not in host.log()


def test_a_damaged_record_is_named_by_the_agent_and_rewritten_by_the_next_daemon_host(
    node: Node, kubelet: FakeKubelet, short_dir: Path
) -> None:
    """The daemon host is gone (its daemon, in a session of its own, is not) and the record is damaged: the agent
    says what is wrong with the file while it waits; the next daemon host finds the daemon by its control socket,
    rewrites the record and keeps the daemon, and the agent adopts it."""
    host = node.start_daemon_host()
    host.wait_log("daemon host running")
    pid = daemon_pid(short_dir)
    host.process.kill()
    host.process.wait(10)
    record_of(short_dir).write_text(DAMAGED_RECORD)
    agent = node.start_agent("--mps-daemon", "host")
    plugin = kubelet.wait_registered(RESOURCE)
    damaged = agent.wait_log("daemon state damaged")
    assert (damaged["level"], damaged["path"]) == ("warning", str(record_of(short_dir)))
    assert "does not decode" in str(damaged["problem"])
    wait_for(lambda: {d[1] for d in plugin.latest()} == {"Unhealthy"}, 5, "replicas Unhealthy")
    wait_for(
        lambda: f"  daemon record {record_of(short_dir)} DAMAGED since " in status(short_dir).stdout,
        10,
        "--status to name the damaged record",
    )
    again = node.start_daemon_host()
    rewritten = again.wait_log("daemon state rewritten")
    assert (rewritten["pid"], rewritten["path"]) == (pid, str(record_of(short_dir)))
    again.wait_log("daemon host running")
    assert again.wait_log("mps daemon adopted")["pid"] == pid
    assert agent.wait_log("mps daemon adopted", timeout=20)["pid"] == pid
    wait_for(lambda: {d[1] for d in plugin.latest()} == {"Healthy"}, 15, "replicas Healthy")
    assert alive(pid) and "mps daemon started" not in again.log()
    assert [e["event"] for e in agent.log_events()].count("daemon state damaged") == 1  # once per episode
    agent.wait_log("daemon state readable again")


def test_a_daemon_host_that_cannot_find_the_daemon_of_a_damaged_record_says_so_in_one_line(
    node: Node, short_dir: Path
) -> None:
    host = node.start_daemon_host()
    host.wait_log("daemon host running")
    host.process.kill()
    host.process.wait(10)
    record_of(short_dir).write_text(DAMAGED_RECORD)
    (short_dir / "no-proc").mkdir()  # a /proc that shows no process: the daemon cannot be found
    again = node.start_daemon_host("--proc-root", str(short_dir / "no-proc"))
    assert again.process.wait(30) == 1
    errors = [line for line in again.log().splitlines() if line.startswith("mpsagent: error:")]
    assert len(errors) == 1, again.log()
    assert f"{record_of(short_dir)} does not decode" in errors[0]
    assert "no process listening on" in errors[0]
    assert "Traceback" not in again.log() and "ExceptionGroup" not in again.log()


def test_quit_on_exit_is_refused_with_a_daemon_host(node: Node) -> None:
    agent = node.start_agent("--mps-daemon", "host", "--mps-on-exit", "quit")
    assert agent.process.wait(20) == 2
    assert "--mps-on-exit quit needs --mps-daemon agent" in agent.log()
