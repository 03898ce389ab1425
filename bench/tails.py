"""The agent's tails alone, in about two minutes: 1-replica Allocate against the floor in short alternating blocks
(the same grpcio client process, the same socket kind, which side goes first alternating too), then the idle CPU.

    .venv/bin/python bench/tails.py                        # 3,000 calls a side in blocks of 50, 60 s idle
    .venv/bin/python bench/tails.py --calls 2000 --idle 0  # the latency part only
    .venv/bin/python bench/tails.py --wakeups              # also: the agent's idle event-loop callbacks by source

Prints median and p99 for agent and floor, their ratios against the targets (issue 27: p99 at most 2x the floor's,
median at most 1.2x), and the idle CPU of the agent and its front-ends against 1 % of a core. `bench/run.py`
measures the same way inside its 8x48 node scenario; this script is for before/after comparisons of one change.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import scenarios
from agent import BenchNode
from client import allocate_request, cycle, stub_for, time_calls, timed
from floor import FloorProcess
from params import BASE
from stats import median, ms, percentile

from mpsagent_testing.processes import cpu_times, kill_processes_using, marked_env

WAKEUP_HOOK = Path(__file__).resolve().parent / "wakeup_hook"

TARGETS = {"p99": 2.0, "median": 1.2}
IDLE_TARGET_PCT = 1.0


def interleaved(
    agent_call: Callable[..., Any], floor_call: Callable[..., Any], requests: Sequence[Any], calls: int, block: int
) -> tuple[list[int], list[int]]:
    """`calls` round trips each, in blocks of `block`; the side that goes first alternates from block to block."""
    samples: tuple[list[int], list[int]] = ([], [])
    done = 0
    while done < calls:
        size = min(block, calls - done)
        batch = cycle(requests, size, offset=done)
        order = (0, 1) if (done // block) % 2 == 0 else (1, 0)
        for side in order:
            samples[side].extend(time_calls((agent_call, floor_call)[side], batch))
        done += size
    return samples


def read_report(path: Path) -> dict[str, float]:
    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.1)
    return json.loads(path.read_text()) if path.exists() else {}


def thread_switches(pid: int) -> dict[str, int]:
    """Context switches so far of each of the process's threads (a blocked thread's wake-ups), by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        name = fields["Name"].strip()
        out[f"{task.name} ({name})"] = int(fields["voluntary_ctxt_switches"]) + int(
            fields["nonvoluntary_ctxt_switches"]
        )
    return out


def _idle(pid: int, seconds: float, wakeups: bool, directory: Path) -> dict[str, Any]:
    """CPU of the agent and its front-ends (its waited-for children) over an idle window, and its wake-ups."""
    time.sleep(scenarios.SETTLE_S)
    if wakeups:
        os.kill(pid, signal.SIGUSR1)
    switches = thread_switches(pid)
    before, started = cpu_times(pid), time.monotonic()
    time.sleep(seconds)
    after, elapsed = cpu_times(pid), time.monotonic() - started
    own, children = after.own_s - before.own_s, after.children_s - before.children_s
    out: dict[str, Any] = {
        "idle_s": round(elapsed, 1),
        "idle_cpu_pct": (own + children) / elapsed * 100,
        "idle_cpu_agent_pct": own / elapsed * 100,
        "idle_cpu_frontends_pct": children / elapsed * 100,
        "thread_wakeups_per_s": {t: (n - switches.get(t, 0)) / elapsed for t, n in thread_switches(pid).items()},
    }
    if wakeups:
        os.kill(pid, signal.SIGUSR2)
        out["wakeups"] = read_report(directory / "wakeups-2.json")
    return out


