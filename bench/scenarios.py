"""The scenarios: each starts what it needs in its own node directory, measures, and ends everything it started.

Times are taken in the bench process (perf_counter_ns): the kubelet's side of every call and message.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import AgentProcess, BenchNode, replica_ids, spread_ids
from client import allocate_request, burst, cycle, preferred_request, stub_for, time_calls, timed
from floor import FloorProcess
from kubelet import all_health, updates_of, wait_message
from params import Params
from results import RunResults
from stats import median, median_ms, ms, p99_ms

from mpsagent_testing.kubelet.fake import Plugin, wait_for
from mpsagent_testing.processes import alive, cpu_times, marked_env, rss_bytes

MB = 1_000_000
HEALTH_TIMEOUT_S = 30.0
SETTLE_S = 1.0
REGISTERED = "registered with kubelet"


def _latency(out: RunResults, name: str, samples_ns: Sequence[int], *, keep: bool = False) -> None:
    out.metrics[f"{name}_median_ms"] = median_ms(samples_ns)
    out.metrics[f"{name}_p99_ms"] = p99_ms(samples_ns)
    out.counts[name] = len(samples_ns)
    if keep:
        out.samples_ms[name] = [ms(s) for s in samples_ns]


def _blocks(
    agent_call: Callable[..., Any],
    floor_call: Callable[..., Any],
    requests: Callable[[int], list[Any]],
    count: int,
    blocks: int,
) -> tuple[list[int], list[int]]:
    """`count` sequential round trips each to the agent and to the floor, in alternating blocks so that both
    meet the same noise (the side that goes first alternates too); `requests(n)` gives the next n requests."""
    agent_ns: list[int] = []
    floor_ns: list[int] = []
    for block in range(blocks):
        size = count // blocks + (block < count % blocks)
        batch = requests(size)
        sides = ((agent_call, agent_ns), (floor_call, floor_ns))
        for call, samples in sides if block % 2 == 0 else sides[::-1]:
            samples.extend(time_calls(call, batch))
    return agent_ns, floor_ns


# --- start-up -------------------------------------------------------------------------------------------------


def startup(params: Params, directory: Path) -> RunResults:
    """Process start to Register: with the daemon to start (cold), and with a running daemon to adopt."""
    cold: list[int] = []
    adopted: list[int] = []
    with BenchNode(directory / "startup", params.base) as node:
        for _ in range(params.startup_reps):
            first = node.start_agent(on_exit="keep")
            _, registered = node.wait_registered(first)
            cold.append(registered - first.started_ns)
            daemon = node.daemon_pid()
            first.stop()  # SIGTERM: the daemon stays, for the next agent to adopt
            second = node.start_agent(on_exit="quit")
            _, registered = node.wait_registered(second)
            adopted.append(registered - second.started_ns)
            if not any(e.get("event") == "mps daemon adopted" for e in second.log_events()):
                raise RuntimeError("the second agent did not adopt the running daemon")
            second.stop()  # quits the daemon: the next start is cold again
            wait_for(lambda d=daemon: not alive(d), 10.0, f"the MPS daemon {daemon} to quit")  # type: ignore[misc]
    out = RunResults()
    out.metrics["startup_adopt_ms"] = ms(median(adopted))
    out.metrics["startup_cold_ms"] = ms(median(cold))
    out.counts["startup"] = len(cold)
    return out


# --- the 8 x 48 node: Allocate against the floor, memory, bursts, cap-mode switches, health, idle -------------


@dataclass
class _Base:
    params: Params
    node: BenchNode
    agent: AgentProcess
    plugin: Plugin
    singles: list[Any]
    """one 1-replica request per replica, spread across the GPUs"""
    calls: int = 0
    """Allocate calls made so far"""

    def allocate(self, requests: Sequence[Any]) -> list[int]:
        self.calls += len(requests)
        return time_calls(self.plugin.stub.Allocate, requests)

    def next_singles(self, count: int) -> list[Any]:
        return cycle(self.singles, count, offset=self.calls)

    def take_singles(self, count: int) -> list[Any]:
        """The next requests, counted as made (for calls timed elsewhere)."""
        requests = self.next_singles(count)
        self.calls += count
        return requests


def base_node(params: Params, directory: Path) -> RunResults:
    out = RunResults()
    with BenchNode(directory / "base", params.base) as node:
        agent = node.start_agent()
        plugin, _ = node.wait_registered(agent)
        base = _Base(params, node, agent, plugin, [allocate_request([i]) for i in spread_ids(params.base)])
        time.sleep(SETTLE_S)
        out.metrics["rss_start_mb"] = rss_bytes(agent.pid) / MB
        _, response = timed(plugin.stub.Allocate, base.singles[0])
        base.calls += 1
        floor_env = marked_env(node.directory)
        with FloorProcess(node.directory / "floor.sock", {1: response.SerializeToString()}, floor_env) as floor:
            channel, floor_stub = stub_for(floor.socket_path)
            try:
                _against_floor(base, floor_stub, floor.pid, response.ByteSize(), out)
            finally:
                channel.close()
        _memory(base, out)
        _cap_mode_switches(base, out)
        _health(base, out)
        _reregistration(base, out)
        _idle(base, out)
    return out


def _against_floor(base: _Base, floor_stub: Any, floor_pid: int, response_size: int, out: RunResults) -> None:
    """1-replica Allocate, agent and floor in alternating blocks (so that both see the same noise); bursts."""
    params = base.params
    floor_answer = floor_stub.Allocate(base.singles[1], timeout=10)
    if floor_answer.ByteSize() != response_size:
        raise RuntimeError(f"the floor answers {floor_answer.ByteSize()} bytes, the agent {response_size}")
    base.allocate(base.next_singles(params.warmup_calls))
    time_calls(floor_stub.Allocate, cycle(base.singles, params.warmup_calls))
    agent_cpu, floor_cpu = cpu_times(base.agent.pid), cpu_times(floor_pid)
    agent_ns, floor_ns = _blocks(
        base.plugin.stub.Allocate, floor_stub.Allocate, base.take_singles, params.allocate_calls, params.blocks
    )
    agent_cpu_s = cpu_times(base.agent.pid).own_s - agent_cpu.own_s
    floor_cpu_s = cpu_times(floor_pid).own_s - floor_cpu.own_s
    out.metrics["cpu_per_allocate_agent_us"] = agent_cpu_s / len(agent_ns) * 1e6
    out.metrics["cpu_per_allocate_floor_us"] = floor_cpu_s / len(floor_ns) * 1e6
    out.metrics["cpu_per_allocate_ratio"] = agent_cpu_s / floor_cpu_s
    _latency(out, "allocate_agent", agent_ns, keep=True)
    _latency(out, "allocate_floor", floor_ns, keep=True)
    out.metrics["allocate_ratio_median"] = median(agent_ns) / median(floor_ns)
    out.metrics["allocate_ratio_p99"] = out.metrics["allocate_agent_p99_ms"] / out.metrics["allocate_floor_p99_ms"]
    out.metrics["response_bytes"] = response_size
    agent_bursts: list[int] = []
    floor_bursts: list[int] = []
    for index in range(params.bursts):
        requests = cycle(base.singles, params.burst_size, offset=index * params.burst_size)
        agent_bursts.append(burst(base.plugin.stub, requests))
        base.calls += len(requests)
        floor_bursts.append(burst(floor_stub, requests))
    _latency(out, "burst_agent", agent_bursts, keep=True)
    _latency(out, "burst_floor", floor_bursts, keep=True)
    out.counts["burst_size"] = params.burst_size


def _memory(base: _Base, out: RunResults) -> None:
    """RSS against Allocate calls, up to `memory_calls` in all."""
    pid = base.agent.pid
    warm_rss = rss_bytes(pid)
    series = [[float(base.calls), warm_rss / MB]]
    while base.calls < base.params.memory_calls:
        base.allocate(base.next_singles(min(1000, base.params.memory_calls - base.calls)))
        series.append([float(base.calls), rss_bytes(pid) / MB])
    out.metrics["rss_after_allocate_mb"] = series[-1][1]
    out.metrics["rss_growth_mb"] = series[-1][1] - warm_rss / MB
    out.counts["memory_calls"] = base.calls
    out.series["rss_mb_by_calls"] = series


def _cap_mode_switches(base: _Base, out: RunResults) -> None:
    """The daemon's cap mode follows the grants: the first capped grant after a full one (and back) waits for
    the daemon to take its new defaults, through one control front-end process per command."""
    full = allocate_request(replica_ids(base.params.base))
    to_full: list[int] = []
    to_capped: list[int] = []
    burst_switch: list[int] = []
    switches_before = _events(base.agent, "mps daemon caps set")
    for _ in range(base.params.switch_reps):
        to_full.append(base.allocate([full])[0])
        to_capped += base.allocate(base.next_singles(1))
        base.allocate([full])
        requests = base.next_singles(base.params.burst_size)
        burst_switch.append(burst(base.plugin.stub, requests))
        base.calls += len(requests)
    _latency(out, "switch_to_full", to_full)
    _latency(out, "switch_to_capped", to_capped)
    _latency(out, "burst_switch", burst_switch)
    out.counts["cap_mode_switches"] = _events(base.agent, "mps daemon caps set") - switches_before


def _events(agent: AgentProcess, event: str) -> int:
    return sum(1 for e in agent.log_events() if e.get("event") == event)


def _health(base: _Base, out: RunResults) -> None:
    """kill -9 of the daemon to the Unhealthy message at the kubelet; then the daemon is back and Healthy."""
    after_kill: list[int] = []
    after_detect: list[int] = []
    recovered: list[int] = []
    for _ in range(base.params.health_reps):
        daemon = base.node.daemon_pid()
        start = len(updates_of(base.plugin))
        killed = time.perf_counter_ns()
        os.kill(daemon, signal.SIGKILL)
        index, unhealthy = wait_message(base.plugin, start, all_health("Unhealthy"), HEALTH_TIMEOUT_S, "Unhealthy")
        _, healthy = wait_message(base.plugin, index + 1, all_health("Healthy"), HEALTH_TIMEOUT_S, "Healthy again")
        detected_wall = base.agent.log_time_ns("mps daemon exited", daemon)
        after_kill.append(unhealthy.ns - killed)
        after_detect.append(unhealthy.wall_ns - detected_wall)
        recovered.append(healthy.ns - killed)
    _latency(out, "unhealthy_after_kill", after_kill)
    out.metrics["unhealthy_after_detect_median_ms"] = ms(median(after_detect))
    out.metrics["unhealthy_after_detect_max_ms"] = ms(max(after_detect))
    out.metrics["healthy_again_median_ms"] = ms(median(recovered))
    out.counts["health"] = len(after_kill)


def _reregistration(base: _Base, out: RunResults) -> None:
    """The fake kubelet restarts (deleting every socket), immediately or after an outage: from its socket
    listening again to the agent's Register."""
    for outage in (0.0, *base.params.outages_s):
        samples = [_restart_kubelet(base, outage) for _ in range(base.params.rereg_reps)]
        name = "reregister" if outage == 0 else f"reregister_outage_{outage:g}s"
        out.metrics[f"{name}_ms"] = ms(median(samples))
        out.metrics[f"{name}_max_ms"] = ms(max(samples))
        out.counts[name] = len(samples)


