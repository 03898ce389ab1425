"""A busy control daemon is not a hung one, and a hung one is noticed whatever the RPC load: through the real
`nvidia-cuda-mps-control`.

While any root session is open (an administrator at the prompt, or a root process in a client container, which has
the pipe directory), the daemon refuses every other session with "Cannot send command to MPS control daemon
process"; it still greets a connection to its control socket. A stopped daemon (SIGSTOP) does neither."""

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

from mpsagent.base.errors import DaemonBusyError, DaemonCommandError
from mpsagent.base.settings import DEFAULT_PROBE_INTERVAL_S
from mpsagent.mps.control import BUSY_WAIT_S, ControlChannel
from mpsagent.mps.lifecycle import RESTART_AFTER_S
from mpsagent.mps.liveness import (
    GREETING_TIMEOUT_S,
    HUNG_AFTER_MISSES,
    Liveness,
    State,
    check,
    greeting,
)
from mpsagent_testing.agents import AgentLauncher, AgentProcess, serve, start
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.kubelet.stubs import dp_pb2
from mpsagent_testing.metrics import get, value
from mpsagent_testing.mps import restart_bound_s, unanswered_bound_s
from mpsagent_testing.mps.daemon import (
    REAL_BIN,
    control,
    daemon_pid,
    held_session,
    pipe_of,
    plain_daemon,
    require_real_control,
)
from mpsagent_testing.node import GPU0, GPU1, RESOURCE, config, ids, small_node, write_config
from mpsagent_testing.processes import alive
from mpsagent_testing.repo import ROOT

require_real_control()

BUSY = "control daemon busy"
AGAIN = "control daemon answers again"
SILENT = "mps daemon does not answer"
HUNG = "mps daemon hung; it is ended"
PROBE_INTERVAL_S = 1.0
HELD_S = 3.5 * PROBE_INTERVAL_S  # longer than three probe intervals: the daemon host used to restart at three
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


# --- the channel and the liveness check, against a daemon of the test's own --------------------------------


def test_a_busy_daemon_greets_and_a_stopped_or_gone_one_does_not(short_dir: Path, stopped: list[int]) -> None:
    with plain_daemon(short_dir) as (pipe, daemon):

        async def while_running() -> None:
            assert await greeting(pipe, 1) is Liveness.ANSWERS
            with held_session(pipe):
                assert await greeting(pipe, 1) is Liveness.ANSWERS
                assert (await check(pipe, daemon.pid, timeout_s=1)).state is State.ANSWERS
            os.kill(daemon.pid, signal.SIGSTOP)
            stopped.append(daemon.pid)
            assert await greeting(pipe, 0.5) is Liveness.SILENT
            found = await check(pipe, daemon.pid, timeout_s=0.5)
            assert found.state is State.HUNG and "is stopped (SIGSTOP)" in found.reason
            os.kill(daemon.pid, signal.SIGCONT)
            assert await greeting(pipe, 1) is Liveness.ANSWERS
            # Root's front-end falls back to the clients' socket and back: out of reach only without both.
            (pipe / "control").unlink()
            assert await greeting(pipe, 1) is Liveness.ANSWERS
            (pipe / "control_privileged").unlink()
            assert await greeting(pipe, 1) is Liveness.REFUSED
            found = await check(pipe, daemon.pid, timeout_s=1)
            assert found.state is State.HUNG and "refused 2 connections in a row" in found.reason

        anyio.run(while_running)
        daemon.kill()
        daemon.wait(10)

        async def after_it_is_gone() -> None:
            found = await check(pipe, daemon.pid, timeout_s=1)
            assert found.state is State.GONE and "is gone" in found.reason

        anyio.run(after_it_is_gone)

    with plain_daemon(short_dir / "second") as (pipe, daemon):
        daemon.kill()
        daemon.wait(10)

        async def sockets_left_behind() -> None:
            assert await greeting(pipe, 1) is Liveness.REFUSED  # its sockets are left, nobody listens on them

        anyio.run(sockets_left_behind)


