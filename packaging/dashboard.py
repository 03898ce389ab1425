"""The Grafana dashboard for GPU sharing with mpsagent, as code (Grafana's grafana-foundation-sdk, a development
dependency): writes the JSON that Grafana imports as it is, the ConfigMap of packaging/kubernetes/monitoring that
the Grafana sidecar discovers, and the Helm chart's copy (`monitoring.dashboard`).

    .venv/bin/python packaging/dashboard.py    # writes the three files; tests/packaging/test_dashboard.py checks them

Every panel is one question an operator of shared GPUs asks; its description says which, and docs/metrics.md
lists them. Variables: the Prometheus data source, then node, resource and GPU (each from the agent's own series:
`node` is the label the PodMonitor adds)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as builders
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)

ROOT = Path(__file__).resolve().parents[1]
FILE_NAME = "mpsagent-dashboard.json"
MONITORING = ROOT / "packaging" / "kubernetes" / "monitoring"
JSON_OUTPUTS = (MONITORING / FILE_NAME, ROOT / "packaging" / "helm" / "mpsagent" / "dashboards" / FILE_NAME)
"""The JSON to import into Grafana, and the Helm chart's copy (a chart reads only its own files)."""
CONFIG_MAP = MONITORING / "dashboard.yaml"
CONFIG_MAP_HEADER = """\
# The Grafana dashboard for GPU sharing, written by packaging/dashboard.py (do not edit; run it), as a ConfigMap for
# the Grafana sidecar that loads every ConfigMap labelled grafana_dashboard: "1" (kube-prometheus-stack's Grafana,
# the Grafana chart with sidecar.dashboards.enabled): let it search this namespace (searchNamespace: ALL, or this
# one). Without the Prometheus Operator, apply this file alone; or import mpsagent-dashboard.json in Grafana.
"""
UID = "mpsagent-gpu-sharing"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
MPS_CLIENT_LIMIT = 48
"""MPS serves at most 48 clients a GPU; the 49th gets CUDA_ERROR_MPS_MAX_CLIENTS_REACHED."""

# The selectors every query narrows by; an agent's series carry the PodMonitor's `node` label.
NODE = 'node=~"$node"'
RESOURCE = f'{NODE}, resource=~"$resource"'
GPU = f'{RESOURCE}, gpu=~"$gpu"'
WINDOW = "$__rate_interval"
ALL = ".*"
"""What a variable set to All stands for in a query (its `allValue`)."""


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    answers: str
    """The question the panel answers: its description in Grafana and its line in docs/metrics.md."""
    queries: tuple[Query, ...]
    unit: str = "short"
    limit: float | None = None
    """A red line at this value (the MPS client limit)."""
    stacked: bool = False
    maximum: float | None = None
    """The axis's top: the whole of what the panel measures (100 % of the SMs)."""


