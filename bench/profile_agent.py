"""Where the agent's time goes in one workload: py-spy samples the agent while the bench repeats the calls.

    .venv/bin/pip install py-spy        # not a dependency of mpsagent
    .venv/bin/python bench/profile_agent.py allocate --seconds 15
    .venv/bin/python bench/profile_agent.py preferred-1 --out /tmp/profile

Prints the functions with the largest share of the samples (inclusive and self) and leaves py-spy's collapsed
stacks (and a flame graph) in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent import BenchNode, NodeShape, replica_ids, spread_ids
from client import allocate_request, cycle, preferred_request
from params import BASE, SCALE

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = ("allocate", "full-grant", "preferred-1", "preferred-48", "preferred-768", "idle")


def _workload(name: str) -> tuple[NodeShape, Callable[[Any], list[tuple[Any, Any]]]]:
    """The node shape and, for a plugin stub, the (method, request) pairs to repeat."""
    if name == "allocate":
        singles = [allocate_request([i]) for i in spread_ids(BASE)]
        return BASE, lambda stub: [(stub.Allocate, r) for r in cycle(singles, len(singles))]
    if name == "idle":  # the stream is open, nothing is asked
        return BASE, lambda stub: []
    if name == "full-grant":
        return SCALE, lambda stub: [(stub.Allocate, allocate_request(replica_ids(SCALE)))]
    size = int(name.split("-")[1])
    request = preferred_request(replica_ids(SCALE), size)
    return SCALE, lambda stub: [(stub.GetPreferredAllocation, request)]


def _keep_calling(calls: list[tuple[Any, Any]], stop: threading.Event) -> None:
    if not calls:
        stop.wait()
    while not stop.is_set():
        for method, request in calls:
            method(request, timeout=30)


def summarize(collapsed: Path, top: int) -> str:
    """The functions with the most samples, inclusive and self, from py-spy's raw (collapsed) output."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue  # a frame py-spy read torn (its name broken across lines)
        count = int(count_text)
        frames = stack.split(";")
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
    lines = [f"{total} samples"]
    for title, counter in (("inclusive", inclusive), ("self", own)):
        lines.append(f"\n{title}:")
        lines += [f"{100 * n / total:5.1f}%  {frame}" for frame, n in counter.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/profile_agent.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--rate", type=int, default=500, help="samples per second")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "mpsagent-profile")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("needs py-spy: .venv/bin/pip install py-spy (it is not a dependency of mpsagent)")
    shape, calls_for = _workload(args.workload)
    args.out.mkdir(parents=True, exist_ok=True)
    collapsed = args.out / f"{args.workload}.txt"
    work = Path(tempfile.mkdtemp(prefix="mpb", dir="/tmp"))
    stop = threading.Event()
    try:
        with BenchNode(work / "p", shape) as node:
            agent = node.start_agent()
            plugin, _ = node.wait_registered(agent)
            worker = threading.Thread(target=_keep_calling, args=(calls_for(plugin.stub), stop), daemon=True)
            worker.start()
            time.sleep(1.0)  # warm
            for output, form in ((collapsed, "raw"), (args.out / f"{args.workload}.svg", "flamegraph")):
                record = [py_spy, "record", "-F", "-p", str(agent.pid), "-r", str(args.rate), "-d", str(args.seconds)]
                subprocess.run([*record, "-f", form, "-o", str(output), "--nonblocking"], check=True)
            stop.set()
            worker.join(35)
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    print(summarize(collapsed, args.top))
    print(f"\ncollapsed stacks and flame graph in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
