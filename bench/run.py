"""Benchmark the agent as a real process against the transport floor, at node scale.

    .venv/bin/python bench/run.py                     # full: 3 runs, a few minutes per run
    .venv/bin/python bench/run.py --quick             # short, what the tests run
    .venv/bin/python bench/run.py --json out.json --plot latency.png

Prints a table (the median of the runs for each metric, its target, pass or FAIL) and writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import scenarios
from agent import interrupt_on_sigterm
from machine import machine_info, source_info
from params import FULL, QUICK, Params
from report import aggregate, document, render_table, write_json
from results import RunResults

from mpsagent_testing.processes import kill_processes_using

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_JSON = ROOT / "bench" / "results" / "latest.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (seconds) that keeps the bench working")
    parser.add_argument("--repeat", type=int, help="runs; the table shows each metric's median (full 3, quick 1)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    parser.add_argument("--plot", type=Path, help="also draw the latency distributions into this PNG (matplotlib)")
    parser.add_argument("--work-dir", type=Path, help="short directory for sockets and MPS roots (default: new)")
    return parser.parse_args(argv)


def one_run(params: Params, directory: Path, number: int) -> RunResults:
    results = RunResults()
    for name, scenario in (
        ("start-up", scenarios.startup),
        (f"{params.base} node", scenarios.base_node),
        (f"{params.scale} node", scenarios.scale_node),
    ):
        started = time.monotonic()
        print(f"run {number}/{params.repeat}: {name} ...", end=" ", file=sys.stderr, flush=True)
        results.update(scenario(params, directory / f"r{number}"))
        print(f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = QUICK if args.quick else FULL
    if args.repeat is not None:
        if args.repeat < 1:
            raise SystemExit("--repeat must be at least 1")
        params = dataclasses.replace(params, repeat=args.repeat)
    interrupt_on_sigterm()
    own_dir = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="mpb", dir="/tmp")) if own_dir else args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    machine["source"] = source_info()
    started = time.monotonic()
    try:
        runs = [one_run(params, work, number) for number in range(1, params.repeat + 1)]
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        kill_processes_using(work)  # whatever a failed scenario left behind
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    machine["load_average_end"] = list(os.getloadavg())
    table = aggregate(params, runs)
    doc = document(params, runs, table, machine, time.monotonic() - started)
    write_json(args.json, doc)
    print(render_table(table))
    print(f"\n{params.mode} run, {params.repeat} run(s), {doc['duration_s']} s; results in {args.json}")
    if args.plot is not None:
        from bench.plot import plot  # noqa: PLC0415  (matplotlib only when asked for)

        plot(doc, args.plot)
        print(f"plot in {args.plot}")
    failed = [key for key, entry in table.items() if entry["pass"] is False]
    if failed:
        print(f"targets missed: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
