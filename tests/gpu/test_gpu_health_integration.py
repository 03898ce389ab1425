"""GPU health through the agent's real sockets: NVML (the real nvidia-ml-py over the fake library) raising Xid
events and losing GPUs, seen by a grpcio fake kubelet in ListAndWatch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.node import RESOURCE, config, write_config
from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.nvml.control import FakeNvmlDriver
from mpsagent_testing.repo import ROOT

require_real_control()  # the agents these tests start run the real MPS control daemon

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


class Node:
    def __init__(self, directory: Path, library: Path) -> None:
        self.config = directory / "nvml.json"
        self.config.write_text(
            json.dumps(
                {
                    "gpus": [
                        {"uuid": uuid, "memoryTotal": 17179869184, "major": 7, "minor": 5} for uuid in (GPU_A, GPU_B)
                    ]
                }
            )
        )
        self.driver = FakeNvmlDriver(directory / "nvml-state.json", directory / "nvml-events.jsonl")
        self.library = library

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **fake_nvml_env(self.library, self.config, self.driver.state_path, events=self.driver.events_path),
            **extra,
        }


@pytest.fixture
def node(short_dir: Path, fake_nvml_library: Path) -> Node:
    return Node(short_dir, fake_nvml_library)


def health(plugin: Plugin) -> dict[str, set[str]]:
    """GPU -> the set of health values its replicas show in the latest ListAndWatch update."""
    by_gpu: dict[str, set[str]] = {}
    for device_id, value, _ in plugin.latest():
        by_gpu.setdefault(device_id.rpartition("::")[0], set()).add(value)
    return by_gpu


def wait_health(plugin: Plugin, expected: dict[str, set[str]], timeout: float = 10) -> None:
    wait_for(lambda: health(plugin) == expected, timeout, f"health {expected}, last seen {health(plugin)}")


HEALTHY = {GPU_A: {"Healthy"}, GPU_B: {"Healthy"}}


def run_agent(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node, *extra: str, **env: str):
    agent = start(agents, kubelet, short_dir, *extra, env=node.env(**env), nvml=True)
    plugin = kubelet.wait_registered(RESOURCE)
    wait_health(plugin, HEALTHY)
    if "DP_DISABLE_HEALTHCHECKS" not in env:
        agent.wait_log("gpu events watched")  # NVML delivers only the events that happen after this
    return agent, plugin


def test_a_critical_xid_makes_every_replica_of_that_gpu_unhealthy_and_nothing_else(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node
) -> None:
    agent, plugin = run_agent(agents, kubelet, short_dir, node)
    node.driver.emit_xid(GPU_B, 79)
    wait_health(plugin, {GPU_A: {"Healthy"}, GPU_B: {"Unhealthy"}})
    event = agent.wait_log("gpu unhealthy; its replicas are withdrawn")
    assert event["gpu"] == GPU_B and event["reason"] == "critical Xid 79"
    assert len(plugin.latest()) == 8  # every replica still listed


def test_application_xids_are_ignored_and_the_dp_variables_change_which_count(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node
) -> None:
    agent, plugin = run_agent(
        agents, kubelet, short_dir, node, DP_DISABLE_HEALTHCHECKS="79", DP_ENABLE_HEALTHCHECKS="31"
    )
    node.driver.emit_xid(GPU_A, 13)  # application error
    node.driver.emit_xid(GPU_A, 79)  # disabled by the operator
    wait_for(lambda: len([e for e in agent.log_events() if e.get("event") == "gpu xid ignored"]) == 2, 5, "ignored")
    assert health(plugin) == HEALTHY
    node.driver.emit_xid(GPU_A, 31)  # an application Xid the operator enabled
    wait_health(plugin, {GPU_A: {"Unhealthy"}, GPU_B: {"Healthy"}})


def test_a_gpu_recovers_after_the_quiet_period_and_a_new_xid_restarts_it(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node
) -> None:
    agent, plugin = run_agent(agents, kubelet, short_dir, node, "--health-recovery-seconds", "1.5")
    # Timed from the first Xid's emission, not from when the test saw its effect: a loaded machine may show it
    # late, and the second Xid must still fall within the first one's quiet period.
    first_xid = time.monotonic()
    node.driver.emit_xid(GPU_A, 48)
    wait_health(plugin, {GPU_A: {"Unhealthy"}, GPU_B: {"Healthy"}})
    time.sleep(max(0.0, first_xid + 0.8 - time.monotonic()))
    node.driver.emit_xid(GPU_A, 48)
    wait_health(plugin, HEALTHY, timeout=10)
    assert time.monotonic() - first_xid >= 0.8 + 1.5 - 0.2  # quiet since the second Xid
    agent.wait_log("gpu healthy again; its replicas are back")


def test_a_lost_gpu_is_unhealthy_until_it_answers_again(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node
) -> None:
    agent, plugin = run_agent(agents, kubelet, short_dir, node, "--health-recovery-seconds", "1")
    node.driver.lose(GPU_A)
    wait_health(plugin, {GPU_A: {"Unhealthy"}, GPU_B: {"Healthy"}})
    assert "lost" in str(agent.wait_log("gpu unhealthy; its replicas are withdrawn")["reason"])
    time.sleep(1.5)
    assert health(plugin)[GPU_A] == {"Unhealthy"}  # still lost: no recovery
    node.driver.find(GPU_A)
    wait_health(plugin, HEALTHY)


def test_a_failing_event_wait_makes_every_gpu_unhealthy_then_they_recover(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node
) -> None:
    _, plugin = run_agent(agents, kubelet, short_dir, node, "--health-recovery-seconds", "1")
    node.driver.fail_next_wait(999)
    wait_health(plugin, {GPU_A: {"Unhealthy"}, GPU_B: {"Unhealthy"}})
    wait_health(plugin, HEALTHY, timeout=10)


def test_disabling_all_health_checks_ignores_every_xid(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, node: Node
) -> None:
    agent, plugin = run_agent(agents, kubelet, short_dir, node, DP_DISABLE_HEALTHCHECKS="all")
    agent.wait_log("gpu health checks disabled")
    node.driver.emit_xid(GPU_A, 79)
    time.sleep(1)
    assert health(plugin) == HEALTHY


def test_a_malformed_xid_list_is_refused_with_the_variable_named(short_dir: Path) -> None:
    cfg = write_config(short_dir / "config.yaml", config())
    result = subprocess.run(
        [sys.executable, "-m", "mpsagent", "--config-file", str(cfg), "--once", "--node-snapshot", "x"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "DP_DISABLE_HEALTHCHECKS": "79;48"},
        check=False,
    )
    assert result.returncode == 2
    assert "DP_DISABLE_HEALTHCHECKS" in result.stderr and "`79;48`" in result.stderr
    assert "Traceback" not in result.stderr