def _restart_kubelet(base: _Base, outage_s: float) -> int:
    kubelet = base.node.kubelet
    registered = base.agent.count_events(REGISTERED)
    kubelet.stop()
    time.sleep(outage_s)
    before = time.perf_counter_ns()
    kubelet.start()
    registration = kubelet.registration_after(before, base.agent.endpoint_suffix, HEALTH_TIMEOUT_S)
    base.plugin = kubelet.plugin_for(base.agent.endpoint_suffix, HEALTH_TIMEOUT_S)
    # The next restart only once the agent has its answer: a restart while Register is in flight is another
    # scenario (the agent's plugin socket is gone, and it keeps registering it).
    wait_for(lambda: base.agent.count_events(REGISTERED) > registered, HEALTH_TIMEOUT_S, "the Register answer")
    return max(0, registration.ns - kubelet.listening_ns)


def _idle(base: _Base, out: RunResults) -> None:
    """CPU time over an idle window with the ListAndWatch stream open: the agent itself, the control front-ends
    it ran (its waited-for children: the 3 s daemon probe) and the daemon."""
    time.sleep(SETTLE_S)
    agent, daemon = base.agent.pid, base.node.daemon_pid()
    agent_before, daemon_before, started = cpu_times(agent), cpu_times(daemon), time.monotonic()
    time.sleep(base.params.idle_s)
    agent_after, daemon_after, elapsed = cpu_times(agent), cpu_times(daemon), time.monotonic() - started
    own = agent_after.own_s - agent_before.own_s
    children = agent_after.children_s - agent_before.children_s
    out.metrics["idle_cpu_pct"] = (own + children) / elapsed * 100
    out.metrics["idle_cpu_agent_pct"] = own / elapsed * 100
    out.metrics["idle_cpu_daemon_pct"] = (daemon_after.own_s - daemon_before.own_s) / elapsed * 100
    out.metrics["rss_idle_mb"] = rss_bytes(agent) / MB
    out.counts["idle_s"] = round(elapsed)


