"""Endurance: 50 kubelet restarts, 20 daemon kills and 10,000 Allocate calls against one agent process, while
2,000 idle and 200 slow HTTP clients hold connections to its metrics port open (re-opening each one it closes) and
its descriptor limit is systemd's default soft limit of 1,024. Then the agent must still be whole: registered, its
daemon back, no daemon restart but the 20 it was forced to, no more file descriptors or tasks than after warm-up
(beyond the HTTP connection cap), and every grant it ever made accounted for in its ledger."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mpsagent.supervisor.publisher import STATUS_INTERVAL_S
from mpsagent.web import HTTP_LIMITS
from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.mps.daemon import daemon_pid, require_real_control
from mpsagent_testing.node import ALL, RESOURCE
from mpsagent_testing.processes import open_fds, threads
from mpsagent_testing.repo import ROOT

require_real_control()  # the agents these tests start run the real MPS control daemon

KUBELET_RESTARTS = 50
DAEMON_KILLS = 20
ALLOCATIONS = 10_000
PER_ROUND = ALLOCATIONS // KUBELET_RESTARTS
IDLE_HTTP_CLIENTS = 2_000
SLOW_HTTP_CLIENTS = 200
SYSTEMD_DEFAULT_NOFILE = 1024


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


@contextmanager
def http_flood(address: str, idle: int, slow: int) -> Iterator[dict]:
    """The flood of `mpsagent_testing.http_clients` in a process of its own; yields its statistics once stopped."""
    host, _, port = address.rpartition(":")
    statistics: dict = {}
    flood = subprocess.Popen(
        [sys.executable, "-m", "mpsagent_testing.http_clients", host, port, str(idle), str(slow)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        yield statistics
    finally:
        flood.terminate()
        out, _ = flood.communicate(timeout=30)
        statistics.update(json.loads(out), returncode=flood.returncode)


@pytest.mark.slow
def test_fifty_kubelet_restarts_twenty_daemon_kills_ten_thousand_allocations(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir, "--metrics-address", "127.0.0.1:0")
    pid = agent.process.pid
    # What a unit without LimitNOFILE gets: without bounds on HTTP connections, the flood exhausts it.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (SYSTEMD_DEFAULT_NOFILE, hard))
    address = agent.wait_log("http endpoint serving")["address"]
    plugin = kubelet.wait_registered(RESOURCE)
    granted = 0
    for i in range(PER_ROUND):
        allocate(plugin, [ALL[i % len(ALL)]])
        granted += 1
    baseline = settle(short_dir, granted)
    baseline_fds, baseline_threads = open_fds(pid), threads(pid)
    with http_flood(str(address), IDLE_HTTP_CLIENTS, SLOW_HTTP_CLIENTS) as flood:
        plugin, granted, last_daemon = rounds(kubelet, short_dir, plugin, granted)
        assert daemon_pid(short_dir) == last_daemon  # through 30 rounds of the flood without a kill
        # Waited for, not read once: a read-back round's front-end (a child with three pipes and, on Python 3.11,
        # a thread that waits for it) may be in flight at any one count; what grew for good stays.
        wait_for(lambda: open_fds(pid) <= baseline_fds + HTTP_LIMITS.connections + 3, 5, "fds within the cap")
        wait_for(lambda: threads(pid) <= baseline_threads + 2, 5, "threads as after warm-up")
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:  # a scrape, amid it all
            closed = {
                s.labels["reason"]: s.value
                for family in text_string_to_metric_families(response.read().decode())
                for s in family.samples
                if s.name == "mpsagent_http_connections_closed_total"
            }
    # The flood held more connections open than the agent has descriptors, and kept re-opening those the agent
    # closed (the cap closes the oldest first, faster than the request timeout would).
    assert flood["returncode"] == 0, flood
    assert flood["most_held"] > SYSTEMD_DEFAULT_NOFILE, flood
    assert flood["connections"] > IDLE_HTTP_CLIENTS + SLOW_HTTP_CLIENTS, flood
    assert closed["cap"] > HTTP_LIMITS.connections, closed

    # Connections the flood opened last may reach the agent a moment after it stopped; each ends within the
    # request timeout.
    wait_for(lambda: open_fds(pid) <= baseline_fds + 3, HTTP_LIMITS.request_timeout_s + 5, "the flood's last closed")

    assert granted == ALLOCATIONS + PER_ROUND
    final = settle(short_dir, granted)
    resource_ = final["resources"][0]
    # No daemon restart but the forced ones: the agent's own limits never cost its clients their daemon.
    assert resource_["daemon"]["restarts"] == DAEMON_KILLS
    assert daemon_pid(short_dir) == last_daemon
    assert "Too many open files" not in agent.log()
    assert all_healthy(plugin)
    # No growth: what the agent holds after all this is what it held after warm-up (a little slack for the
    # gRPC connection the kubelet happens to have open at that moment, and for a scrape thread).
    wait_for(lambda: open_fds(pid) <= baseline_fds + 3, 5, "fds as after warm-up")
    wait_for(lambda: threads(pid) <= baseline_threads + 2 + HTTP_LIMITS.threads, 5, "threads as after warm-up")
    assert final["tasks"] <= baseline["tasks"] + 2, (final["tasks"], baseline["tasks"])
    # Every grant accounted for: made = still live + ended by a later grant of its replicas + released.
    ledger = resource_["ledger"]
    made = sum(ledger["allocated"].values()) + ledger["adopted"]
    assert made == sum(ledger["live"].values()) + ledger["superseded"] + ledger["released"]
    assert len(resource_["grants"]) == sum(ledger["live"].values()) <= len(ALL)
    assert agent.stop() == 0


def rounds(kubelet: FakeKubelet, short_dir: Path, plugin: Plugin, granted: int) -> tuple[Plugin, int, int]:
    """The kubelet restarts, daemon kills and Allocate calls; the plugin, the grants made, and the PID of the
    daemon that the last kill left (which must then serve to the end)."""
    last_daemon = 0
    for round_ in range(KUBELET_RESTARTS):
        if round_ == DAEMON_KILLS:
            last_daemon = daemon_pid(short_dir)
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
    return plugin, granted, last_daemon