def measure(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], list[int], list[int]]:
    result: dict[str, Any] = {"calls": args.calls, "block": args.block}
    with BenchNode(work / "t", BASE) as node:
        agent = node.start_agent()
        plugin, _ = node.wait_registered(agent)
        singles = [allocate_request([i]) for i in scenarios.spread_ids(BASE)]
        time.sleep(scenarios.SETTLE_S)
        _, response = timed(plugin.stub.Allocate, singles[0])
        with FloorProcess(node.directory / "floor.sock", {1: response.SerializeToString()}, marked_env(work)) as fl:
            channel, floor_stub = stub_for(fl.socket_path)
            try:
                time_calls(plugin.stub.Allocate, cycle(singles, args.warmup, offset=1))
                time_calls(floor_stub.Allocate, cycle(singles, args.warmup))
                if args.wakeups:
                    os.kill(agent.pid, signal.SIGUSR1)
                agent_ns, floor_ns = interleaved(
                    plugin.stub.Allocate, floor_stub.Allocate, singles, args.calls, args.block
                )
                if args.wakeups:
                    os.kill(agent.pid, signal.SIGUSR2)
                    result["busy_callbacks"] = read_report(node.directory / "wakeups-1.json")
            finally:
                channel.close()
        for name, ns in (("agent", agent_ns), ("floor", floor_ns)):
            result[f"{name}_median_ms"] = ms(median(ns))
            result[f"{name}_p99_ms"] = ms(percentile(ns, 99))
            result[f"{name}_p999_ms"] = ms(percentile(ns, 99.9))
            result[f"{name}_max_ms"] = ms(max(ns))
        for stat in ("median", "p99"):
            result[f"ratio_{stat}"] = result[f"agent_{stat}_ms"] / result[f"floor_{stat}_ms"]
        if args.idle > 0:
            result.update(_idle(agent.pid, args.idle, args.wakeups, node.directory))
    return result, agent_ns, floor_ns


def report(result: dict[str, Any]) -> None:
    print(f"Allocate 1 replica, {result['calls']} a side in alternating blocks of {result['block']}:")
    for stat in ("median", "p99"):
        agent_v, floor_v, ratio = result[f"agent_{stat}_ms"], result[f"floor_{stat}_ms"], result[f"ratio_{stat}"]
        verdict = "pass" if ratio <= TARGETS[stat] else "FAIL"
        print(
            f"  {stat:6}  agent {agent_v:.3f} ms  floor {floor_v:.3f} ms  ratio {ratio:.2f}x"
            f"  target <= {TARGETS[stat]}x  {verdict}"
        )
    print(
        f"  p99.9   agent {result['agent_p999_ms']:.3f} ms  floor {result['floor_p999_ms']:.3f} ms;"
        f"  max agent {result['agent_max_ms']:.2f} ms  floor {result['floor_max_ms']:.2f} ms"
    )
    if "idle_cpu_pct" in result:
        pct = result["idle_cpu_pct"]
        print(
            f"idle CPU over {result['idle_s']} s: {pct:.2f} % of a core (agent {result['idle_cpu_agent_pct']:.2f}"
            f", front-ends {result['idle_cpu_frontends_pct']:.2f}), target <= {IDLE_TARGET_PCT} %"
            f"  {'pass' if pct <= IDLE_TARGET_PCT else 'FAIL'}"
        )
        print("idle context switches per second, by thread of the agent:")
        for thread, rate in result["thread_wakeups_per_s"].items():
            print(f"  {rate:7.2f}/s  {thread}")
    for key, title in (("busy_callbacks", "while timed"), ("wakeups", "idle")):
        if key in result:
            print(f"event-loop callbacks per second {title}, by source:")
            for source, rate in result[key].items():
                print(f"  {rate:9.2f}  {source}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/tails.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per side")
    parser.add_argument("--block", type=int, default=50, help="calls per block")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of the idle window (0: none)")
    parser.add_argument(
        "--wakeups", action="store_true", help="count the agent's event-loop callbacks (bench/wakeup_hook)"
    )
    parser.add_argument("--json", type=Path, help="write the results and the samples here")
    args = parser.parse_args()
    if args.wakeups:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WAKEUP_HOOK), os.environ.get("PYTHONPATH")]))
    work = Path(tempfile.mkdtemp(prefix="mpt", dir="/tmp"))
    try:
        result, agent_ns, floor_ns = measure(args, work)
    finally:
        kill_processes_using(work)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        samples = {"agent_ms": [ms(s) for s in agent_ns], "floor_ms": [ms(s) for s in floor_ns]}
        args.json.write_text(json.dumps({**result, **samples}))
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
