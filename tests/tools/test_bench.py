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
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx2
import pytest
from lightkube import Client, KubeConfig
from lightkube.config.models import Cluster, User

from bench.dra_prepare import (
    GRPC_SECONDS,
    PREPARE,
    Histogram,
    daemon_sessions,
    histogram,
    log_breakdown,
    paired_median,
    parse_metrics,
    prepare_split,
)
from bench.plot import plot
from mpsagent_testing.cluster.noop_dra import NoopDra
from mpsagent_testing.kubelet.stubs import dra_pb2
from mpsagent_testing.node import small_node
from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.processes import processes_using
from mpsagent_testing.repo import ROOT

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
    "full_grant_ratio_median",
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


# --- bench/gpu_share.py: the sharing bench, without a GPU ------------------------------------------------------

GPU_SHARE = ROOT / "bench" / "gpu_share.py"
FAKE_TORCH = ROOT / "mpsagent_testing" / "cuda_torch"
GIB = 1024**3
# Exact shares (docs/cap-model.md): a quarter of 140 GiB is 35840 MiB, which reads back `35G`.
QUARTER = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=35840M"}
HALF = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=71680M"}


def run_gpu_share(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GPU_SHARE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_gpu_share_dry_run_prints_the_plan_and_the_caps_each_client_gets(short_dir: Path) -> None:
    plan = run_gpu_share("--dry-run", env={**os.environ, "GPU_SHARE_TEST": str(short_dir)})
    assert plan.returncode == 0, plan.stderr
    for row in ("| E | one client, no MPS | none | no |", "| P3 | one 2-of-4 client next to two 1-of-4 clients"):
        assert row in plan.stdout
    assert "grants: proportional" in plan.stdout and "36 s of measuring" in plan.stdout

    node = small_node(short_dir / "node.json", gpus=1, memory_bytes=140 * GIB)
    done = run_gpu_share(
        "--dry-run", "--node-snapshot", str(node), env={**os.environ, "GPU_SHARE_TEST": str(short_dir)}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    caps = {
        line.split(": ", 1)[0]: line.split(": ", 1)[1]
        for line in done.stdout.splitlines()
        if line.startswith(("M1: ", "M4: ", "P2: ", "P3: "))
    }
    assert caps["M1"] == json.dumps([QUARTER]) + "; daemon threads 25.0, memory 35G"
    assert caps["M4"] == json.dumps([QUARTER] * 4) + "; daemon threads 25.0, memory 35G"
    assert caps["P2"] == json.dumps([HALF]) + "; daemon threads 50.0, memory 70G"
    # Next to two quarter grants the half grant keeps its caps, and the daemon's ceilings are the largest share.
    assert caps["P3"] == json.dumps([HALF, QUARTER, QUARTER]) + "; daemon threads 50.0, memory 70G"
    assert processes_using(short_dir) == []


def test_gpu_share_runs_every_case_against_fake_nvml_and_a_stand_in_torch(
    short_dir: Path, fake_nvml_library: Path
) -> None:
    """The whole GPU path: the agent on a fake NVML, clients on a stand-in torch whose SM count follows the thread
    cap (mpsagent_testing/cuda_torch), all released together; the table and the JSON have every run and size."""
    nvml_config = short_dir / "nvml.json"
    gpu = {"uuid": "GPU-0000c0de-0000-0000-0000-000000000000", "name": "Fake H200", "memoryTotal": 140 * GIB}
    nvml_config.write_text(json.dumps({"gpus": [gpu | {"major": 9, "minor": 0}]}))
    env = fake_nvml_env(fake_nvml_library, nvml_config, short_dir / "nvml-state.json")
    env["PYTHONPATH"] = os.pathsep.join((str(ROOT), str(FAKE_TORCH)))
    env["GPU_SHARE_TEST"] = str(short_dir)
    out = short_dir / "out"
    done = run_gpu_share("--sizes", "256,512", "--seconds", "0.5", "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((out / "gpu-share.json").read_text())
    assert [(r["run"], r["n"]) for r in rows] == [
        (run, n) for run in ("E", "T", "M1", "M4", "P2", "P3") for n in (256, 512)
    ]
    seen = {r["run"]: [c["sms"] for c in r["clients"]] for r in rows}
    assert seen == {"E": [132], "T": [132] * 4, "M1": [33], "M4": [33] * 4, "P2": [66], "P3": [66, 33, 33]}
    p3 = next(r for r in rows if r["run"] == "P3" and r["n"] == 512)
    half, quarter = p3["clients"][0]["stepTimes"]["p50Ms"], p3["clients"][1]["stepTimes"]["p50Ms"]
    assert half < quarter  # the 2/4 client's steps are shorter: it has twice the SMs
    table = (out / "gpu-share.md").read_text()
    assert table.startswith("| run | n | clients | grants | aggregate TFLOP/s |") and table in done.stdout
    assert "| P3 | 512 | 3 | 2/4, 1/4, 1/4 |" in table
    assert "daemon threads 50.0, memory 70G" in done.stderr
    assert processes_using(short_dir) == []
    assert json.loads((short_dir / "nvml-state.json").read_text())["computeModes"] == {gpu["uuid"]: 0}


def test_gpu_share_refuses_without_torch_and_bad_sizes(short_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    missing = run_gpu_share("--client-python", sys.executable, env=env)
    if importlib.util.find_spec("torch") is None:
        assert missing.returncode == 2
        assert "has no PyTorch with CUDA (the clients need it): pass --client-python" in missing.stderr
    bad = run_gpu_share("--sizes", "1024,x", env=env)
    assert bad.returncode == 2 and "--sizes: not a comma-separated list of integers: '1024,x'" in bad.stderr
    assert "Traceback" not in missing.stderr + bad.stderr


# --- bench/dra_prepare.py: its pure parts, without the node ----------------------------------------------------


def _series(driver: str, code: str, *, total: float, count: int, buckets: dict[str, int]) -> list[str]:
    labels = f'driver_name="{driver}",grpc_status_code="{code}",method_name="{PREPARE}"'
    name = "dra_grpc_operations_duration_seconds"
    return [
        *(f'{name}_bucket{{{labels},le="{le}"}} {n}' for le, n in buckets.items()),
        f"{name}_sum{{{labels}}} {total}",
        f"{name}_count{{{labels}}} {count}",
    ]


KUBELET_METRICS_TEXT = "\n".join(
    [
        "# HELP dra_grpc_operations_duration_seconds [ALPHA] Duration in seconds of the DRA gRPC operations",
        "# TYPE dra_grpc_operations_duration_seconds histogram",
        *_series("mps.mpsagent.io", "OK", total=0.4, count=4, buckets={"0.1": 3, "0.5": 4, "+Inf": 4}),
        *_series("mps.mpsagent.io", "Unavailable", total=0.01, count=1, buckets={"0.1": 1, "0.5": 1, "+Inf": 1}),
        *_series("noop.example.com", "OK", total=0.003, count=2, buckets={}),
        'label_with_escapes{text="a \\"quoted\\" word, and a } brace"} 7',
    ]
)


def test_dra_prepare_reads_the_kubelets_histograms_and_their_deltas() -> None:
    samples = parse_metrics(KUBELET_METRICS_TEXT)
    assert samples[("label_with_escapes", frozenset({("text", 'a "quoted" word, and a } brace')}))] == 7
    agent = histogram(samples, GRPC_SECONDS, driver_name="mps.mpsagent.io", method_name=PREPARE)
    assert (agent.sum, agent.count) == (pytest.approx(0.41), 5), "the series of every status code, added up"
    assert dict(agent.buckets) == {0.1: 4, 0.5: 5, math.inf: 5}
    noop = histogram(samples, GRPC_SECONDS, driver_name="noop.example.com", method_name=PREPARE)
    assert noop.mean == pytest.approx(0.0015) and not noop.buckets

    before = Histogram(0.11, 2, {0.1: 2, 0.5: 2, math.inf: 2})
    delta = agent - before
    assert (delta.sum, delta.count, delta.mean) == (pytest.approx(0.3), 3, pytest.approx(0.1))
    assert dict(delta.buckets) == {0.1: 2, 0.5: 3, math.inf: 3}
    assert delta.quantile_bucket(0.5) == (0.0, 0.1), "the median lies in the first bucket"
    assert delta.quantile(0.5) == pytest.approx(0.075), "linear inside it: 1.5 of its 2 observations"
    assert delta.quantile_bucket(0.9) == (0.1, 0.5)
    assert Histogram().mean is None and Histogram().quantile(0.5) is None
    assert Histogram(1.0, 1, {0.1: 0, math.inf: 1}).quantile(0.5) == 0.1, "in +Inf: its lower bound"


def test_dra_prepare_splits_the_agents_prepare_by_its_log_and_the_daemons() -> None:
    t0 = datetime(2026, 12, 2, 0, 25, 40, 600000, tzinfo=UTC)

    def agent_line(event: str, at: datetime, **extra: str) -> str:
        stamp = at.isoformat().replace("+00:00", "Z")
        return json.dumps({"event": event, "level": "info", "timestamp": stamp, **extra})

    def control_line(at: datetime, text: str) -> str:
        return f"[{at.astimezone().strftime('%Y-%m-%d %H:%M:%S.%f')[:-3]} Control 11739] {text}"

    ms = timedelta(milliseconds=1)
    agent_log = [
        "not json",
        agent_line("mps daemon caps set", t0 + 20 * ms),
        agent_line("claim prepared", t0 + 23 * ms, claim_uid="u1"),
        agent_line("mps daemon caps set", t0 + 500 * ms),
        agent_line("claim unprepared", t0 + 502 * ms),
        agent_line("claim prepared", t0 + 900 * ms, claim_uid="u2"),  # the ceilings did not move: no caps line
    ]
    control_log = [
        control_line(t0 - 50 * ms, "Accepting connection..."),
        control_line(t0 - 50 * ms, "Cmd:get_default_active_thread_percentage"),
        control_line(t0 + 8 * ms, "Accepting connection..."),
        control_line(t0 + 8 * ms, "NEW UI"),
        control_line(t0 + 8 * ms, "Cmd:set_default_active_thread_percentage 10"),
        control_line(t0 + 14 * ms, "Accepting connection..."),
        control_line(t0 + 14 * ms, "Cmd:get_server_list"),
    ]
    breakdown = log_breakdown(agent_log)
    assert [(b["claim_uid"], b["after_caps_s"]) for b in breakdown] == [("u1", pytest.approx(0.003)), ("u2", None)]
    sessions = daemon_sessions(control_log)
    assert [sent for _, sent in sessions] == [
        ["get_default_active_thread_percentage"],
        ["set_default_active_thread_percentage 10"],
        ["get_server_list"],
    ]
    # The agent's metric says the first prepare took 23 ms: it began at t0.
    (split,) = prepare_split(breakdown, [0.023, 0.004], sessions)
    assert split == {
        "before_daemon_s": pytest.approx(0.008),
        "daemon_s": pytest.approx(0.012),
        "after_caps_s": pytest.approx(0.003),
    }
    assert paired_median([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == 3.0
    assert paired_median([1.0], []) is None


# --- bench/ceiling_restore.py: how fast a changed ceiling is restored -------------------------------------------


def test_ceiling_restore_bench_counts_every_change_it_makes_as_seen_in_the_log() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ceiling_restore.py"), "--changes", "4", "--idle-seconds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ceiling changes: 4, counted 4 (4 seen in the log)" in done.stdout
    assert "restored after (s, the daemon's clock): min " in done.stdout
    assert "idle 1 s (probe interval 3 s): this process " in done.stdout


# --- the do-nothing DRA plugin the prepare bench compares with ---------------------------------------------------


def test_the_noop_dra_plugin_that_reads_claims_answers_each_as_the_api_server_has_it() -> None:
    claims = {
        "allocated": {"uid": "u-1", "status": {"allocation": {"devices": {"results": []}}}},
        "moved": {"uid": "u-other", "status": {"allocation": {"devices": {"results": []}}}},
        "pending": {"uid": "u-3", "status": {}},
    }
    asked: list[str] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        asked.append(request.url.path)
        name = request.url.path.rsplit("/", 1)[1]
        found = claims[name]
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "ns", "uid": found["uid"]},
            "spec": {},
            "status": found["status"],
        }
        return httpx2.Response(200, json=body)

    config = KubeConfig.from_one(cluster=Cluster(server="https://k8s.test:6443"), user=User(token="t0ken"))
    request = dra_pb2.NodePrepareResourcesRequest(
        claims=[dra_pb2.Claim(namespace="ns", name=name, uid=f"u-{i}") for i, name in enumerate(claims, start=1)]
    )

    reading = NoopDra("node-a", Client(config, transport=httpx2.MockTransport(answer)))
    answers = reading.NodePrepareResources(request, None).claims
    assert asked == [f"/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/{name}" for name in claims]
    assert [d.device_name for d in answers["u-1"].devices] == ["gpu-0"] and not answers["u-1"].error
    assert answers["u-2"].error == "claim ns/moved has another UID than u-2" and not answers["u-2"].devices
    assert answers["u-3"].error == "claim ns/pending is not allocated"

    asked.clear()
    answers = NoopDra("node-a").NodePrepareResources(request, None).claims
    assert asked == [] and all(len(a.devices) == 1 and not a.error for a in answers.values())
