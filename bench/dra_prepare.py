"""DRA prepare on the real node: how long the kubelet waits for the agent's `NodePrepareResources` (driver
`mps.mpsagent.io`, `--dra on`) against a DRA plugin that does nothing (`mpsagent_testing.cluster.noop_dra`, driver
`noop.example.com`), and how long the pod takes from its creation at the API server to Running. Every pod claims
`memory: 8Gi` of one device class (`mps-share.mpsagent.io`, or `noop.example.com` whose one device has an 80Gi
`memory` capacity), through a ResourceClaimTemplate; the two kinds alternate, one pod at a time, each deleted and
its claim unprepared (the kubelet's `NodeUnprepareResources` for it counted, and for the agent its `--status` shows
no claim) before the next. The agent is a host process with two fake 80 GiB GPUs, the real MPS control daemon and
the fake NVML library.

The prepare time is the kubelet's own view: its `dra_grpc_operations_duration_seconds` histogram (by `driver_name`
and `method_name`), read from its `/metrics` before and after each pod, so that each pod's delta is its one call;
the run's sum/count delta per driver (the mean) and the bucket the median falls in are given too. The agent's own
`mpsagent_claim_prepare_duration_seconds` and the kubelet's whole `PrepareResources` operation
(`dra_operations_duration_seconds`) are taken the same way. The agent does real work in a prepare (reads the claim
from the API server, holds the share in the ledger, has the MPS daemon hold the new ceilings, writes a CDI spec and
a checkpoint, the checkpoint with fsync); the do-nothing plugin does none. Targets: the prepare at most 5x the
do-nothing plugin's, the pod's start-up at most 1.1x (the median of the pairs' ratios); each is printed with pass
or FAIL. Each agent prepare is also split in three by its log lines, its own metric and the MPS control daemon's
`control.log`: up to the daemon's session that sets ceilings, that session, and what is left after it (the CDI
spec and the checkpoint are written meanwhile, in a worker thread).

    .venv/bin/python bench/dra_prepare.py [--pods 20] [--noop-reads-claims] [--json bench/results/dra-prepare.json]

`--noop-reads-claims`: the do-nothing plugin reads each claim from the API server before it answers (as upstream's
kubeletplugin helper and NVIDIA's driver do, one kept connection), so that the ratio shows what the agent adds to the
read every driver makes. The targets are against the plugin that reads nothing; the report says which ran.

Brings the node up (`scripts/e2e-cluster up`) unless it is up, and takes it down again if it brought it up."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from mpsagent_testing import waiting
from mpsagent_testing.cluster import claims, kubectl, node, noop_dra, pods
from mpsagent_testing.cluster.host_agent import GIB, MPS_ROOT, HostAgents, fake_gpu, status
from mpsagent_testing.cluster.layout import KUBECONFIG
from mpsagent_testing.repo import ROOT, commit

CONFIG_RESOURCE = "nvidia.com/gpu"
CONFIG = f"version: v1\nsharing:\n  mps:\n    resources:\n    - name: {CONFIG_RESOURCE}\n      replicas: 4\n"
MEMORY = "8Gi"
AGENT, NOOP = "agent", "noop"
CLASSES = {AGENT: claims.DEVICE_CLASS, NOOP: noop_dra.DEVICE_CLASS}
DRIVERS = {AGENT: claims.DRIVER, NOOP: noop_dra.DRIVER}
TEMPLATES = {AGENT: "bench-dra-agent", NOOP: "bench-dra-noop"}
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
GRPC_SECONDS = "dra_grpc_operations_duration_seconds"
OPERATION_SECONDS = "dra_operations_duration_seconds"
API_SECONDS = "apiserver_request_duration_seconds"
AGENT_SECONDS = "mpsagent_claim_prepare_duration_seconds"
KUBELET_METRICS = "https://127.0.0.1:10250/metrics"
UNPREPARE_TIMEOUT_S = 30.0
METRICS_TIMEOUT_S = 10
START_TIMEOUT_S = 30.0
AGENT_METRICS_TIMEOUT_S = 5.0
SETTLE_S = 1.5
WARM_UP = 2
"""Pods of each kind first, not counted: they warm up the node's caches."""
SPLIT_PARTS = ("before_daemon_s", "daemon_s", "after_caps_s")
PREPARE_TARGET = 5.0
"""The agent's prepare against the do-nothing plugin's, the median of the pairs' ratios (issue 26)."""
START_TARGET = 1.1
"""A pod's start-up with the agent's claim against one with the do-nothing plugin's."""