def test_a_session_refused_while_another_is_open_is_asked_again_until_it_closes(short_dir: Path) -> None:
    with plain_daemon(short_dir) as (pipe, _):
        channel = ControlChannel(str(REAL_BIN), pipe)
        with held_session(pipe) as session:
            assert session.stdin is not None
            closing = threading.Timer(0.5, session.stdin.close)
            closing.start()
            began = time.monotonic()
            assert anyio.run(channel.send, "get_default_active_thread_percentage") == "100.0"
            assert time.monotonic() - began < BUSY_WAIT_S
            closing.join()


def test_a_daemon_busy_beyond_the_bound_fails_as_busy_and_not_as_a_failed_daemon(short_dir: Path) -> None:
    with plain_daemon(short_dir) as (pipe, _):
        channel = ControlChannel(str(REAL_BIN), pipe)

        async def main() -> None:
            with held_session(pipe):
                began = time.monotonic()
                with pytest.raises(DaemonBusyError) as busy:
                    await channel.send("get_default_active_thread_percentage")
                assert BUSY_WAIT_S <= time.monotonic() - began < BUSY_WAIT_S + SLACK_S
                assert not isinstance(busy.value, DaemonCommandError)
                assert "another control session is open" in str(busy.value)
                assert "close that session" in str(busy.value)
                # The same episode: a later call tries once and does not wait again.
                began = time.monotonic()
                with pytest.raises(DaemonBusyError):
                    await channel.send("get_server_list")
                assert time.monotonic() - began < BUSY_WAIT_S  # asked again, it would wait all of it
                assert await channel.probe() is True  # busy is an answer: the daemon lives
            assert await channel.send("get_default_active_thread_percentage") == "100.0"

        anyio.run(main)


# --- the agent route: the agent starts and supervises the daemon --------------------------------------------


def test_a_held_root_session_leaves_the_agents_daemon_alone(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, base = serve(agents, kubelet, short_dir, "--probe-interval-seconds", str(int(PROBE_INTERVAL_S)))
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))  # capped: 25 %, 4 GiB on GPU 0
    pid, pipe = daemon_pid(short_dir), pipe_of(short_dir)
    seen = len(plugin.updates)

    with held_session(pipe):
        held = time.monotonic()
        wait_for(lambda: events(agent, BUSY) or daemon_pid(short_dir) != pid or not alive(pid), 15, "busy")
        assert alive(pid) and daemon_pid(short_dir) == pid, "the agent killed a daemon that was only busy"
        (busy,) = events(agent, BUSY)
        assert busy["level"] == "warning" and busy["pid"] == pid
        assert "another control session is open" in str(busy["reason"])
        wait_for(lambda: value(base, "mpsagent_daemon_busy", resource=RESOURCE) == 1, 5, "the busy gauge")
        assert value(base, "mpsagent_daemon_busy_episodes_total", resource=RESOURCE) == 1
        code, text = get(base + "/readyz")
        assert code == 503 and f"{RESOURCE}: mps control daemon busy since " in text
        # An Allocate that needs no cap switch is answered; one that does answers UNAVAILABLE within the bound,
        # and nothing is withdrawn beyond its own grant.
        allocate(plugin, ids(GPU0, 3))
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            allocate(plugin, ids(GPU0, 1, 2))
        assert time.monotonic() - began < BUSY_WAIT_S + SLACK_S
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "busy" in str(refused.value.details())
        allocate(plugin, ids(GPU0, 1))
        # PreStartContainer reads the caps back: it cannot, and says so within the bound (the kubelet retries it).
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            plugin.stub.PreStartContainer(dp_pb2.PreStartContainerRequest(devices_ids=ids(GPU0, 1)), timeout=10)
        assert time.monotonic() - began < BUSY_WAIT_S + SLACK_S
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "busy" in str(refused.value.details())
        time.sleep(max(0.0, HELD_S - (time.monotonic() - held)))  # the scenario: a session held this long

    wait_for(lambda: events(agent, AGAIN), 10, "the daemon to answer again")
    assert len(events(agent, BUSY)) == 1
    assert alive(pid) and daemon_pid(short_dir) == pid
    assert events(agent, SILENT) == [] and events(agent, HUNG) == []
    assert events(agent, "mps daemon down; replicas unhealthy") == []
    assert all(health == "Healthy" for update in plugin.updates[seen:] for _, health, _ in update)
    wait_for(lambda: get(base + "/readyz") == (200, "ready\n"), 5, "ready again")
    assert value(base, "mpsagent_daemon_busy", resource=RESOURCE) == 0
    # The rounds read the caps back again: a change is restored.
    control(pipe, "set_default_active_thread_percentage 100")
    wait_for(lambda: control(pipe, "get_default_active_thread_percentage") == "25.0", 5, "the caps restored")


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
    silent = wait_for(lambda: events(agent, SILENT), 60, "the daemon seen not answering")[0]
    noticed_s = timestamp(silent) - began
    assert noticed_s < unanswered_bound_s(PROBE_INTERVAL_S) + SLACK_S, f"noticed after {noticed_s:.1f}s"
    assert "stopped (SIGSTOP)" in str(silent["reason"])
    verdict = wait_for(lambda: events(agent, HUNG), 60, "the verdict")[0]
    ended_s = timestamp(verdict) - began
    assert RESTART_AFTER_S <= ended_s < restart_bound_s(PROBE_INTERVAL_S) + SLACK_S, f"ended after {ended_s:.1f}s"
    assert f"for {RESTART_AFTER_S:g}s" in str(verdict["reason"])
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