# --- the 16 x 48 node: the full grant and GetPreferredAllocation at scale --------------------------------------


def scale_node(params: Params, directory: Path) -> RunResults:
    """The full grant and GetPreferredAllocation of 1, one GPU's worth and every replica, all of them offered;
    the floor parses the same requests and sends answers of the same size."""
    out = RunResults()
    with BenchNode(directory / "scale", params.scale) as node:
        agent = node.start_agent()
        plugin, _ = node.wait_registered(agent)
        ids = replica_ids(params.scale)
        full = allocate_request(ids)
        _, response = timed(plugin.stub.Allocate, full)
        visible = response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]
        if len(visible.split(",")) != params.scale.gpus:
            raise RuntimeError(f"a full grant at {params.scale} sees {visible!r}")
        floor_env = marked_env(node.directory)
        with FloorProcess(node.directory / "floor.sock", {len(ids): response.SerializeToString()}, floor_env) as floor:
            channel, floor_stub = stub_for(floor.socket_path)
            try:
                _scale_calls(params, plugin.stub, floor_stub, ids, out)
            finally:
                channel.close()
        out.metrics["rss_scale_mb"] = rss_bytes(agent.pid) / MB
    return out


def _scale_calls(params: Params, stub: Any, floor_stub: Any, ids: list[str], out: RunResults) -> None:
    def timed_pair(agent_call: Callable[..., Any], floor_call: Callable[..., Any], request: Any) -> tuple[Any, Any]:
        warmup = max(5, params.scale_calls // 10)
        time_calls(agent_call, [request] * warmup)
        time_calls(floor_call, [request] * warmup)
        return _blocks(agent_call, floor_call, lambda n: [request] * n, params.scale_calls, params.blocks)

    agent_ns, floor_ns = timed_pair(stub.Allocate, floor_stub.Allocate, allocate_request(ids))
    _latency(out, "full_grant", agent_ns, keep=True)
    _latency(out, "full_grant_floor", floor_ns, keep=True)
    out.metrics["full_grant_ratio_median"] = median(agent_ns) / median(floor_ns)
    for size in (1, params.scale.replicas, len(ids)):
        request = preferred_request(ids, size)
        for call in (stub.GetPreferredAllocation, floor_stub.GetPreferredAllocation):
            chosen = call(request, timeout=10).container_responses[0].deviceIDs
            if len(chosen) != size:
                raise RuntimeError(f"GetPreferredAllocation of {size} chose {len(chosen)}")
        agent_ns, floor_ns = timed_pair(stub.GetPreferredAllocation, floor_stub.GetPreferredAllocation, request)
        _latency(out, f"preferred_{size}", agent_ns, keep=True)
        _latency(out, f"preferred_{size}_floor", floor_ns, keep=True)