# --- Prometheus text: the pure part -------------------------------------------------------------------------------

Labels = frozenset[tuple[str, str]]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, Labels], float]:
    """The samples of a Prometheus text exposition, by name and label set."""
    samples: dict[tuple[str, Labels], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.groups()
        pairs = frozenset(
            (key, raw.replace('\\"', '"').replace("\\\\", "\\")) for key, raw in _LABEL.findall(labels or "")
        )
        samples[(name, pairs)] = float(value)
    return samples


@dataclass(frozen=True)
class Histogram:
    """One histogram's series added up: its sum, its count and its cumulative buckets by upper bound."""

    sum: float = 0.0
    count: float = 0.0
    buckets: Mapping[float, float] = field(default_factory=dict)

    def __sub__(self, other: Histogram) -> Histogram:
        return Histogram(
            self.sum - other.sum,
            self.count - other.count,
            {le: n - other.buckets.get(le, 0.0) for le, n in self.buckets.items()},
        )

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile_bucket(self, q: float) -> tuple[float, float] | None:
        """The bounds (lower, upper] of the bucket the q-quantile falls in; None without observations."""
        if not self.count:
            return None
        rank, lower = q * self.count, 0.0
        for le in sorted(self.buckets):
            if self.buckets[le] >= rank:
                return lower, le
            lower = le
        return lower, math.inf

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket the quantile falls in (its lower bound where
        that is the +Inf bucket); None without observations."""
        bounds = self.quantile_bucket(q)
        if bounds is None:
            return None
        lower, upper = bounds
        if math.isinf(upper):
            return lower
        below = self.buckets.get(lower, 0.0)
        inside = self.buckets[upper] - below
        return lower + (upper - lower) * (q * self.count - below) / inside if inside > 0 else upper


def histogram(samples: Mapping[tuple[str, Labels], float], name: str, **match: str) -> Histogram:
    """The series of histogram `name` whose labels include `match`, added up (e.g. over grpc_status_code)."""
    wanted = set(match.items())
    total, count, buckets = 0.0, 0.0, dict[float, float]()
    for (sample, labels), value in samples.items():
        if not wanted <= labels:
            continue
        if sample == f"{name}_sum":
            total += value
        elif sample == f"{name}_count":
            count += value
        elif sample == f"{name}_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    return Histogram(total, count, buckets)


def summary(samples: list[float]) -> dict[str, float] | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return {
        "median_s": statistics.median(ordered),
        "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
        "mean_s": statistics.fmean(ordered),
        "min_s": ordered[0],
        "max_s": ordered[-1],
    }


def paired_median(numerators: list[float], denominators: list[float]) -> float | None:
    """The median of the pairs' ratios (None unless both have the same number of samples, at least one)."""
    if not numerators or len(numerators) != len(denominators):
        return None
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def ratio_of_medians(numerators: list[float], denominators: list[float]) -> float | None:
    if not numerators or not denominators:
        return None
    return statistics.median(numerators) / statistics.median(denominators)


def log_breakdown(lines: Iterable[str]) -> list[dict[str, Any]]:
    """From the agent's JSON log: each `claim prepared` line, and the seconds since the `mps daemon caps set` line
    of that prepare (the CDI spec and the checkpoint are written between the two; None when the prepare did not
    change the ceilings)."""
    found: list[dict[str, Any]] = []
    caps_at: datetime | None = None
    for line in lines:
        entry = _log_entry(line)
        if entry is None:
            continue
        event, at = entry.get("event"), datetime.fromisoformat(str(entry["timestamp"]).replace("Z", "+00:00"))
        if event == "mps daemon caps set":
            caps_at = at
        elif event == "claim prepared":
            after_caps = (at - caps_at).total_seconds() if caps_at is not None else None
            found.append(
                {
                    "claim_uid": entry.get("claim_uid"),
                    "at": at.isoformat(),
                    "caps_at": caps_at.isoformat() if caps_at is not None else None,
                    "after_caps_s": after_caps,
                }
            )
            caps_at = None
        elif event == "claim unprepared":
            caps_at = None
    return found


_CONTROL = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) Control +\d+\] (.*)$")
CLOCK_SLACK = timedelta(milliseconds=1)
"""The daemon's log has milliseconds: a session may seem to start up to one before the prepare did."""


