"""A hung control daemon is noticed whatever the RPC load: through the real `nvidia-cuda-mps-control`. The daemon
greets every connection to its control socket; a stopped one (SIGSTOP) does not."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import anyio
import grpc
import pytest

from mpsagent.mps.liveness import (
    GREETING_TIMEOUT_S,
    HUNG_AFTER_MISSES,
    Liveness,
    greeting,
    hung_bound_s,
    hung_reason,
)
from mpsagent.settings import DEFAULT_PROBE_INTERVAL_S
from mpsagent_testing.agents import AgentLauncher, AgentProcess, start
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.kubelet.stubs import dp_pb2
from mpsagent_testing.mps.daemon import control, daemon_pid, pipe_of, plain_daemon, require_real_control
from mpsagent_testing.node import GPU0, GPU1, RESOURCE, config, ids, small_node, write_config
from mpsagent_testing.processes import alive
from mpsagent_testing.repo import ROOT

require_real_control()

HUNG = "mps daemon does not answer"
PROBE_INTERVAL_S = 1.0
SLACK_S = 3.0  # for a loaded 2-core machine


def events(agent: AgentProcess, name: str) -> list[dict[str, object]]:
    return [e for e in agent.log_events() if e.get("event") == name]


def timestamp(event: dict[str, object]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """PIDs a test stops (SIGSTOP); continued afterwards, so that the clean-up's kill is not left waiting."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)


# --- the liveness check, against a daemon of the test's own --------------------------------


def test_a_running_daemon_greets_and_a_stopped_or_gone_one_does_not(short_dir: Path, stopped: list[int]) -> None:
    with plain_daemon(short_dir) as (pipe, daemon):

        async def while_running() -> None:
            assert await greeting(pipe, 1) is Liveness.ANSWERS
            assert await hung_reason(pipe, daemon.pid, timeout_s=1) is None
            os.kill(daemon.pid, signal.SIGSTOP)
            stopped.append(daemon.pid)
            began = time.monotonic()
            assert await greeting(pipe, 0.5) is Liveness.SILENT
            reason = await hung_reason(pipe, daemon.pid, timeout_s=0.5)
            assert reason is not None and "did not greet a connection to" in reason
            assert 1.0 <= time.monotonic() - began < 1.0 + SLACK_S  # two misses in a row, the second asked at once
            os.kill(daemon.pid, signal.SIGCONT)
            assert await greeting(pipe, 1) is Liveness.ANSWERS
            # Root's front-end falls back to the clients' socket and back: out of reach only without both.
            (pipe / "control").unlink()
            assert await greeting(pipe, 1) is Liveness.ANSWERS
            (pipe / "control_privileged").unlink()
            assert await greeting(pipe, 1) is Liveness.REFUSED
            reason = await hung_reason(pipe, daemon.pid, timeout_s=1)
            assert reason is not None and "refused 2 connections in a row" in reason

        anyio.run(while_running)
        daemon.kill()
        daemon.wait(10)

        async def after_it_is_gone() -> None:
            reason = await hung_reason(pipe, daemon.pid, timeout_s=1)
            assert reason is not None and "is gone" in reason

        anyio.run(after_it_is_gone)

    with plain_daemon(short_dir / "second") as (pipe, daemon):
        daemon.kill()
        daemon.wait(10)

        async def sockets_left_behind() -> None:
            assert await greeting(pipe, 1) is Liveness.REFUSED  # its sockets are left, nobody listens on them

        anyio.run(sockets_left_behind)


# --- the agent route: the agent starts and supervises the daemon --------------------------------------------


def allocate_in_background(plugin: Plugin, device_ids: list[str]) -> tuple[list[threading.Thread], list[str]]:
    """One Allocate per ID, all at once, each on a thread of its own; their outcomes as they end."""
    outcomes: list[str] = []

    def call(device_id: str) -> None:
        request = dp_pb2.AllocateRequest(container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=[device_id])])
        try:
            plugin.stub.Allocate(request, timeout=300)
            outcomes.append("ok")
        except grpc.RpcError as exc:
            outcomes.append(exc.code().name)

    threads = [threading.Thread(target=call, args=(device_id,)) for device_id in device_ids]
    for thread in threads:
        thread.start()
    return threads, outcomes


