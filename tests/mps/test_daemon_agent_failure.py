"""When the agent itself cannot run a control command (a missing binary, EMFILE, ENOMEM), that is the agent's
failure, not the daemon's: the daemon, and every CUDA client of it, is kept. Through the real control daemon."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import anyio
import pytest

from mpsagent.base.errors import ControlRunError, DaemonCommandError
from mpsagent.mps.control import ControlChannel
from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.mps.daemon import REAL_BIN, control, daemon_pid, pipe_of, require_real_control
from mpsagent_testing.node import GPU0, RESOURCE, ids
from mpsagent_testing.processes import alive

require_real_control()  # the agents these tests start run the real MPS control daemon


def switchable_wrapper(directory: Path) -> tuple[Path, Path]:
    """A control binary that execs the real one; renaming it away makes every later exec of it fail (ENOENT)."""
    directory.mkdir()
    wrapper = directory / "nvidia-cuda-mps-control"
    wrapper.write_text(f'#!/bin/sh\nexec {REAL_BIN} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, directory / "parked"


def events(agent, name: str) -> list[dict[str, object]]:
    return [e for e in agent.log_events() if e.get("event") == name]


def test_the_daemon_is_kept_when_the_agent_cannot_run_the_control_front_end(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    wrapper, parked = switchable_wrapper(short_dir / "bin")
    agent = start(agents, kubelet, short_dir, "--mps-control-bin", str(wrapper), "--probe-interval-seconds", "1")
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))  # capped: the daemon holds caps a restart would have to restore
    pid = daemon_pid(short_dir)

    wrapper.rename(parked)  # from now on the agent cannot exec the front-end
    wait_for(
        lambda: events(agent, "mps control front-end cannot run; the daemon is kept") or not alive(pid),
        10,
        "the agent to notice it cannot run the front-end",
    )
    assert alive(pid), "the agent killed a healthy daemon because it could not run a command itself"
    # Several more rounds fail (backing off): still one error for the episode, the daemon never touched.
    wait_for(lambda: len(events(agent, "mps control front-end still cannot run")) >= 2, 10, "more failed rounds")
    assert len(events(agent, "mps control front-end cannot run; the daemon is kept")) == 1
    # An Allocate that needs a cap switch fails cleanly meanwhile; one that does not still succeeds.
    assert allocate(plugin, ids(GPU0, 1)).container_responses[0].envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"

    parked.rename(wrapper)
    wait_for(lambda: events(agent, "mps control front-end runs again"), 10, "the agent to recover")
    assert daemon_pid(short_dir) == pid and alive(pid)
    assert events(agent, "mps daemon down; replicas unhealthy") == []
    assert all(health == "Healthy" for update in plugin.updates for _, health, _ in update)
    status = json.loads((short_dir / "mps" / "status.json").read_text())
    assert status["resources"][0]["daemon"]["restarts"] == 0
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "25.0"
    event = events(agent, "mps control front-end cannot run; the daemon is kept")[0]
    assert "No such file or directory" in str(event["reason"])
    assert "LimitNOFILE" in str(event["hint"])


def test_a_front_end_that_cannot_be_spawned_is_the_agents_failure_not_the_daemons(tmp_path: Path) -> None:
    missing = ControlChannel(str(tmp_path / "absent"), tmp_path)

    async def main() -> None:
        with pytest.raises(ControlRunError, match=r"absent \(No such file or directory\); install nvidia-cuda-mps"):
            await missing.probe()

    anyio.run(main)


def test_out_of_file_descriptors_is_the_agents_failure_not_the_daemons(tmp_path: Path) -> None:
    channel = ControlChannel(str(REAL_BIN), tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    async def main() -> None:
        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use, hard))  # the front-end's pipes cannot be made
        try:
            with pytest.raises(ControlRunError, match=r"Too many open files.*raise its open-file limit") as caught:
                await channel.probe()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert not isinstance(caught.value, DaemonCommandError)

    anyio.run(main)
