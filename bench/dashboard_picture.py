"""A picture of the Grafana dashboard over a real run: the agent on the project's node (`--dra on`, two fake 80 GiB
GPUs, `nvidia.com/gpu` with replicas 4, the real MPS control daemon) under a load of device-plugin pods and DRA
claim pods coming and going, and one ceiling changed behind the agent, scraped every 5 s by a real Prometheus
(Debian's `prometheus`); then every panel's queries (packaging/dashboard.py) are read back from Prometheus over the
run and drawn in the dashboard's rows (matplotlib: `.venv/bin/pip install matplotlib`, not a dependency).

    .venv/bin/python bench/dashboard_picture.py [--minutes 8] [--out docs/dashboard.png]

Brings the node up (`scripts/e2e-cluster up`) unless it is up, and takes it down again if it brought it up."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dra_prepare import free_port  # a sibling, as the bench's modules import each other

from mpsagent_testing import waiting
from mpsagent_testing.cluster import claims, kubectl, node, pods
from mpsagent_testing.cluster.host_agent import GIB, HostAgents, fake_gpu, pipe_directory, status
from mpsagent_testing.cluster.layout import KUBECONFIG
from mpsagent_testing.packaging import script
from mpsagent_testing.processes import end_group
from mpsagent_testing.repo import ROOT

dashboard = script("dashboard.py")
"""The dashboard's panels, from the checkout."""

RESOURCE = "nvidia.com/gpu"
CONFIG = f"version: v1\nsharing:\n  mps:\n    resources:\n    - name: {RESOURCE}\n      replicas: 4\n"
SCRAPE_S = 5
STEP_S = 15
"""One change of the load every STEP_S: a pod of each route created, the oldest beyond KEPT deleted."""
KEPT = 3
CLAIM_SIZES = ("8Gi", "16Gi", "8Gi", "24Gi")
RATE_INTERVAL = "30s"
"""What Grafana's $__rate_interval is at a 5 s scrape: four scrapes and more."""
START_TIMEOUT_S = 60.0
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
INSTALL_HINT = "the picture needs matplotlib: .venv/bin/pip install matplotlib (it is not a dependency of mpsagent)"
UNITS = {"bytes": (GIB, "GiB"), "s": (1e-3, "ms"), "percent": (1, "%"), "short": (1, "")}


@contextlib.contextmanager
def prometheus(directory: Path, target_port: int, node_name: str) -> Iterator[str]:
    """A Prometheus scraping the agent every SCRAPE_S, with the `node` label the PodMonitor adds; its URL."""
    port = free_port()
    config = directory / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
                "scrape_configs": [
                    {
                        "job_name": "mpsagent",
                        "static_configs": [{"targets": [f"127.0.0.1:{target_port}"], "labels": {"node": node_name}}],
                    }
                ],
            }
        )
    )
    log = (directory / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        waiting.wait_for(lambda: _ready(url), START_TIMEOUT_S, "Prometheus ready")
        yield url
    finally:
        end_group(process, timeout_s=15)
        log.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def tamper() -> None:
    """A root process with the pipe directory lowers GPU 0's default ceiling: the agent restores it."""
    subprocess.run(
        [shutil.which("nvidia-cuda-mps-control") or "nvidia-cuda-mps-control"],
        input="set_default_device_pinned_mem_limit 0 1000M\n",
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_directory(RESOURCE))},
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )


def load(minutes: float) -> None:
    """Pods of both routes coming and going, one step every STEP_S; one tamper a third of the way in."""
    device_plugin: list[str] = []
    claimed: list[str] = []
    steps = int(minutes * 60 / STEP_S)
    for step in range(steps):
        began = time.monotonic()
        name = f"dash-dp-{step}"
        pods.create(name, {RESOURCE: 1})
        device_plugin.append(name)
        name = f"dash-claim-{step}"
        claims.create_pod(name, {"memory": CLAIM_SIZES[step % len(CLAIM_SIZES)]})
        claimed.append(name)
        for names in (device_plugin, claimed):
            while len(names) > KEPT:
                pods.delete(names.pop(0), wait=False, graceful=True)
        if step == steps // 3:
            tamper()
        time.sleep(max(0.0, STEP_S - (time.monotonic() - began)))