def daemon_sessions(lines: Iterable[str]) -> list[tuple[datetime, list[str]]]:
    """From the MPS control daemon's control.log (local time, milliseconds): each connection's start and the
    commands it sent."""
    sessions: list[tuple[datetime, list[str]]] = []
    for line in lines:
        match = _CONTROL.match(line.strip())
        if match is None:
            continue
        at, text = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S.%f").astimezone(), match[2]
        if text == "Accepting connection...":
            sessions.append((at, []))
        elif sessions and text.startswith("Cmd:"):
            sessions[-1][1].append(text.removeprefix("Cmd:"))
    return sessions


def prepare_split(
    breakdown: list[dict[str, Any]], own_s: list[float], sessions: list[tuple[datetime, list[str]]]
) -> list[dict[str, float]]:
    """Each prepare of the agent (its log line, and its own time from its metric, in the same order) split in three:
    from its start to the daemon's first session that sets ceilings (the claim read from the API server, the
    ledger, the front-end process starting), from there to `mps daemon caps set` (the daemon's sessions: set,
    read back, server list), and from there to `claim prepared` (the CDI spec, the checkpoint)."""
    split = []
    for entry, own in zip(breakdown, own_s, strict=False):
        if entry.get("caps_at") is None:
            continue
        end, caps = datetime.fromisoformat(entry["at"]), datetime.fromisoformat(entry["caps_at"])
        start = end - timedelta(seconds=own)
        first = next(
            (
                at
                for at, sent in sessions
                if start - CLOCK_SLACK <= at <= caps and any(c.startswith("set_") for c in sent)
            ),
            None,
        )
        if first is None:
            continue
        split.append(
            {
                "before_daemon_s": max(0.0, (first - start).total_seconds()),
                "daemon_s": (caps - first).total_seconds(),
                "after_caps_s": (end - caps).total_seconds(),
            }
        )
    return split


def warnings_and_errors(lines: Iterable[str]) -> list[str]:
    """The agent's log lines at warning and above."""
    serious = ("warning", "error", "critical")
    return [line for line in lines if (entry := _log_entry(line)) and entry.get("level") in serious]


