"""`bench/run.py --quick` keeps working: it ends every process it started and reports every metric with a sane
value. The performance targets are the benchmark's business, not this test's."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.plot import plot
from tests.conftest import ROOT
from tests.processes import processes_using

QUICK_TIMEOUT_S = 150

if shutil.which("nvidia-cuda-mps-control") is None:
    if os.environ.get("CI"):
        raise RuntimeError("nvidia-cuda-mps-control is missing in CI: scripts/install-system-deps.sh installs it")
    pytest.skip("nvidia-cuda-mps-control not installed (run scripts/install-system-deps.sh)", allow_module_level=True)

# Metrics whose value is a time, a size or a ratio: always above zero.
POSITIVE = (
    "allocate_agent_median_ms",
    "allocate_agent_p99_ms",
    "allocate_floor_median_ms",
    "allocate_floor_p99_ms",
    "allocate_ratio_median",
    "allocate_ratio_p99",
    "full_grant_median_ms",
    "full_grant_p99_ms",
    "preferred_1_median_ms",
    "preferred_1_p99_ms",
    "preferred_48_median_ms",
    "preferred_48_p99_ms",
    "preferred_768_median_ms",
    "preferred_768_p99_ms",
    "burst_agent_median_ms",
    "burst_agent_p99_ms",
    "burst_floor_median_ms",
    "switch_to_full_median_ms",
    "switch_to_capped_median_ms",
    "burst_switch_median_ms",
    "unhealthy_after_kill_median_ms",
    "unhealthy_after_detect_median_ms",
    "unhealthy_after_detect_max_ms",
    "healthy_again_median_ms",
    "reregister_ms",
    "reregister_max_ms",
    "startup_adopt_ms",
    "startup_cold_ms",
    "rss_start_mb",
    "rss_after_allocate_mb",
    "rss_idle_mb",
    "rss_scale_mb",
    "cpu_per_allocate_agent_us",
    "cpu_per_allocate_floor_us",
    "cpu_per_allocate_ratio",
)
# Idle CPU can round to zero ticks; RSS can shrink.
FINITE = ("idle_cpu_pct", "idle_cpu_agent_pct", "idle_cpu_daemon_pct", "rss_growth_mb")


def run_quick(out: Path, work_dir: Path) -> str:
    command = [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--json", str(out)]
    process = subprocess.Popen(
        [*command, "--work-dir", str(work_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT
    )
    try:
        output, _ = process.communicate(timeout=QUICK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # the bench ends what it started, then exits
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        pytest.fail(f"bench/run.py --quick ran over {QUICK_TIMEOUT_S} s:\n{output.decode(errors='replace')}")
    text = output.decode(errors="replace")
    assert process.returncode == 0, text
    return text


@pytest.mark.slow
@pytest.mark.timeout(QUICK_TIMEOUT_S + 60)
def test_quick_bench_reports_every_metric_and_leaves_nothing_running(short_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    text = run_quick(out, short_dir / "w")
    assert processes_using(short_dir) == [], "the bench left agents or MPS daemons running"
    doc = json.loads(out.read_text())
    params, metrics = doc["params"], doc["metrics"]
    assert doc["mode"] == "quick" and params["repeat"] == 1
    assert set(POSITIVE) | set(FINITE) <= set(metrics)
    for key, entry in metrics.items():
        assert entry["label"] in text, key
        assert len(entry["runs"]) == 1 and math.isfinite(entry["value"]), key
        assert entry["value"] > 0 if key in POSITIVE else entry["value"] >= 0 or key == "rss_growth_mb", key
        assert entry["pass"] in (None, True, False), key
    for outage in params["outages_s"]:
        assert metrics[f"reregister_outage_{outage:g}s_ms"]["value"] >= 0
    for name in ("allocate_agent", "allocate_floor", "burst_agent", "full_grant", "preferred_1", "preferred_768"):
        assert metrics[f"{name}_p99_ms"]["value"] >= metrics[f"{name}_median_ms"]["value"] > 0, name
    assert metrics["allocate_ratio_median"]["value"] == pytest.approx(
        metrics["allocate_agent_median_ms"]["value"] / metrics["allocate_floor_median_ms"]["value"]
    )

    counts = doc["runs"][0]["counts"]
    assert counts["allocate_agent"] == counts["allocate_floor"] == params["allocate_calls"]
    assert counts["burst_agent"] == counts["burst_floor"] == params["bursts"]
    assert counts["burst_size"] == params["burst_size"] == 48
    assert counts["memory_calls"] >= params["memory_calls"]
    # Full, capped, full, capped each round; proportional ceilings also move when a burst first reaches a GPU.
    assert counts["cap_mode_switches"] >= 4 * params["switch_reps"]
    assert counts["health"] == params["health_reps"]
    assert counts["startup"] == params["startup_reps"]
    assert counts["reregister"] == params["rereg_reps"]
    for name in ("full_grant", "preferred_1", "preferred_48", "preferred_768"):
        assert counts[name] == params["scale_calls"], name
    for name, samples in doc["samples_ms"].items():
        assert len(samples) == counts[name] and min(samples) > 0, name
    rss = doc["runs"][0]["series"]["rss_mb_by_calls"]
    assert rss[-1][0] >= params["memory_calls"] and all(mb > 0 for _, mb in rss)
    assert {"cpu_model", "cpus", "kernel", "python", "packages"} <= set(doc["machine"])
    assert {"grpclib", "betterproto2", "grpcio"} <= set(doc["machine"]["packages"])

    if importlib.util.find_spec("matplotlib") is not None:
        plot(doc, tmp_path / "latency.png")
        assert (tmp_path / "latency.png").stat().st_size > 0
