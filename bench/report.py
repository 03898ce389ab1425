"""The metric catalogue with the issue's targets, medians across runs, the table, the JSON document, the plot."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from params import Params
from results import RunResults
from stats import median


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    label: str
    unit: str
    target: float | None = None
    """the value must be at most this; None: reported, no target"""


def catalogue(params: Params) -> list[Metric]:
    base, scale = params.base, params.scale
    full_ids = scale.gpus * scale.replicas
    burst = params.burst_size
    metrics = [
        Metric("allocate_agent_median_ms", f"Allocate 1 replica, agent, median ({base})", "ms"),
        Metric("allocate_floor_median_ms", "Allocate 1 replica, floor, median", "ms"),
        Metric("allocate_ratio_median", "Allocate median, agent / floor", "x", 1.2),
        Metric("allocate_agent_p99_ms", "Allocate 1 replica, agent, p99", "ms", 3.0),
        Metric("allocate_floor_p99_ms", "Allocate 1 replica, floor, p99", "ms"),
        Metric("allocate_ratio_p99", "Allocate p99, agent / floor", "x", 2.0),
        Metric("full_grant_median_ms", f"Allocate full grant, {full_ids} IDs, median ({scale})", "ms", 10.0),
        Metric("full_grant_p99_ms", f"Allocate full grant, {full_ids} IDs, p99", "ms", 10.0),
        Metric("full_grant_floor_median_ms", f"Allocate {full_ids} IDs, floor, median", "ms"),
        Metric("full_grant_ratio_median", f"Allocate {full_ids} IDs median, agent / floor", "x", 1.5),
    ]
    for size, target in ((1, None), (scale.replicas, None), (full_ids, 5.0)):
        name = f"GetPreferredAllocation size {size} of {full_ids}"
        metrics.append(Metric(f"preferred_{size}_median_ms", f"{name}, median", "ms", target))
        metrics.append(Metric(f"preferred_{size}_p99_ms", f"{name}, p99", "ms", target))
        metrics.append(Metric(f"preferred_{size}_floor_median_ms", f"{name}, floor, median", "ms"))
    metrics += [
        Metric("burst_agent_median_ms", f"{burst} concurrent Allocate, last answer, median", "ms", 100.0),
        Metric("burst_agent_p99_ms", f"{burst} concurrent Allocate, last answer, p99", "ms", 100.0),
        Metric("burst_floor_median_ms", f"{burst} concurrent Allocate, floor, median", "ms"),
        Metric("switch_to_full_median_ms", "Allocate full grant that switches the daemon to full, median", "ms"),
        Metric("switch_to_capped_median_ms", "Allocate 1 replica that switches the daemon to capped, median", "ms"),
        Metric("burst_switch_median_ms", f"{burst} concurrent Allocate from full mode, median", "ms"),
        Metric("unhealthy_after_detect_median_ms", "daemon death seen -> Unhealthy at kubelet, median", "ms", 100.0),
        Metric("unhealthy_after_detect_max_ms", "daemon death seen -> Unhealthy at kubelet, max", "ms", 100.0),
        Metric("unhealthy_after_kill_median_ms", "kill -9 of the daemon -> Unhealthy at kubelet, median", "ms", 100.0),
        Metric("healthy_again_median_ms", "kill -9 of the daemon -> Healthy again, median", "ms"),
        Metric("reregister_ms", "kubelet socket back -> Register (immediate restart), median", "ms", 1000.0),
        Metric("reregister_max_ms", "kubelet socket back -> Register (immediate restart), max", "ms", 1000.0),
    ]
    for outage in params.outages_s:
        name = f"reregister_outage_{outage:g}s"
        metrics.append(Metric(f"{name}_ms", f"kubelet socket back -> Register ({outage:g} s away), median", "ms", 1e3))
        metrics.append(Metric(f"{name}_max_ms", f"kubelet socket back -> Register ({outage:g} s away), max", "ms", 1e3))
    metrics += [
        Metric("startup_adopt_ms", "process start -> Register, snapshot, daemon running", "ms", 1000.0),
        Metric("startup_cold_ms", "process start -> Register, snapshot, daemon to start", "ms"),
        Metric("rss_start_mb", f"RSS after start ({base})", "MB", 60.0),
        Metric("rss_after_allocate_mb", f"RSS after {params.memory_calls:,} Allocate calls", "MB", 60.0),
        Metric("rss_growth_mb", "RSS growth from warm to the last Allocate call", "MB", 1.0),
        Metric("rss_idle_mb", "RSS after the idle window", "MB", 60.0),
        Metric("rss_scale_mb", f"RSS after the {scale} calls", "MB", 60.0),
        Metric("cpu_per_allocate_agent_us", "CPU time per 1-replica Allocate, agent", "us"),
        Metric("cpu_per_allocate_floor_us", "CPU time per 1-replica Allocate, floor", "us"),
        Metric("cpu_per_allocate_ratio", "CPU time per Allocate, agent / floor", "x"),
        Metric("idle_cpu_pct", f"idle CPU, agent + its front-ends, over {params.idle_s:g} s", "% core", 1.0),
        Metric("idle_cpu_agent_pct", "idle CPU, agent process alone", "% core"),
        Metric("idle_cpu_daemon_pct", "idle CPU, the MPS control daemon", "% core"),
    ]
    return metrics


def aggregate(params: Params, runs: list[RunResults]) -> dict[str, dict[str, Any]]:
    """Each metric's median across runs, with the per-run values and the verdict against its target."""
    table: dict[str, dict[str, Any]] = {}
    for metric in catalogue(params):
        values = [run.metrics[metric.key] for run in runs]
        value = median(values)
        table[metric.key] = {
            "label": metric.label,
            "unit": metric.unit,
            "value": value,
            "runs": values,
            "target": metric.target,
            "pass": None if metric.target is None else value <= metric.target,
        }
    return table


def _fmt(value: float | None) -> str:
    """Three significant digits, no exponent."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) < 0.001:
        return "0"
    return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"


def table_rows(table: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for entry in table.values():
        verdict = {None: "", True: "pass", False: "FAIL"}[entry["pass"]]
        target = f"<= {_fmt(entry['target'])}" if entry["target"] is not None else ""
        spread = f"{_fmt(min(entry['runs']))}..{_fmt(max(entry['runs']))}" if len(entry["runs"]) > 1 else ""
        rows.append((entry["label"], f"{_fmt(entry['value'])} {entry['unit']}", spread, target, verdict))
    return rows


def render_table(table: dict[str, dict[str, Any]]) -> str:
    header = ("metric", "measured (median of runs)", "runs", "target", "")
    rows = [header, *table_rows(table)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(table: dict[str, dict[str, Any]]) -> str:
    lines = ["| metric | measured | runs | target | |", "|---|---:|---:|---:|---|"]
    lines += [f"| {' | '.join(row)} |" for row in table_rows(table)]
    return "\n".join(lines)


def document(
    params: Params,
    runs: list[RunResults],
    table: dict[str, dict[str, Any]],
    machine: dict[str, Any],
    duration_s: float,
) -> dict[str, Any]:
    return {
        "schema": 1,
        "mode": params.mode,
        "params": params.as_dict(),
        "machine": machine,
        "duration_s": round(duration_s, 1),
        "metrics": table,
        "runs": [{"metrics": r.metrics, "counts": r.counts, "series": r.series} for r in runs],
        "samples_ms": {name: [s for r in runs for s in r.samples_ms.get(name, [])] for name in runs[0].samples_ms},
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