def _log_entry(line: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and "timestamp" in entry else None


# --- the node -----------------------------------------------------------------------------------------------------


def _fetch(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S, context=context) as response:
        text: str = response.read().decode()
        return text


class KubeletMetrics:
    """The kubelet's /metrics: through the API server's node proxy where it allows it, else straight from the
    kubelet's port (loopback; anonymous requests are allowed on this node, its serving certificate is its own)."""

    def __init__(self, node_name: str) -> None:
        self.proxy = f"/api/v1/nodes/{node_name}/proxy/metrics"
        self.direct = ssl.create_default_context()
        self.direct.check_hostname = False
        self.direct.verify_mode = ssl.CERT_NONE
        self.through_proxy = True
        try:
            self._proxied()
        except OSError:  # 400 "address not allowed": the API server does not proxy to loopback
            self.through_proxy = False
        self.route = "API server proxy" if self.through_proxy else KUBELET_METRICS

    def _proxied(self) -> str:
        with node.api_request("GET", self.proxy, timeout=METRICS_TIMEOUT_S) as response:
            text: str = response.read().decode()
            return text

    def read(self) -> dict[tuple[str, Labels], float]:
        return parse_metrics(self._proxied() if self.through_proxy else _fetch(KUBELET_METRICS, self.direct))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def claim_pod(name: str, kind: str) -> dict[str, Any]:
    """The tests' pod, quiet (it only sleeps), its container claiming the kind's template."""
    manifest = pods.manifest(name, {})
    container = manifest["spec"]["containers"][0]
    container["command"] = ["/bin/sleep", "3600"]
    container["resources"] = {"claims": [{"name": claims.CLAIM}]}
    manifest["spec"]["resourceClaims"] = [{"name": claims.CLAIM, "resourceClaimTemplateName": TEMPLATES[kind]}]
    return manifest


def template(kind: str) -> dict[str, Any]:
    made = claims.template(TEMPLATES[kind], {"memory": MEMORY})
    made["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = CLASSES[kind]
    return made


def agent_claims() -> list[Any]:
    found: list[Any] = (status().get("dra") or {}).get("claims", [])
    return found


def api_server_metrics() -> dict[tuple[str, Labels], float]:
    with node.api_request("GET", "/metrics", timeout=METRICS_TIMEOUT_S) as response:
        return parse_metrics(response.read().decode())


def agent_metrics(port: int) -> dict[tuple[str, Labels], float]:
    return parse_metrics(_fetch(f"http://127.0.0.1:{port}/metrics"))


@dataclass
class Run:
    """What one run gathered, per pod of each kind."""

    running_s: dict[str, list[float]] = field(default_factory=lambda: {AGENT: [], NOOP: []})
    grpc_s: dict[str, list[float]] = field(default_factory=lambda: {AGENT: [], NOOP: []})
    operation_s: dict[str, list[float]] = field(default_factory=lambda: {AGENT: [], NOOP: []})
    agent_own_s: list[float] = field(default_factory=list)
    agent_own_all_s: list[float] = field(default_factory=list)
    """The agent's own prepare time of every agent pod, the warm-up ones too (in the order of its log)."""
    odd: list[str] = field(default_factory=list)


def measure(count: int, *, noop_reads_claims: bool = False) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mpa-bench-dra-", dir="/tmp"))
    agents = HostAgents(directory, [fake_gpu(0, 80 * GIB), fake_gpu(1, 80 * GIB)])
    name = node.node_name()
    port = free_port()
    noop_log = directory / "noop-dra.log"
    noop: subprocess.Popen[bytes] | None = None
    run = Run()
    try:
        claims.apply_file(claims.DEVICE_CLASS_FILE)
        noop_dra.publish(name)
        kubectl.apply([template(AGENT), template(NOOP)])
        with noop_log.open("wb") as out:
            reads = [str(KUBECONFIG)] if noop_reads_claims else []
            noop = subprocess.Popen(
                [sys.executable, "-m", "mpsagent_testing.cluster.noop_dra", name, *reads],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        agent = agents.start(CONFIG, "--dra", "on", "--kubeconfig", str(KUBECONFIG), "--node-name", name,
                             "--metrics-address", f"127.0.0.1:{port}")  # fmt: skip
        agent.wait_log("dra driver serving", timeout=START_TIMEOUT_S)
        kubectl.wait_for(lambda: (status().get("dra") or {}).get("registered"), START_TIMEOUT_S, "the agent registered")
        kubectl.wait_for(lambda: "registered" in noop_log.read_text().split(), START_TIMEOUT_S, "the noop registered")
        kubelet = KubeletMetrics(name)
        first, first_agent, first_api = kubelet.read(), agent_metrics(port), api_server_metrics()
        for i in range(count + WARM_UP):
            for kind in (AGENT, NOOP) if i % 2 == 0 else (NOOP, AGENT):
                _one_pod(f"bench-dra-{kind}-{i}", kind, counted=i >= WARM_UP, kubelet=kubelet, port=port, run=run)
        last, last_agent, last_api = kubelet.read(), agent_metrics(port), api_server_metrics()
        agent.stop()
        lines = agent.log().splitlines()
        control_log = MPS_ROOT / CONFIG_RESOURCE / "log" / "control.log"
        sessions = (
            daemon_sessions(control_log.read_text(errors="replace").splitlines()) if control_log.is_file() else []
        )
    finally:
        if noop is not None:
            noop.terminate()
            try:
                noop.wait(10)
            except subprocess.TimeoutExpired:
                noop.kill()
                noop.wait(5)
        with contextlib.suppress(Exception):
            pods.delete_all()
        kubectl.run("delete", "resourceclaimtemplate", "-n", pods.NAMESPACE, "--ignore-not-found", *TEMPLATES.values(),
                    check=False)  # fmt: skip
        agents.close()
        noop_dra.unpublish(name)
        kubectl.run("delete", "-f", str(claims.DEVICE_CLASS_FILE), "--ignore-not-found", check=False)
        shutil.rmtree(directory, ignore_errors=True)
    result = _result(
        count,
        run,
        kubelet=(first, last),
        agent=(first_agent, last_agent),
        breakdown=log_breakdown(lines),
        sessions=sessions,
    )
    result["kubelet_metrics_from"] = kubelet.route
    result["noop_reads_claims"] = noop_reads_claims
    # The API server's own time for a GET of a claim (the kubelet's and the agent's, both kinds of pod alike).
    gets = [
        histogram(m, API_SECONDS, resource="resourceclaims", verb="GET", subresource="") for m in (first_api, last_api)
    ]
    result["api_server_claim_get"] = _histogram_view(gets[1] - gets[0])
    result["agent_warnings_and_errors"] = warnings_and_errors(lines)[-50:]
    return result


def _one_pod(name: str, kind: str, *, counted: bool, kubelet: KubeletMetrics, port: int, run: Run) -> None:
    driver = DRIVERS[kind]
    before = kubelet.read()
    before_agent = agent_metrics(port) if kind == AGENT else {}
    took = pods.time_to_running(claim_pod(name, kind))
    after = kubelet.read()
    grpc = histogram(after, GRPC_SECONDS, driver_name=driver, method_name=PREPARE) - histogram(
        before, GRPC_SECONDS, driver_name=driver, method_name=PREPARE
    )
    operation = histogram(after, OPERATION_SECONDS, operation_name="PrepareResources") - histogram(
        before, OPERATION_SECONDS, operation_name="PrepareResources"
    )
    own = None
    if kind == AGENT:
        # The agent renders /metrics at most once per status publish (every 0.5 s): ask until the prepare shows.
        def observed() -> Histogram | None:
            delta = histogram(agent_metrics(port), AGENT_SECONDS, outcome="ok") - histogram(
                before_agent, AGENT_SECONDS, outcome="ok"
            )
            return delta if delta.count else None

        own = waiting.wait_for(observed, AGENT_METRICS_TIMEOUT_S, "the agent's prepare in its /metrics", interval=0.1)
        run.agent_own_all_s.append(own.sum / own.count)
    if grpc.count != 1 or operation.count != 1 or (own is not None and own.count != 1):
        run.odd.append(f"{name}: {grpc.count:g} prepare calls, {operation.count:g} kubelet operations, "
                       f"{own.count if own else '-'} prepared by the agent")  # fmt: skip
    unprepared = histogram(after, GRPC_SECONDS, driver_name=driver, method_name=UNPREPARE).count
    pods.delete(name)

    def gone() -> bool:
        done = histogram(kubelet.read(), GRPC_SECONDS, driver_name=driver, method_name=UNPREPARE).count > unprepared
        return done and (kind != AGENT or not agent_claims())

    kubectl.wait_for(gone, UNPREPARE_TIMEOUT_S, f"the claim of {name} to be unprepared")
    # The kubelet tears the sandbox down around the unprepare: let that end before the next pod.
    time.sleep(SETTLE_S)
    if counted:
        run.running_s[kind].append(took)
        if grpc.count:
            run.grpc_s[kind].append(grpc.sum / grpc.count)
        if operation.count:
            run.operation_s[kind].append(operation.sum / operation.count)
        if own is not None and own.count:
            run.agent_own_s.append(own.sum / own.count)


def _histogram_view(delta: Histogram) -> dict[str, Any]:
    bucket = delta.quantile_bucket(0.5)
    return {
        "count": delta.count,
        "mean_s": delta.mean,
        "median_bucket_s": list(bucket) if bucket else None,
        "median_estimate_s": delta.quantile(0.5),
    }


Samples = Mapping[tuple[str, Labels], float]


def _result(
    count: int,
    run: Run,
    *,
    kubelet: tuple[Samples, Samples],
    agent: tuple[Samples, Samples],
    breakdown: list[dict[str, Any]],
    sessions: list[tuple[datetime, list[str]]],
) -> dict[str, Any]:
    over_run: dict[str, Any] = {}
    for kind, driver in DRIVERS.items():
        ends = [histogram(samples, GRPC_SECONDS, driver_name=driver, method_name=PREPARE) for samples in kubelet]
        over_run[kind] = _histogram_view(ends[1] - ends[0])
    own = histogram(agent[1], AGENT_SECONDS, outcome="ok") - histogram(agent[0], AGENT_SECONDS, outcome="ok")
    # Each counted agent pod's own prepare time split where the daemon's log and the agent's show it.
    parts = (
        prepare_split(breakdown[WARM_UP:], run.agent_own_all_s[WARM_UP:], sessions)
        if len(breakdown) == len(run.agent_own_all_s)
        else []
    )
    split = {key: summary([part[key] for part in parts]) if parts else None for key in SPLIT_PARTS}
    return {
        "pods_each": count,
        "warm_up_each": WARM_UP,
        "prepare_kubelet_grpc": {kind: summary(run.grpc_s[kind]) for kind in DRIVERS},
        "prepare_kubelet_grpc_over_run": over_run,
        "prepare_ratio_median": ratio_of_medians(run.grpc_s[AGENT], run.grpc_s[NOOP]),
        "prepare_ratio_paired_median": paired_median(run.grpc_s[AGENT], run.grpc_s[NOOP]),
        "prepare_kubelet_operation": {kind: summary(run.operation_s[kind]) for kind in DRIVERS},
        "prepare_agent_own": summary(run.agent_own_s),
        "prepare_agent_own_over_run": _histogram_view(own),
        "agent_prepare_split": split,
        "running": {kind: summary(run.running_s[kind]) for kind in DRIVERS},
        "running_ratio_median": ratio_of_medians(run.running_s[AGENT], run.running_s[NOOP]),
        "running_ratio_paired_median": paired_median(run.running_s[AGENT], run.running_s[NOOP]),
        "samples": {
            "running_s": run.running_s,
            "prepare_kubelet_grpc_s": run.grpc_s,
            "prepare_kubelet_operation_s": run.operation_s,
            "prepare_agent_own_s": run.agent_own_s,
            "agent_log": breakdown,
            "agent_prepare_split": parts,
        },
        "odd": run.odd,
        "commit": commit(),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f} ms"


def _x(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict(ratio: float | None, target: float) -> str:
    return "-" if ratio is None else "pass" if ratio <= target else "FAIL"


def report(result: Mapping[str, Any], out: Callable[[str], None] = print) -> None:
    reads = bool(result.get("noop_reads_claims"))
    out("noop: the do-nothing plugin " + ("reads each claim, then answers" if reads else "answers without reading"))
    out(f"{'':<40} {'median':>10} {'p90':>10} {'mean':>10}")
    rows = [
        ("prepare, kubelet's gRPC call: agent", result["prepare_kubelet_grpc"][AGENT]),
        ("prepare, kubelet's gRPC call: noop", result["prepare_kubelet_grpc"][NOOP]),
        ("kubelet's PrepareResources: agent", result["prepare_kubelet_operation"][AGENT]),
        ("kubelet's PrepareResources: noop", result["prepare_kubelet_operation"][NOOP]),
        ("prepare, the agent's own metric", result["prepare_agent_own"]),
        ("  read, ledger, front-end start", result["agent_prepare_split"]["before_daemon_s"]),
        ("  the daemon's sessions", result["agent_prepare_split"]["daemon_s"]),
        ("  after it (the files: written meanwhile)", result["agent_prepare_split"]["after_caps_s"]),
        ("pod created -> Running: agent", result["running"][AGENT]),
        ("pod created -> Running: noop", result["running"][NOOP]),
    ]
    for label, stats in rows:
        if stats:
            out(f"{label:<40} {_ms(stats['median_s']):>10} {_ms(stats['p90_s']):>10} {_ms(stats['mean_s']):>10}")
    for kind in DRIVERS:
        view = result["prepare_kubelet_grpc_over_run"][kind]
        bucket = view["median_bucket_s"]
        where = f", median in the bucket ({bucket[0]:g}, {bucket[1]:g}] s" if bucket else ""
        out(f"kubelet's histogram over the run, {kind}: {view['count']:g} prepares, mean {_ms(view['mean_s'])}{where}")
    verdict = (
        "- (the target is against the noop that reads nothing)"
        if reads
        else _verdict(result["prepare_ratio_paired_median"], PREPARE_TARGET)
    )
    out(f"prepare agent / noop: median of pairs {_x(result['prepare_ratio_paired_median'], 2)} "
        f"(of medians {_x(result['prepare_ratio_median'], 2)}); target <= {PREPARE_TARGET:g}: "
        f"{verdict}")  # fmt: skip
    out(f"pod start-up agent / noop: median of pairs {_x(result['running_ratio_paired_median'], 3)} "
        f"(of medians {_x(result['running_ratio_median'], 3)}); target <= {START_TARGET:g}: "
        f"{_verdict(result['running_ratio_paired_median'], START_TARGET)}")  # fmt: skip
    gets = result.get("api_server_claim_get")
    if gets:
        out(f"API server, GET of a claim: {gets['count']:g}, mean {_ms(gets['mean_s'])} (its own time)")
    for line in result["odd"]:
        out(f"odd: {line}")
    warnings = result.get("agent_warnings_and_errors") or []
    if warnings:
        out(f"the agent logged {len(warnings)} warnings or errors (see the JSON)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=20, help="pods of each kind counted (default 20)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "dra-prepare.json")
    parser.add_argument(
        "--noop-reads-claims",
        action="store_true",
        help="the do-nothing plugin reads each claim before it answers (the targets do not apply)",
    )
    args = parser.parse_args()
    with node.up_meanwhile():
        result = measure(args.pods, noop_reads_claims=args.noop_reads_claims)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