def test_a_held_root_session_leaves_the_daemon_hosts_daemon_alone(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    node = HostNode(short_dir, agents, kubelet)
    allocate(node.plugin, ids(GPU0, 0))
    pid, pipe = daemon_pid(short_dir), pipe_of(short_dir)
    seen = len(node.plugin.updates)
    with held_session(pipe):
        held = time.monotonic()
        wait_for(lambda: events(node.agent, BUSY) or daemon_pid(short_dir) != pid, 15, "busy")
        time.sleep(max(0.0, HELD_S - (time.monotonic() - held)))  # the scenario: a session held this long
        assert events(node.host, "mps daemon restarting") == [], "the daemon host restarted a daemon only busy"
    wait_for(lambda: events(node.agent, AGAIN), 10, "the daemon to answer again")
    assert alive(pid) and daemon_pid(short_dir) == pid
    assert len(events(node.agent, BUSY)) == 1
    assert events(node.agent, "mps daemon down; replicas unhealthy") == []
    assert all(health == "Healthy" for update in node.plugin.updates[seen:] for _, health, _ in update)
    control(pipe, "set_default_active_thread_percentage 100")
    wait_for(lambda: control(pipe, "get_default_active_thread_percentage") == "25.0", 5, "the caps restored")
    assert events(node.host, "mps daemon restarting") == []


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
    ended_s = timestamp(restart) - began
    assert RESTART_AFTER_S <= ended_s < restart_bound_s(PROBE_INTERVAL_S) + SLACK_S, f"ended after {ended_s:.1f}s"
    assert "stopped (SIGSTOP)" in str(restart["reason"])
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
    extra = unanswered_bound_s(DEFAULT_PROBE_INTERVAL_S) - DEFAULT_PROBE_INTERVAL_S
    assert extra == HUNG_AFTER_MISSES * GREETING_TIMEOUT_S
    assert (
        f"`--probe-interval-seconds` + {extra:g} s ({unanswered_bound_s(DEFAULT_PROBE_INTERVAL_S):g} s by default"
        in text
    )
    assert f"restarted only once it has not answered for {RESTART_AFTER_S:g} s" in text
    assert f"until {BUSY_WAIT_S:g} s after the episode's first refusal" in text