def query_range(url: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    expr = dashboard.as_prometheus_sees_it(expr, RATE_INTERVAL)
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": SCRAPE_S})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{query}", timeout=30) as answer:
        found: list[dict[str, Any]] = json.load(answer)["data"]["result"]
        return found


def legend(template: str, labels: dict[str, str]) -> str:
    text = re.sub(r"{{(\w+)}}", lambda m: labels.get(m[1], ""), template)
    return re.sub(r"GPU-e2e0*(\d+)-[-a-z]+", r"GPU \1", text).strip()


def draw(url: str, start: float, end: float, out: Path) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise SystemExit(INSTALL_HINT) from exc
    columns = 3
    heights = [math.ceil(len(panels) / columns) for _, panels in dashboard.ROWS]
    figure = plt.figure(figsize=(18, 3.4 * sum(heights) + 0.8), layout="constrained")
    figure.suptitle("GPU sharing (mpsagent): a real run on the project's node, scraped by Prometheus", fontsize=14)
    sections = figure.subfigures(len(heights), 1, height_ratios=heights)
    for section, (title, panels), rows in zip(sections, dashboard.ROWS, heights, strict=True):
        section.suptitle(title, x=0.01, ha="left", fontsize=13, fontweight="bold")
        axes = section.subplots(rows, columns, squeeze=False).flatten()
        for axis, spec in zip(axes, panels, strict=False):
            scale, unit = UNITS.get(spec.unit, (1, spec.unit))
            for query in spec.queries:
                for series in query_range(url, query.expr, start, end):
                    times = [(float(t) - start) / 60 for t, _ in series["values"]]
                    values = [float(v) / scale for _, v in series["values"]]
                    axis.plot(times, values, label=legend(query.legend, series["metric"]) or query.expr[:40])
            if spec.limit is not None:
                axis.axhline(spec.limit, color="red", linestyle="--", linewidth=1)
            if spec.maximum is not None:
                axis.set_ylim(0, spec.maximum * 1.05)
            axis.set_title(spec.title, fontsize=10)
            axis.set_xlabel("minutes", fontsize=8)
            axis.set_ylabel(unit, fontsize=8)
            axis.tick_params(labelsize=8)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize=7, loc="upper left")
            else:
                axis.text(0.5, 0.5, "no data (none happened)", ha="center", va="center", transform=axis.transAxes)
        for axis in axes[len(panels) :]:
            axis.axis("off")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="how long the load runs (default 8)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="mpa-dashboard-", dir="/tmp"))
    try:
        with node.up_meanwhile():
            agents = HostAgents(directory, [fake_gpu(0, 80 * GIB), fake_gpu(1, 80 * GIB)])
            name = node.node_name()
            port = free_port()
            try:
                claims.apply_file(claims.DEVICE_CLASS_FILE)
                agent = agents.start(CONFIG, "--dra", "on", "--kubeconfig", str(KUBECONFIG), "--node-name", name,
                                     "--metrics-address", f"127.0.0.1:{port}")  # fmt: skip
                agent.wait_log("dra driver serving", timeout=START_TIMEOUT_S)
                waiting.wait_for(
                    lambda: (status().get("dra") or {}).get("registered"), START_TIMEOUT_S, "the agent registered"
                )
                with prometheus(directory, port, name) as url:
                    start = time.time()
                    load(args.minutes)
                    time.sleep(2 * SCRAPE_S)
                    end = time.time()
                    draw(url, start, end, args.out)
            finally:
                with contextlib.suppress(Exception):
                    pods.delete_all()
                claims.delete_templates()
                agents.close()
                kubectl.run("delete", "-f", str(claims.DEVICE_CLASS_FILE), "--ignore-not-found", check=False)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