def quantiles(family: str, what: str) -> tuple[Query, ...]:
    """p50 and p99 of a duration histogram, by outcome."""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, outcome) (rate({family}_bucket{{{what}}}[{WINDOW}])))",
            f"p{int(q * 100)} {{{{outcome}}}}",
        )
        for q in (0.5, 0.99)
    )


ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Capacity",
        (
            PanelSpec(
                "Replicas advertised",
                "How many replicas of each GPU the kubelet is offered, and how many are Unhealthy (a failed GPU, "
                "its daemon down, or withheld beside DRA claims)?",
                (Query(f"sum by (gpu, health) (mpsagent_replicas{{{GPU}}})", "{{gpu}} {{health}}"),),
            ),
            PanelSpec(
                "Live grants per GPU, against the MPS client limit",
                f"Which GPUs are full, and how close is each to MPS's {MPS_CLIENT_LIMIT} clients?",
                (Query(f"mpsagent_gpu_live_grants{{{GPU}}}", "{{node}} {{gpu}}"),),
                limit=MPS_CLIENT_LIMIT,
            ),
            PanelSpec(
                "DRA claims prepared",
                "How many DRA claims hold a share on each node now?",
                (Query(f"mpsagent_dra_prepared_claims{{{NODE}}}", "{{node}}"),),
            ),
            PanelSpec(
                "GPU memory held, by route",
                "How much of each GPU's memory do device-plugin grants and DRA claims hold (never more than the "
                "GPU together)?",
                (Query(f"sum by (gpu, route) (mpsagent_gpu_held_memory_bytes{{{GPU}}})", "{{gpu}} {{route}}"),),
                unit="bytes",
                stacked=True,
            ),
            PanelSpec(
                "Daemon memory ceiling, against the GPU's memory",
                "What pinned memory does the MPS daemon allow any client on each GPU (the largest live share's; "
                "the whole GPU with none)?",
                (
                    Query(f"mpsagent_daemon_memory_ceiling_bytes{{{GPU}}}", "ceiling {{node}} {{gpu}}"),
                    Query(f"mpsagent_gpu_memory_bytes{{{GPU}}}", "GPU memory {{node}} {{gpu}}"),
                ),
                unit="bytes",
            ),
            PanelSpec(
                "Daemon thread ceiling",
                "What share of the SMs does the daemon allow any client of each resource?",
                (Query(f"mpsagent_daemon_thread_ceiling_percent{{{RESOURCE}}}", "{{node}} {{resource}}"),),
                unit="percent",
                maximum=100,
            ),
            PanelSpec(
                "Memory enforced by",
                "Who holds a capped container to its memory on each GPU: the driver, per container (its cgroup's "
                "limit, MPS's ceilings the second layer), or MPS alone, per process?",
                (
                    Query(
                        f"max by (node, gpu, layer) (mpsagent_gpu_enforcement{{{GPU}}} == 1)",
                        "{{node}} {{gpu}} {{layer}}",
                    ),
                ),
            ),
            PanelSpec(
                "Escape bound: memory",
                "How much memory beyond its own cap can a container on each GPU get by unsetting its variables "
                "(0 while every live share of the GPU is the same)?",
                (Query(f"mpsagent_escape_memory_bytes{{{GPU}}}", "{{node}} {{gpu}}"),),
                unit="bytes",
            ),
            PanelSpec(
                "Escape bound: threads",
                "How many percentage points of the SMs beyond its own cap can a container on each GPU get so?",
                (Query(f"mpsagent_escape_thread_percent{{{GPU}}}", "{{node}} {{gpu}}"),),
                unit="percent",
            ),
        ),
    ),
    (
        "Use",
        (
            PanelSpec(
                "MPS clients per GPU",
                "How many CUDA processes run on each GPU through MPS (NVML)?",
                (Query(f'mpsagent_mps_clients{{{NODE}, gpu=~"$gpu"}}', "{{node}} {{gpu}}"),),
                limit=MPS_CLIENT_LIMIT,
            ),
            PanelSpec(
                "GPU memory per container, against the GPU's ceiling",
                "Which containers use how much of each GPU, and how close are they to the daemon's ceiling?",
                (
                    Query(
                        "sum by (gpu, pod_uid, container_id) "
                        f'(mpsagent_container_gpu_memory_bytes{{{NODE}, gpu=~"$gpu"}})',
                        "{{pod_uid}} {{container_id}}",
                    ),
                    Query(f"max by (gpu) (mpsagent_daemon_memory_ceiling_bytes{{{GPU}}})", "ceiling {{gpu}}"),
                ),
                unit="bytes",
            ),
            PanelSpec(
                "Driver memory limit per container",
                "Where the driver limits memory per container: each container's limit on each GPU, and what its "
                "processes use against it (the driver's count)?",
                (
                    Query(
                        f'mpsagent_container_gpu_memory_used_bytes{{{NODE}, gpu=~"$gpu"}}',
                        "used {{pod_uid}} {{container_id}}",
                    ),
                    Query(
                        f'mpsagent_container_gpu_memory_limit_bytes{{{NODE}, gpu=~"$gpu"}}',
                        "limit {{pod_uid}} {{container_id}}",
                    ),
                ),
                unit="bytes",
            ),
            PanelSpec(
                "SM utilization per container",
                "How busy does each container keep each GPU's SMs (NVML's process samples, where the GPU gives them)?",
                (
                    Query(
                        "sum by (gpu, pod_uid, container_id) "
                        f'(mpsagent_container_gpu_sm_utilization_percent{{{NODE}, gpu=~"$gpu"}})',
                        "{{gpu}} {{pod_uid}} {{container_id}}",
                    ),
                ),
                unit="percent",
                maximum=100,
            ),
        ),
    ),
    (
        "Health and trust",
        (
            PanelSpec(
                "MPS daemon up and busy",
                "Is each resource's MPS daemon up, and is another control session keeping it busy?",
                (
                    Query(f"mpsagent_daemon_up{{{RESOURCE}}}", "up {{node}} {{resource}}"),
                    Query(f"mpsagent_daemon_busy{{{RESOURCE}}}", "busy {{node}} {{resource}}"),
                ),
            ),
            PanelSpec(
                "MPS daemon restarts",
                "Did a daemon fail (each failure ended its clients) or keep failing to start?",
                (
                    Query(
                        f"increase(mpsagent_daemon_restarts_total{{{RESOURCE}}}[{WINDOW}])",
                        "failures {{node}} {{resource}}",
                    ),
                    Query(
                        f"increase(mpsagent_daemon_restart_attempts_total{{{RESOURCE}}}[{WINDOW}])",
                        "start attempts {{node}} {{resource}}",
                    ),
                ),
            ),
            PanelSpec(
                "Ceilings changed behind the agent",
                "Is anyone tampering with the daemon's ceilings (each change restored), and is the daemon's log "
                "watched?",
                (
                    Query(
                        f"sum by (node, seen_by) (increase(mpsagent_cap_tamper_total{{{RESOURCE}}}[{WINDOW}]))",
                        "restored, seen by {{seen_by}} {{node}}",
                    ),
                    Query(f"mpsagent_daemon_log_watched{{{RESOURCE}}} == 0", "log NOT watched {{node}}"),
                ),
            ),
            PanelSpec(
                "Processes without a share of their GPU",
                "Does any process run on a GPU its pod holds no grant or claim on (a pod that mounts the MPS pipe "
                "itself, a process on the host), and can the agent tell the pods apart?",
                (
                    Query(
                        "sum by (node, gpu, pod_namespace, pod_name) "
                        f'(mpsagent_stowaway_processes{{{NODE}, gpu=~"$gpu"}})',
                        "{{node}} {{gpu}} {{pod_namespace}}/{{pod_name}}",
                    ),
                    Query(f"mpsagent_stowaways_unchecked{{{NODE}}} == 1", "pods NOT judged {{node}}"),
                ),
            ),
            PanelSpec(
                "Kubelet, pod-resources and DRA",
                "Is the agent registered with the kubelet, does pod-resources answer, is the DRA driver "
                "registered and its ResourceSlice published?",
                (
                    Query(f"mpsagent_kubelet_registered{{{RESOURCE}}}", "device plugin {{node}} {{resource}}"),
                    Query(f"mpsagent_pod_resources_up{{{NODE}}}", "pod-resources {{node}}"),
                    Query(f"mpsagent_dra_registered{{{NODE}}}", "DRA driver {{node}}"),
                    Query(f"mpsagent_dra_slice_published{{{NODE}}}", "ResourceSlice {{node}}"),
                ),
            ),
        ),
    ),
    (
        "Latency and refusals",
        (
            PanelSpec(
                "Allocate",
                "How long does the kubelet wait for Allocate, by outcome?",
                quantiles("mpsagent_allocate_duration_seconds", RESOURCE),
                unit="s",
            ),
            PanelSpec(
                "GetPreferredAllocation",
                "How long does the kubelet wait for GetPreferredAllocation, by outcome?",
                quantiles("mpsagent_preferred_allocation_duration_seconds", RESOURCE),
                unit="s",
            ),
            PanelSpec(
                "DRA claim prepare",
                "How long does the kubelet wait for a claim's prepare, by outcome?",
                quantiles("mpsagent_claim_prepare_duration_seconds", NODE),
                unit="s",
            ),
            PanelSpec(
                "Refusals",
                "Are requests being refused, and why (refused: the request was wrong or does not fit; failed: "
                "the node)?",
                (
                    Query(
                        "sum by (node, outcome) "
                        f'(increase(mpsagent_allocate_duration_seconds_count{{{RESOURCE}, outcome!="ok"}}[{WINDOW}]))',
                        "Allocate {{outcome}} {{node}}",
                    ),
                    Query(
                        "sum by (node, outcome) "
                        f'(increase(mpsagent_dra_prepares_total{{{NODE}, outcome!="ok"}}[{WINDOW}]))',
                        "claim prepare {{outcome}} {{node}}",
                    ),
                ),
            ),
        ),
    ),
)


