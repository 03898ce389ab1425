"""Endurance: 50 kubelet restarts, 20 daemon kills and 10,000 Allocate calls against one agent process, then
the agent must still be whole: registered, its daemon back, no more file descriptors or tasks than after warm-up,
and every grant it ever made accounted for in its ledger."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from mpsagent.publisher import STATUS_INTERVAL_S
from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.mps.daemon import daemon_pid, require_real_control
from mpsagent_testing.node import ALL, RESOURCE

require_real_control()  # the agents these tests start run the real MPS control daemon

KUBELET_RESTARTS = 50
DAEMON_KILLS = 20
ALLOCATIONS = 10_000
PER_ROUND = ALLOCATIONS // KUBELET_RESTARTS


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def status(short_dir: Path) -> dict:
    return json.loads((short_dir / "mps" / "status.json").read_text())


def all_healthy(plugin: Plugin) -> bool:
    latest = plugin.latest()
    return len(latest) == len(ALL) and all(health == "Healthy" for _, health, _ in latest)


def settle(short_dir: Path, granted: int) -> dict:
    """The status once the agent is idle: it has recorded every grant, is registered, its daemon is up, and its
    task count holds still across several rewrites of the status file."""
    previous: list[int] = []

    def steady() -> dict | None:
        time.sleep(STATUS_INTERVAL_S)
        document = status(short_dir)
        resource = document["resources"][0]
        if sum(resource["ledger"]["allocated"].values()) != granted:
            return None
        previous.append(document["tasks"])
        quiet = len(previous) >= 3 and len(set(previous[-3:])) == 1
        return document if quiet and resource["registered"] and resource["daemon"]["up"] else None

    return wait_for(steady, 20, "the agent to settle")


@pytest.mark.slow
def test_fifty_kubelet_restarts_twenty_daemon_kills_ten_thousand_allocations(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir)
    pid = agent.process.pid
    plugin = kubelet.wait_registered(RESOURCE)
    granted = 0
    for i in range(PER_ROUND):
        allocate(plugin, [ALL[i % len(ALL)]])
        granted += 1
    baseline = settle(short_dir, granted)
    baseline_fds, baseline_threads = open_fds(pid), threads(pid)

    for round_ in range(KUBELET_RESTARTS):
        kubelet.restart()
        plugin = kubelet.wait_registered(RESOURCE, timeout=10)  # registered again, every time
        if round_ < DAEMON_KILLS:
            seen = len(plugin.updates)
            os.kill(daemon_pid(short_dir), signal.SIGKILL)
            wait_for(
                lambda p=plugin, n=seen: any(h == "Unhealthy" for u in p.updates[n:] for _, h, _ in u),
                15,
                f"unhealthy after kill {round_ + 1}",
            )
            wait_for(lambda p=plugin: all_healthy(p), 15, f"healthy again after kill {round_ + 1}")
        for i in range(PER_ROUND):
            response = allocate(plugin, [ALL[(round_ + i) % len(ALL)]])
            assert len(response.container_responses) == 1
            granted += 1

    assert granted == ALLOCATIONS + PER_ROUND
    final = settle(short_dir, granted)
    resource = final["resources"][0]
    assert resource["daemon"]["restarts"] == DAEMON_KILLS
    assert all_healthy(plugin)
    # No growth: what the agent holds after all this is what it held after warm-up (a little slack for the
    # gRPC connection the kubelet happens to have open at that moment).
    assert open_fds(pid) <= baseline_fds + 3, (open_fds(pid), baseline_fds)
    assert threads(pid) <= baseline_threads + 2
    assert final["tasks"] <= baseline["tasks"] + 2, (final["tasks"], baseline["tasks"])
    # Every grant accounted for: made = still live + ended by a later grant of its replicas + released.
    ledger = resource["ledger"]
    made = sum(ledger["allocated"].values()) + ledger["adopted"]
    assert made == sum(ledger["live"].values()) + ledger["superseded"] + ledger["released"]
    assert len(resource["grants"]) == sum(ledger["live"].values()) <= len(ALL)
    assert agent.stop() == 0
