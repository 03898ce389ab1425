"""The real nvidia-cuda-mps-control under the agent's supervision (a fake binary only for faults the real one
cannot show). These tests need Debian's nvidia-cuda-mps package; `scripts/test` installs it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import anyio
import pytest

from mpsagent.base.errors import DaemonCommandError
from mpsagent.mps.control import ControlChannel, check_command
from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.mps import FAKE_CONTROL_BIN
from mpsagent_testing.mps.daemon import (
    control,
    daemon_pid,
    held_session,
    pipe_of,
    plain_daemon,
    require_real_control,
)
from mpsagent_testing.node import ALL, GPU0, RESOURCE, config, ids
from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.processes import alive

require_real_control()


def test_daemon_holds_the_full_hardware_at_start(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    agent = start(agents, kubelet, short_dir)
    plugin = kubelet.wait_registered(RESOURCE)
    assert plugin.options.pre_start_required is True
    pipe = pipe_of(short_dir)
    assert control(pipe, "get_default_active_thread_percentage") == "100.0"
    assert control(pipe, "get_default_device_pinned_mem_limit 0") == "16G"
    assert control(pipe, "get_default_device_pinned_mem_limit 1") == "16G"
    # The daemon's own log reaches the agent's structured log, keyed by resource.
    forwarded = agent.wait_log("mps daemon log")
    assert forwarded["resource"] == RESOURCE
    assert "Control" in str(forwarded["line"])


def test_capped_and_full_allocations_switch_the_daemon(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    start(agents, kubelet, short_dir, text=config(grants="equal"))  # the NVIDIA rule: 1/replicas on every GPU
    plugin = kubelet.wait_registered(RESOURCE)
    pipe = pipe_of(short_dir)
    allocate(plugin, ids(GPU0, 0))
    assert control(pipe, "get_default_active_thread_percentage") == "25.0"
    assert control(pipe, "get_default_device_pinned_mem_limit 1") == "4G"
    allocate(plugin, ALL)
    assert control(pipe, "get_default_active_thread_percentage") == "100.0"
    assert control(pipe, "get_default_device_pinned_mem_limit 1") == "16G"


def test_caps_not_enforced_leaves_the_daemon_at_full(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    start(agents, kubelet, short_dir, text=config().replace("    resources:", "    enforceCaps: false\n    resources:"))
    plugin = kubelet.wait_registered(RESOURCE)
    assert plugin.options.pre_start_required is False
    envs = dict(allocate(plugin, ids(GPU0, 0)).container_responses[0].envs)
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "100.0"


def health(plugin: Plugin) -> set[str]:
    return {device[1] for device in plugin.latest()}


def test_killed_daemon_goes_unhealthy_then_healthy_with_its_caps_again(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    start(agents, kubelet, short_dir)
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))
    first = daemon_pid(short_dir)
    seen = len(plugin.updates)
    os.kill(first, signal.SIGKILL)
    killed = time.monotonic()
    # The restart can be quicker than a poll: look for the Unhealthy update in the history, not the latest one.
    wait_for(lambda: {"Unhealthy"} in [{d[1] for d in u} for u in plugin.updates[seen:]], 5, "replicas Unhealthy")
    assert time.monotonic() - killed < 5  # bench/ measures the delay itself (10 ms)
    wait_for(lambda: health(plugin) == {"Healthy"}, 10, "replicas Healthy again")
    assert daemon_pid(short_dir) != first
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "25.0"


def test_an_agent_killed_and_started_again_adopts_the_running_daemon(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir)
    kubelet.wait_registered(RESOURCE)
    pid = daemon_pid(short_dir)
    agent.stop(signal.SIGKILL)
    assert alive(pid)
    again = start(agents, kubelet, short_dir)
    kubelet.wait_registered(RESOURCE, count=2)
    adopted = again.wait_log("mps daemon adopted")
    assert adopted["pid"] == pid
    assert daemon_pid(short_dir) == pid
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "100.0"
    # Left running on a normal stop too (the default): clients survive agent restarts.
    assert again.stop() == 0
    assert alive(pid)


def test_mps_on_exit_quit_stops_the_daemon(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    agent = start(agents, kubelet, short_dir, "--mps-on-exit", "quit")
    kubelet.wait_registered(RESOURCE)
    pid = daemon_pid(short_dir)
    assert agent.stop() == 0
    wait_for(lambda: not alive(pid), 5, "the daemon to quit")
    assert not (short_dir / "mps" / "nvidia.com" / "gpu" / "daemon.json").exists()


def test_compute_mode_set_through_nvml_and_restored_on_quit(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fake_nvml_library: Path
) -> None:
    a, b = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
    nvml = short_dir / "nvml.json"
    nvml.write_text(
        json.dumps(
            {
                "gpus": [
                    {"uuid": a, "memoryTotal": 17179869184, "major": 7, "minor": 5},
                    {"uuid": b, "memoryTotal": 17179869184, "major": 7, "minor": 5},
                ]
            }
        )
    )
    state = short_dir / "nvml-state.json"
    env = fake_nvml_env(fake_nvml_library, nvml, state)
    agent = start(agents, kubelet, short_dir, "--mps-on-exit", "quit", env=env, nvml=True)
    plugin = kubelet.wait_registered(RESOURCE)
    assert [d[0] for d in plugin.latest()][:1] == [f"{a}::0"]
    assert json.loads(state.read_text())["computeModes"] == {a: 3, b: 3}
    assert agent.stop() == 0
    assert json.loads(state.read_text())["computeModes"] == {a: 0, b: 0}


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("wrong-value", "did not hold"),
        ("garbage", "did not hold"),
        # Every session ends with a command that always prints: a daemon that prints nothing never answered.
        ("silent", "the MPS control daemon for nvidia.com/gpu did not answer within 10s"),
    ],
)
def test_a_daemon_that_does_not_hold_its_defaults_fails_start_up_loudly(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fault: str, message: str
) -> None:
    failing = start(
        agents, kubelet, short_dir, "--mps-control-bin", str(FAKE_CONTROL_BIN), env={"FAKE_MPS_FAULT": fault}
    )
    assert failing.process.wait(30) == 1
    assert message in failing.log()
    assert "Traceback" not in failing.log()
    assert kubelet.plugins == []


def test_missing_binary_is_a_clear_runtime_failure(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir, "--mps-control-bin", "/nonexistent/nvidia-cuda-mps-control")
    assert agent.process.wait(30) == 1
    assert "install nvidia-cuda-mps or set --mps-control-bin" in agent.log()


def test_a_hung_front_end_times_out(tmp_path: Path) -> None:
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(0o755)
    channel = ControlChannel(str(hang), tmp_path, timeout_s=0.3)

    async def main() -> None:
        with pytest.raises(DaemonCommandError, match=r"got no answer within 0\.3s"):
            await channel.send("get_server_list")
        assert await channel.probe() is False

    anyio.run(main)


@pytest.mark.parametrize(
    "command",
    ["get_server_list\n", "get_server_list\nquit", "set_default_active_thread_percentage 1;quit", "", "x" * 600],
)
def test_commands_that_could_inject_another_line_are_refused(command: str) -> None:
    with pytest.raises(DaemonCommandError, match="malformed"):
        check_command(command)


@pytest.mark.parametrize(
    ("line", "level"),
    [
        ("[2026-11-30 09:32:57.976 Control 17694] Accepting connection...", "DEBUG"),
        ("[2026-11-30 09:32:57.976 Control 17694] Cmd:get_default_active_thread_percentage", "DEBUG"),
        ("[2026-11-30 09:32:57.976 Control 17694] 25.0", "DEBUG"),
        ("[2026-11-30 09:32:57.976 Control 17694] 0=19G,1=19G", "DEBUG"),
        ("[2026-11-30 09:32:57.976 Control 17694] User did not send valid credentials", "DEBUG"),  # liveness check
        ("[2026-11-30 09:32:57.976 Control 17694] Starting control daemon using socket /run/x/pipe/control", "INFO"),
        ("[2026-11-30 09:32:57.976 Control 17694] Server 4242 exited with status 1", "INFO"),
        ("[2026-11-30 09:32:57.976 Control 17694] Failed to start the MPS server", "WARNING"),
    ],
)
def test_the_daemons_log_reaches_the_agents_log_at_a_fitting_level(line: str, level: str) -> None:
    import logging  # noqa: PLC0415

    from mpsagent.mps.daemon_log import daemon_log_level  # noqa: PLC0415

    assert logging.getLevelName(daemon_log_level(line)) == level


def test_a_session_the_daemon_refuses_while_another_is_open_is_asked_again(short_dir: Path) -> None:
    """What the tests read of a daemon is its answer: while another session is open (the agent's read-back, every
    probe interval) the real daemon closes a new one unanswered, and the tests' `control` asks again, so a `set_`
    reaches the daemon and a `get_` reads its value, not a refusal."""
    with plain_daemon(short_dir) as (pipe, _), held_session(pipe) as session:
        assert session.stdin is not None
        closing = threading.Timer(0.5, session.stdin.close)
        closing.start()
        assert control(pipe, "set_default_active_thread_percentage 40") == "40.0"
        assert control(pipe, "get_default_active_thread_percentage") == "40.0"
        closing.join()
