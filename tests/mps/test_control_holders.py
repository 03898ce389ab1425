"""Who holds the MPS control socket, and what the agent does about it: through the real `nvidia-cuda-mps-control`.

Every container of a resource mounts the daemon's pipe directory, and `control` takes any user's connection (mode
0666). The daemon reads a new connection's credentials with no timeout, so one that sends nothing blocks it for
everyone; a control session left open makes it refuse every other one. Neither may cost the node its clients (a
restarted daemon ends them all): a holder in a pod is ended at its connection once it has held the socket for
`--control-hold-seconds`, a holder on the host is waited for, and the daemon is never restarted for either."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from mpsagent.base.cgroups import PodContainer
from mpsagent.mps import control_socket
from mpsagent.mps.control_socket import ControlConnection
from mpsagent.mps.hold_watch import ENDED_EVENT, FREE_EVENT, WAITED_EVENT
from mpsagent.mps.holders import HoldTracker
from mpsagent.mps.liveness import State, check
from mpsagent_testing.agents import AgentLauncher, AgentProcess, serve, start, status
from mpsagent_testing.cgroups import PodCgroup, pod_cgroup
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.metrics import value
from mpsagent_testing.mps.daemon import (
    control,
    daemon_pid,
    held_session,
    pipe_of,
    plain_daemon,
    require_real_control,
    silent_connection,
)
from mpsagent_testing.node import GPU0, RESOURCE, ids
from mpsagent_testing.processes import alive

require_real_control()

PROBE_INTERVAL_S = 1.0
BOUND_S = 2.0
"""`--control-hold-seconds`: the default."""
SLACK_S = 1.0
"""For a loaded 2-core machine, beyond the agent's own sighting (a connection is looked at as the daemon's log
shows it, read every 0.2 s; at worst at the next probe interval)."""
RESTARTED = ("mps daemon hung; it is ended", "mps daemon exited", "mps daemon down; replicas unhealthy")


def events(agent: AgentProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in agent.log_events() if e.get("event") == name]


def timestamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def daemon_status(short_dir: Path) -> dict[str, Any]:
    document = json.loads((short_dir / "mps" / "status.json").read_text())
    (resource,) = document["resources"]
    found: dict[str, Any] = resource["daemon"]
    return found


@pytest.fixture
def pod() -> Iterator[PodCgroup]:
    with pod_cgroup() as made:
        yield made


# --- who holds it: the tracker's decisions (pure) -----------------------------------------------------------


def _connection(inode: int, fd: int = 4, pid: int | None = 100) -> ControlConnection:
    return ControlConnection(fd=fd, inode=inode, socket="control", peer_pid=pid, peer_uid=0)


IN_POD = PodContainer(pod_uid="8c2d63f4-1b3a-4d4f-9a54-0e1f7e1b2c3d", container_id="ab" * 32)


@pytest.mark.parametrize(
    ("container", "silent", "refusing", "end_in_pods", "ended", "waited"),
    [
        pytest.param(IN_POD, True, False, True, 1, 0, id="silent in a pod: ended"),
        pytest.param(IN_POD, False, True, True, 1, 0, id="session in a pod, others refused: ended"),
        pytest.param(IN_POD, False, False, True, 0, 0, id="connection in a pod, others served: left"),
        pytest.param(None, True, False, True, 0, 1, id="silent on the host: waited for"),
        pytest.param(None, False, True, True, 0, 1, id="session on the host: waited for"),
        pytest.param(IN_POD, True, False, False, 0, 1, id="ending turned off: waited for"),
    ],
)
def test_a_holder_that_blocks_the_daemon_for_the_bound_is_ended_in_a_pod_and_waited_for_on_the_host(
    container: PodContainer | None, silent: bool, refusing: bool, end_in_pods: bool, ended: int, waited: int
) -> None:
    tracker = HoldTracker(2.0, end_in_pods=end_in_pods)
    tracker.update([(_connection(7), container)], reading_fd=4 if silent else None, now=10.0)
    assert tracker.due(11.9) == ()
    assert tracker.next_due(11.9) == 12.0
    (due,) = tracker.due(12.0)
    decision = tracker.decide([due], refusing=refusing)
    assert (len(decision.end), len(decision.wait)) == (ended, waited)


def test_a_holder_keeps_its_first_sighting_and_one_gone_is_forgotten() -> None:
    tracker = HoldTracker(2.0, end_in_pods=True)
    tracker.update([(_connection(7), IN_POD)], reading_fd=None, now=10.0)
    (holder,) = tracker.update([(_connection(7), IN_POD), (_connection(8, fd=5), None)], reading_fd=5, now=11.0)[:1]
    assert holder.since == 10.0 and not holder.silent
    assert [h.connection.inode for h in tracker.due(12.5)] == [7]
    assert tracker.update([(_connection(8, fd=5), None)], reading_fd=5, now=12.5)[0].since == 11.0
    assert tracker.next_due(12.5) == 13.0
    assert "PID 100 in pod 8c2d63f4" in tracker.holders[0].describe() or "on the host" in tracker.holders[0].describe()


# --- the kernel's view: the daemon's connections, what it waits on, ending one -------------------------------


def test_a_silent_connection_is_seen_with_its_process_and_ended_without_touching_the_daemon(short_dir: Path) -> None:
    with plain_daemon(short_dir) as (pipe, daemon), silent_connection(pipe) as holder:
        (connection,) = control_socket.connections(daemon.pid, pipe)
        assert (connection.socket, connection.peer_pid, connection.peer_uid) == ("control", holder.pid, 0)
        # The daemon logs the connection, then waits for its credentials: a moment after the holder got its hello.
        doing = wait_for(
            lambda: (a := control_socket.activity(daemon.pid)) is not None and a.reading_fd == connection.fd and a,
            5,
            "the daemon waiting on the connection",
        )
        assert not doing.stopped
        assert control_socket.end(daemon.pid, connection)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ended"
        assert holder.poll() is None, "the holder's process is not touched, only its connection"
        assert control(pipe, "get_default_active_thread_percentage") == "100.0"
        assert control_socket.connections(daemon.pid, pipe) == ()
        assert not control_socket.end(daemon.pid, connection), "an ended connection is not ended twice"
        assert daemon.poll() is None


def test_a_held_session_is_seen_and_the_daemon_is_not_waiting_on_it(short_dir: Path) -> None:
    with plain_daemon(short_dir) as (pipe, daemon), held_session(pipe) as session:
        (connection,) = control_socket.connections(daemon.pid, pipe)
        assert connection.peer_pid == session.pid and connection.socket == "control_privileged"
        doing = control_socket.activity(daemon.pid)
        assert doing is not None and doing.reading_fd is None  # in its poll: it greets, and refuses sessions


def test_the_liveness_check_tells_a_held_daemon_from_a_stopped_one(short_dir: Path) -> None:
    with plain_daemon(short_dir) as (pipe, daemon):

        async def checks() -> None:
            assert (await check(pipe, daemon.pid)).state is State.ANSWERS
            with silent_connection(pipe) as holder:
                found = await check(pipe, daemon.pid)
                assert found.state is State.HELD and found.answers
                assert found.holder is not None and found.holder.peer_pid == holder.pid
            assert (await check(pipe, daemon.pid)).state is State.ANSWERS
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                found = await check(pipe, daemon.pid)
                assert found.state is State.HUNG and "stopped (SIGSTOP)" in found.reason
                assert time.monotonic() - began < 0.5 + SLACK_S, "a stopped daemon is known at its first miss"
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            assert (await check(pipe, daemon.pid)).state is State.ANSWERS

        anyio.run(checks)


# --- the agent ----------------------------------------------------------------------------------------------


def _serve(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, *extra: str) -> tuple[AgentProcess, str]:
    agent, base = serve(agents, kubelet, short_dir, "--probe-interval-seconds", str(int(PROBE_INTERVAL_S)), *extra)
    kubelet.wait_registered(RESOURCE)
    agent.wait_log("mps daemon healthy")
    return agent, base


def test_a_silent_connection_from_the_host_held_60_s_never_gets_the_daemon_restarted(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, base = _serve(agents, kubelet, short_dir)
    pid, pipe = daemon_pid(short_dir), pipe_of(short_dir)
    plugin = kubelet.plugins[0]
    with silent_connection(pipe) as holder:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert alive(pid) and daemon_pid(short_dir) == pid, "the daemon was restarted for a silent connection"
            assert holder.poll() is None
            time.sleep(1)
        (waited,) = events(agent, WAITED_EVENT)
        assert waited["holder_pid"] == holder.pid and "on the host" in waited["holder"]
        (held,) = daemon_status(short_dir)["controlHolders"]
        assert (held["pid"], held["silent"], held.get("podUid")) == (holder.pid, True, None)
        assert value(base, "mpsagent_daemon_control_holders", resource=RESOURCE) == 1
    wait_for(lambda: events(agent, FREE_EVENT), 5, "the socket free again")
    assert alive(pid) and daemon_pid(short_dir) == pid
    assert [e for name in RESTARTED for e in events(agent, name)] == []
    assert events(agent, ENDED_EVENT) == [], "a host process's connection is never ended"
    assert all(health == "Healthy" for update in plugin.updates for _, health, _ in update)
    assert control(pipe, "get_default_active_thread_percentage") == "100.0"


def test_a_silent_connection_in_a_pod_is_ended_within_the_bound_and_the_pod_named(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, pod: PodCgroup
) -> None:
    agent, base = _serve(agents, kubelet, short_dir)
    pid, pipe = daemon_pid(short_dir), pipe_of(short_dir)
    with silent_connection(pipe, pod=pod) as holder:
        connected = time.monotonic()
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ended"
        ended_after = time.monotonic() - connected
        assert BOUND_S - 0.2 <= ended_after <= BOUND_S + SLACK_S, f"ended after {ended_after:.2f}s"
        assert holder.poll() is None, "only its connection is ended, not its process"
    (ended,) = wait_for(lambda: events(agent, ENDED_EVENT), 5, "the warning")
    assert ended["level"] == "warning" and ended["holder_pid"] == holder.pid
    assert (ended["pod_uid"], ended["container_id"]) == (pod.pod_uid, pod.container_id)
    assert f"in pod {pod.pod_uid}" in ended["holder"] and "sends nothing" in ended["holder"]
    last = wait_for(lambda: daemon_status(short_dir).get("lastControlHoldEnded"), 5, "the status")
    assert last["holder"]["podUid"] == pod.pod_uid and last["holder"]["silent"]
    assert value(base, "mpsagent_daemon_control_holds_ended_total", resource=RESOURCE) == 1
    assert alive(pid) and daemon_pid(short_dir) == pid
    assert [e for name in RESTARTED for e in events(agent, name)] == []


def test_a_session_held_in_a_pod_is_ended_within_the_bound_and_the_caps_restored_within_a_second(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, pod: PodCgroup
) -> None:
    agent, _ = _serve(agents, kubelet, short_dir)
    plugin = kubelet.plugins[0]
    allocate(plugin, ids(GPU0, 0))  # capped: 25 %
    pid, pipe = daemon_pid(short_dir), pipe_of(short_dir)
    wait_for(lambda: control(pipe, "get_default_active_thread_percentage") == "25.0", 5, "the caps")
    lifted = "set_default_active_thread_percentage 100\nset_default_device_pinned_mem_limit 0 0\n"
    with held_session(pipe, first=lifted, pod=pod) as session:
        opened = time.monotonic()
        # An Allocate that needs a cap switch waits out the hold, not the tenant's pleasure: answered OK.
        allocate(plugin, ids(GPU0, 1, 2))
        allocated_after = time.monotonic() - opened
        session.wait(BOUND_S + SLACK_S + 5)  # the front-end exits once its connection is ended
        ended_after = time.monotonic() - opened
    assert ended_after <= BOUND_S + SLACK_S, f"ended after {ended_after:.2f}s"
    assert allocated_after <= BOUND_S + SLACK_S, f"allocated after {allocated_after:.2f}s"
    (ended,) = wait_for(lambda: events(agent, ENDED_EVENT), 5, "the warning")
    assert ended["holder_pid"] == session.pid and ended["pod_uid"] == pod.pod_uid
    assert "a control session" in ended["holder"]
    wait_for(lambda: control(pipe, "get_default_active_thread_percentage") == "50.0", 5, "the caps restored")
    restored = _logged_after(short_dir, "set_default_active_thread_percentage 50", timestamp(ended))
    assert restored is not None and restored - timestamp(ended) < 1.0, "every ceiling set again within a second"
    assert control(pipe, "get_default_device_pinned_mem_limit 0") != ""
    assert alive(pid) and daemon_pid(short_dir) == pid


def _logged_after(short_dir: Path, command: str, after: float) -> float | None:
    """When (the daemon's clock) the daemon's log first shows `command` at or after `after`."""
    log = short_dir / "mps" / "nvidia.com" / "gpu" / "log" / "control.log"
    for line in log.read_text(errors="replace").splitlines():
        stamp, _, text = line.partition("] Cmd:")
        if text == command:
            when = datetime.strptime(stamp[1:24], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            if when >= after - 0.01:
                return when
    return None


def test_an_administrators_session_on_the_host_is_never_ended(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, _ = _serve(agents, kubelet, short_dir)
    pid, pipe = daemon_pid(short_dir), pipe_of(short_dir)
    with held_session(pipe) as session:
        wait_for(lambda: events(agent, WAITED_EVENT), BOUND_S + PROBE_INTERVAL_S + 5, "the report")
        time.sleep(2 * BOUND_S)
        assert session.poll() is None, "an administrator's session was ended"
    wait_for(lambda: events(agent, FREE_EVENT), 5, "the socket free again")
    assert events(agent, ENDED_EVENT) == []
    assert alive(pid) and daemon_pid(short_dir) == pid


def test_ending_turned_off_leaves_a_pod_holder_alone(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, pod: PodCgroup
) -> None:
    agent, _ = _serve(agents, kubelet, short_dir, "--control-hold-seconds", "0")
    pipe = pipe_of(short_dir)
    with silent_connection(pipe, pod=pod) as holder:
        wait_for(lambda: events(agent, WAITED_EVENT), BOUND_S + PROBE_INTERVAL_S + 5, "the report")
        time.sleep(BOUND_S)
        assert holder.poll() is None and events(agent, ENDED_EVENT) == []


def test_a_stopped_daemon_is_unhealthy_within_2_s_and_healthy_within_1_s_of_answering_again(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", str(int(PROBE_INTERVAL_S)))
    plugin = kubelet.wait_registered(RESOURCE)
    agent.wait_log("mps daemon healthy")
    pid = daemon_pid(short_dir)
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: {d[1] for d in plugin.latest()} == {"Unhealthy"}, 10, "the replicas Unhealthy")
        unhealthy_after = time.monotonic() - stopped
        (silent,) = events(agent, "mps daemon does not answer")
        assert "stopped (SIGSTOP)" in silent["reason"]
        time.sleep(1.0)
        assert daemon_status(short_dir)["unresponsive"]["reason"] == silent["reason"]
    finally:
        os.kill(pid, signal.SIGCONT)
    continued = time.monotonic()
    wait_for(lambda: {d[1] for d in plugin.latest()} == {"Healthy"}, 10, "the replicas Healthy")
    healthy_after = time.monotonic() - continued
    assert unhealthy_after <= 2.0, f"Unhealthy after {unhealthy_after:.2f}s"
    assert healthy_after <= 1.0, f"Healthy again after {healthy_after:.2f}s"
    assert daemon_pid(short_dir) == pid, "a daemon stopped for a moment is not restarted"
    assert events(agent, "mps daemon answers again")


def test_the_holders_are_shown_by_status(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    _serve(agents, kubelet, short_dir)
    with silent_connection(pipe_of(short_dir)) as holder:
        wait_for(lambda: daemon_status(short_dir)["controlHolders"], BOUND_S + PROBE_INTERVAL_S + 5, "the holder")
        shown = status(short_dir).stdout
        assert f"control socket HELD by PID {holder.pid} on the host" in shown, shown
