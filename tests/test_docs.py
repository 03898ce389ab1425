"""Where the docs state a name the code defines (a log event, an environment variable, a node label), the two
cannot drift apart."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from mpsagent_testing.repo import ROOT

DOCS = ROOT / "docs"


def logged_problems(package: Path) -> set[str]:
    """Every warning and error event logged with a literal name."""
    events = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"warning", "error", "critical", "exception"}
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                events.add(node.args[0].value)
    return events


def test_every_warning_and_error_event_is_documented() -> None:
    documented = (DOCS / "operations.md").read_text() + (DOCS / "troubleshooting.md").read_text()
    undocumented = sorted(e for e in logged_problems(ROOT / "mpsagent") if f'"{e}"' not in documented)
    assert undocumented == [], "add these events to docs/operations.md"


def test_the_event_check_catches_a_new_event(tmp_path: Path) -> None:
    (tmp_path / "module.py").write_text('log.warning("a new surprise", key=1)\nlog.info("fine")\n')
    assert logged_problems(tmp_path) == {"a new surprise"}


def test_every_node_label_is_documented() -> None:
    from mpsagent.plan import node_labels  # noqa: PLC0415

    labels = set(node_labels((), (_resource(),)))
    text = (DOCS / "operations.md").read_text() + (DOCS / "migrating.md").read_text()
    assert sorted(label for label in labels if f"`{label}" not in text) == []


def _resource():  # type: ignore[no-untyped-def]
    from mpsagent.config import resolve_settings  # noqa: PLC0415
    from mpsagent.gpu.snapshot import SnapshotGpuSource  # noqa: PLC0415
    from mpsagent.plan import build_plan  # noqa: PLC0415

    settings = resolve_settings(
        {"config_file": str(ROOT / "packaging" / "kubernetes" / "config.yaml"), "node_snapshot": None}, environ={}
    )
    node = SnapshotGpuSource(ROOT / "examples" / "node-h100x8.yaml").discover()
    return build_plan(settings.sharing, node, settings.mps_root).resources[0]


def help_variables() -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "mpsagent", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True
    )
    return set(re.findall(r"\[env\s+([A-Z_]+)", done.stdout))


def table_variables(text: str) -> set[str]:
    """Environment variables in the second column of a Markdown flag table."""
    return set(re.findall(r"^\| `--(?:[^|\\]|\\.)*\| `([A-Z_]+)` \|", text, re.MULTILINE))


def test_flag_tables_name_exactly_the_agents_environment_variables() -> None:
    variables = help_variables()
    assert table_variables((ROOT / "README.md").read_text()) == variables
    assert table_variables((DOCS / "configuration.md").read_text()) == variables


class _NoProcesses:
    """A GPU source with no processes: enough for the GPU collector to declare its families."""

    def processes(self, gpu: str) -> list[object]:
        return []


def exported_families() -> set[str]:
    from prometheus_client import generate_latest  # noqa: PLC0415

    from mpsagent.metrics import AgentMetrics  # noqa: PLC0415
    from mpsagent.status import starting_document  # noqa: PLC0415

    metrics = AgentMetrics(
        starting=starting_document(["nvidia.com/gpu"]),
        gpus=("GPU-00000000-aaaa-bbbb-cccc-dddddddddddd",),
        gpu_source=_NoProcesses(),  # type: ignore[arg-type]
        proc_root=ROOT,
    )
    text = generate_latest(metrics.registry).decode()
    families = set()
    for name in re.findall(r"^# TYPE (\w+) ", text, re.MULTILINE):
        families.add(name)  # a counter's TYPE line names it with its `_total`
    return families


def test_the_metrics_table_lists_exactly_the_exported_metrics() -> None:
    documented = set(re.findall(r"^\| `(mpsagent_\w+)` \|", (DOCS / "metrics.md").read_text(), re.MULTILINE))
    exported = {name for name in exported_families() if name.startswith("mpsagent_")}
    assert sorted(documented - exported) == [], "documented but not exported"
    assert sorted(exported - documented) == [], "exported but not in docs/metrics.md"


def resolved_defaults() -> dict[str, str]:
    """Each environment variable's default as the agent resolves it with nothing set, as the tables write it."""
    from mpsagent.config import resolve_settings  # noqa: PLC0415

    settings = resolve_settings({"config_file": str(ROOT / "packaging" / "kubernetes" / "config.yaml")}, environ={})
    values: dict[str, object] = {
        "KUBELET_SOCKET": settings.kubelet_socket,
        "MPS_ROOT": settings.mps_root,
        "MPS_CONTROL_BIN": settings.mps_control_bin,
        "MPS_ON_EXIT": settings.mps_on_exit.value,
        "MPS_DAEMON": settings.mps_daemon.value,
        "POD_RESOURCES_SOCKET": settings.pod_resources_socket,
        "RECONCILE_GRACE_SECONDS": f"{settings.reconcile_grace_s:g}",
        "HEALTH_RECOVERY_SECONDS": f"{settings.health_recovery_s:g}",
        "PROBE_INTERVAL_SECONDS": f"{settings.probe_interval_s:g}",
        "NFD_FEATURES_FILE": settings.nfd_features_file,
        "PROC_ROOT": settings.proc_root,
        "LOG_FORMAT": settings.log_format.value,
        "LOG_LEVEL": settings.log_level,
    }
    assert settings.metrics_address is None and settings.node_snapshot is None  # documented as off / NVML
    return {variable: str(value) for variable, value in values.items()}


def table_defaults(text: str, column: int) -> dict[str, str]:
    """The first backticked value of the default column, by environment variable, of a Markdown flag table."""
    defaults = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        variable = re.fullmatch(r"`([A-Z_]+)`", cells[1]) if len(cells) > column else None
        value = re.match(r"`([^`]+)`", cells[column]) if variable else None
        if variable and value:
            defaults[variable.group(1)] = value.group(1)
    return defaults


def test_flag_tables_state_the_defaults_the_agent_uses() -> None:
    defaults = resolved_defaults()
    assert table_defaults((ROOT / "README.md").read_text(), 2) == defaults
    assert table_defaults((DOCS / "configuration.md").read_text(), 3) == defaults


def test_the_defaults_check_catches_a_drifted_default() -> None:
    readme = (ROOT / "README.md").read_text().replace("| `MPS_ON_EXIT` | `keep` |", "| `MPS_ON_EXIT` | `quit` |")
    assert table_defaults(readme, 2)["MPS_ON_EXIT"] == "quit"
    assert table_defaults(readme, 2) != resolved_defaults()
