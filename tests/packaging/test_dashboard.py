"""The Grafana dashboard (`packaging/dashboard.py`): the committed JSON is what the script writes, in both places it
ships from; every panel's and variable's PromQL parses (promtool, as Prometheus would) and names only metrics and
labels the agent exports, held to docs/metrics.md's table (which tests/packaging/test_docs.py holds to the code), so
that a renamed metric or label fails here instead of blanking a panel; and docs/metrics.md says what each panel
answers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from mpsagent_testing.metrics import METRICS_DOC, documented_labels
from mpsagent_testing.packaging import script
from mpsagent_testing.repo import ROOT

dashboard = script("dashboard.py")

PROMTOOL = shutil.which("promtool")
RATE_INTERVAL = "1m"
# Labels every scraped series carries beside the agent's own: the PodMonitor's `node`, Prometheus's target labels.
SCRAPE_LABELS = {"node", "job", "instance", "namespace", "pod", "container"}
HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")


def board() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(dashboard.dashboard_json())
    return loaded


def panel_queries(doc: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(panel title, PromQL, legend) of every panel's target."""
    for panel in doc["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"], target.get("legendFormat", "")


def variable_queries(doc: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(variable name, the series selector, the label) of every `label_values(selector, label)` variable."""
    for variable in doc["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"])
            assert match, f"variable {variable['name']}: {variable['query']}"
            yield variable["name"], match[1], match[2]


def named(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """The series selectors of `expr` (metric name, the labels it matches on), and every label it groups or
    matches by (`by`, `on`, `ignoring`)."""
    selectors: list[tuple[str, set[str]]] = []
    grouping: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = node.matchers.matchers
            selectors.append((node.name, {m.name for m in matchers if m.name != "__name__"}))
            return
        modifier = getattr(node, "modifier", None)
        if isinstance(modifier, promql_parser.AggModifier):
            grouping.update(modifier.labels)
        if isinstance(modifier, promql_parser.BinModifier) and modifier.matching is not None:
            grouping.update(modifier.matching.labels)
        for part in ("args", "expr", "lhs", "rhs", "vector_selector", "param"):
            child = getattr(node, part, None)
            for each in child if isinstance(child, list) else [child]:
                if each is not None and type(each).__module__ == "promql_parser":
                    walk(each)

    walk(promql_parser.parse(dashboard.as_prometheus_sees_it(expr, RATE_INTERVAL)))
    return selectors, grouping


def family(metric: str) -> tuple[str, set[str]]:
    """The documented family a series name belongs to, and the labels its series carry beside the documented."""
    for part in HISTOGRAM_PARTS:
        if metric.endswith(part) and metric.removesuffix(part) in documented_labels():
            return metric.removesuffix(part), {"le"} if part == "_bucket" else set()
    return metric, set()


def unknown_names(expr: str, legend: str = "") -> list[str]:
    """What `expr` (and its legend) names that the agent does not export."""
    documented = documented_labels()
    selectors, grouping = named(expr)
    problems, available = [], set(SCRAPE_LABELS)
    for metric, matched in selectors:
        name, extra = family(metric)
        if name not in documented:
            problems.append(f"metric {metric}")
            continue
        labels = set(documented[name]) | extra | SCRAPE_LABELS
        available |= labels
        problems += [f"label {label} of {metric}" for label in sorted(matched - labels)]
    problems += [f"label {label} (grouping)" for label in sorted(grouping - available)]
    problems += [f"label {label} (legend)" for label in sorted(set(re.findall(r"{{(\w+)}}", legend)) - available)]
    return problems


# --- the JSON shipped is the script's ---------------------------------------------------------------------------


@pytest.mark.parametrize("output", dashboard.outputs(), ids=lambda path: str(path.relative_to(ROOT)))
def test_the_committed_dashboard_is_what_the_script_writes(output: Path) -> None:
    assert output.read_text() == dashboard.outputs()[output], "run: .venv/bin/python packaging/dashboard.py"


def test_the_config_map_carries_the_json_for_the_grafana_sidecar() -> None:
    config_map = yaml.safe_load(dashboard.CONFIG_MAP.read_text())
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"][dashboard.FILE_NAME]) == board()


def test_the_dashboard_has_the_rows_and_variables_an_operator_filters_by() -> None:
    doc = board()
    rows = [panel["title"] for panel in doc["panels"] if panel["type"] == "row"]
    assert rows == ["Capacity", "Use", "Health and trust", "Latency and refusals"]
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "node", "resource", "gpu"]
    for panel in doc["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["description"].endswith("?"), f"{panel['title']}: its description is the question"


# --- every query ------------------------------------------------------------------------------------------------


def test_every_query_parses_as_prometheus_parses_it(tmp_path: Path) -> None:
    """promtool checks each query as a recording rule's expression: Prometheus's own parser."""
    if PROMTOOL is None:
        if os.environ.get("CI"):
            raise RuntimeError("promtool is missing in CI: scripts/install-system-deps.sh installs it")
        pytest.skip("promtool not installed (run scripts/install-system-deps.sh)")
    doc = board()
    exprs = [expr for _, expr, _ in panel_queries(doc)]
    exprs += [f"count by ({label}) ({selector})" for _, selector, label in variable_queries(doc)]
    rules = [
        {"record": f"dashboard:query{index}", "expr": dashboard.as_prometheus_sees_it(expr, RATE_INTERVAL)}
        for index, expr in enumerate(exprs)
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(exprs)} rules found" in done.stdout


def test_every_query_names_only_metrics_and_labels_the_agent_exports() -> None:
    doc = board()
    problems = [f"{title}: {p}" for title, expr, legend in panel_queries(doc) for p in unknown_names(expr, legend)]
    problems += [
        f"variable {name}: {p}"
        for name, selector, label in variable_queries(doc)
        for p in unknown_names(f"count by ({label}) ({selector})")
    ]
    assert problems == []


@pytest.mark.parametrize(
    ("expr", "legend", "problem"),
    [
        ('mpsagent_gpu_live_grant{node=~"$node"}', "", "metric mpsagent_gpu_live_grant"),
        ('mpsagent_gpu_live_grants{gpu_uuid="x"}', "", "label gpu_uuid of mpsagent_gpu_live_grants"),
        ("sum by (route) (mpsagent_daemon_up)", "", "label route (grouping)"),
        ("mpsagent_daemon_up", "{{gpu}}", "label gpu (legend)"),
        ('rate(mpsagent_allocate_duration_seconds_bucket{le="1"}[$__rate_interval])', "", None),
    ],
)
def test_the_query_check_catches_a_renamed_metric_or_label(expr: str, legend: str, problem: str | None) -> None:
    assert unknown_names(expr, legend) == ([problem] if problem else [])


# --- the docs -------------------------------------------------------------------------------------------------


def test_the_metrics_page_says_what_each_panel_answers() -> None:
    text = METRICS_DOC.read_text()
    for _, panels in dashboard.ROWS:
        for spec in panels:
            assert f"| {spec.title} | {spec.answers} |" in text, f"docs/metrics.md: the panel {spec.title!r}"