def test_a_stopped_daemon_is_noticed_within_the_bound_with_twelve_allocates_queued(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, stopped: list[int]
) -> None:
    text = config(replicas=8)
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", str(int(PROBE_INTERVAL_S)), text=text)
    plugin = kubelet.wait_registered(RESOURCE)
    agent.wait_log("mps daemon healthy")
    pid = daemon_pid(short_dir)
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)
    began = time.time()
    # Each needs a cap switch (the first lowers the ceilings; after it fails, none are known to be held).
    threads, outcomes = allocate_in_background(plugin, (ids(GPU0, *range(8)) + ids(GPU1, *range(8)))[:12])
    verdict = wait_for(lambda: events(agent, HUNG), 60, "the verdict")[0]
    noticed_s = timestamp(verdict) - began
    assert noticed_s < hung_bound_s(PROBE_INTERVAL_S) + SLACK_S, f"noticed after {noticed_s:.1f}s"
    assert "did not greet" in str(verdict["reason"])
    wait_for(lambda: daemon_pid(short_dir) != pid, 15, "a new daemon")
    for thread in threads:
        thread.join(120)
    assert len(outcomes) == 12
    wait_for(lambda: {d[1] for d in plugin.latest()} == {"Healthy"}, 15, "replicas Healthy again")


# --- the Kubernetes route: the daemon host keeps the daemon, the agent drives it -----------------------------


class HostNode:
    """A daemon host and an agent with `--mps-daemon host`, both probing every PROBE_INTERVAL_S."""

    def __init__(self, short_dir: Path, agents: AgentLauncher, kubelet: FakeKubelet) -> None:
        self.common = [
            "--config-file",
            str(write_config(short_dir / "config.yaml", config())),
            "--node-snapshot",
            str(small_node(short_dir / "node.json")),
            "--mps-root",
            str(short_dir / "mps"),
            "--probe-interval-seconds",
            str(int(PROBE_INTERVAL_S)),
        ]
        self.host = agents.start("--daemon-host", *self.common)
        self.host.wait_log("daemon host running", timeout=20)
        self.agent = agents.start(*self.common, "--kubelet-socket", str(kubelet.socket_path), "--mps-daemon", "host")
        self.plugin = kubelet.wait_registered(RESOURCE)
        self.agent.wait_log("mps daemon healthy")


def test_a_stopped_daemon_is_restarted_by_the_daemon_host_within_the_bound(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, stopped: list[int]
) -> None:
    node = HostNode(short_dir, agents, kubelet)
    allocate(node.plugin, ids(GPU0, 0))
    pid = daemon_pid(short_dir)
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)
    began = time.time()
    restart = wait_for(lambda: events(node.host, "mps daemon restarting"), 60, "the restart")[0]
    noticed_s = timestamp(restart) - began
    assert noticed_s < hung_bound_s(PROBE_INTERVAL_S) + SLACK_S, f"noticed after {noticed_s:.1f}s"
    assert "did not greet" in str(restart["reason"])
    wait_for(lambda: daemon_pid(short_dir) != pid, 15, "a new daemon recorded")
    second = daemon_pid(short_dir)
    wait_for(
        lambda: [e for e in events(node.agent, "mps daemon adopted") if e["pid"] == second],
        15,
        "the new daemon adopted",
    )
    wait_for(lambda: control(pipe_of(short_dir), "get_default_active_thread_percentage") == "25.0", 10, "caps")


def test_operations_md_states_the_bound_the_code_keeps() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    extra = hung_bound_s(DEFAULT_PROBE_INTERVAL_S) - DEFAULT_PROBE_INTERVAL_S
    assert extra == HUNG_AFTER_MISSES * GREETING_TIMEOUT_S
    assert f"`--probe-interval-seconds` + {extra:g} s ({hung_bound_s(DEFAULT_PROBE_INTERVAL_S):g} s by default" in text