def _target(query: Query, ref_id: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref_id).datasource(DATASOURCE)


def _panel(spec: PanelSpec) -> timeseries.Panel:
    panel = timeseries.Panel().title(spec.title).description(spec.answers)
    panel = panel.datasource(DATASOURCE).unit(spec.unit).height(8).span(8)
    if spec.maximum is not None:
        panel = panel.min(0).max(spec.maximum)
    for index, query in enumerate(spec.queries):
        panel = panel.with_target(_target(query, chr(ord("A") + index)))
    panel = panel.legend(
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
    )
    if spec.stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(30)
    if spec.limit is not None:
        panel = panel.thresholds(
            builders.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(value=None, color="green"), Threshold(value=spec.limit, color="red")])
        ).thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.LINE))
    return panel


def _variable(name: str, label: str, query: str) -> builders.QueryVariable:
    return (
        builders.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DATASOURCE)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(ALL)
    )


def dashboard() -> builders.Dashboard:
    board = (
        builders.Dashboard("GPU sharing (mpsagent)")
        .uid(UID)
        .description(
            "MPS shares of NVIDIA GPUs: capacity, use, health and trust, latency and refusals, per node and GPU"
        )
        .tags(["mpsagent", "gpu", "mps"])
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("1m")
        .with_variable(builders.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(_variable("node", "Node", "label_values(mpsagent_build_info, node)"))
        .with_variable(_variable("resource", "Resource", 'label_values(mpsagent_replicas{node=~"$node"}, resource)'))
        .with_variable(
            _variable("gpu", "GPU", 'label_values(mpsagent_replicas{node=~"$node", resource=~"$resource"}, gpu)')
        )
    )
    for title, panels in ROWS:
        board = board.with_row(builders.Row(title))
        for spec in panels:
            board = board.with_panel(_panel(spec))
    return board


def as_prometheus_sees_it(expr: str, rate_interval: str) -> str:
    """A panel's query as Grafana sends it to Prometheus with every variable at All, at `rate_interval`."""
    for variable in ("$node", "$resource", "$gpu"):
        expr = expr.replace(variable, ALL)
    return expr.replace(WINDOW, rate_interval)


def dashboard_json() -> str:
    return json.dumps(dashboard().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def config_map(text: str) -> str:
    """The ConfigMap that carries the dashboard's JSON (`text`) to the Grafana sidecar."""
    embedded = "".join(f"    {line}\n" if line else "\n" for line in text.splitlines())
    return (
        f"{CONFIG_MAP_HEADER}apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: mpsagent-dashboard\n  labels:\n"
        f'    app.kubernetes.io/name: mpsagent\n    grafana_dashboard: "1"\ndata:\n  {FILE_NAME}: |\n{embedded}'
    )


def outputs() -> dict[Path, str]:
    """Every file the script writes, with what it holds."""
    text = dashboard_json()
    return {**dict.fromkeys(JSON_OUTPUTS, text), CONFIG_MAP: config_map(text)}


def main() -> None:
    for path, text in outputs().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
