"""Where the docs state a name the code defines (a log event, an environment variable, a node label), the two
cannot drift apart."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpsagent.base.settings import SETTINGS
from mpsagent_testing.metrics import documented_labels
from mpsagent_testing.repo import ROOT

DOCS = ROOT / "docs"


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """The module's top-level names bound to a string (`TAMPER_EVENT = "..."`)."""
    strings = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        target = node.target if isinstance(node, ast.AnnAssign) else target
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
            strings[target.id] = value.value
    return strings


def logged_problems(package: Path) -> set[str]:
    """Every warning and error event logged with a literal name, or a module constant's."""
    events = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        strings = _module_strings(tree)
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"warning", "error", "critical", "exception"}
                and node.args
            ):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                events.add(first.value)
            elif isinstance(first, ast.Name) and first.id in strings:
                events.add(strings[first.id])
    return events


def test_every_warning_and_error_event_is_documented() -> None:
    documented = (DOCS / "operations.md").read_text() + (DOCS / "troubleshooting.md").read_text()
    undocumented = sorted(e for e in logged_problems(ROOT / "mpsagent") if f'"{e}"' not in documented)
    assert undocumented == [], "add these events to docs/operations.md"


def test_the_event_check_catches_a_new_event(tmp_path: Path) -> None:
    (tmp_path / "module.py").write_text(
        'EVENT = "named once"\nlog.warning("a new surprise", key=1)\nlog.info("fine")\nlog.error(EVENT)\n'
    )
    assert logged_problems(tmp_path) == {"a new surprise", "named once"}


def test_every_node_label_is_documented() -> None:
    from mpsagent.node.nfd import node_labels  # noqa: PLC0415

    labels = set(node_labels((), (_resource(),)))
    text = (DOCS / "operations.md").read_text() + (DOCS / "migrating.md").read_text()
    assert sorted(label for label in labels if f"`{label}" not in text) == []


def _resource():  # type: ignore[no-untyped-def]
    from mpsagent.base.config import resolve_settings  # noqa: PLC0415
    from mpsagent.domain.plan import build_plan  # noqa: PLC0415
    from mpsagent.gpu.snapshot import SnapshotGpuSource  # noqa: PLC0415

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


def test_help_names_every_setting_s_environment_variable() -> None:
    assert help_variables() == {entry.env for entry in SETTINGS.values()}


# Flags that choose what a run does rather than how the agent runs: plain argparse entries, in no settings table.
MODE_FLAGS = {"--once", "--status", "--daemon-host", "--output", "--version"}


@dataclass(frozen=True)
class DocumentedSetting:
    env: str
    key: str
    default: str
    nvidia: str | None


def documented_settings(text: str, columns: Sequence[str]) -> tuple[dict[str, DocumentedSetting], set[str]]:
    """The settings a Markdown flag table documents, by flag, and the flags of its rows without a variable.

    `columns` names the table's columns (`flag`, `env`, `key`, `default`, `nvidia`; others ignored). A default is
    written first in its cell, as `value` or (words); what follows explains it.
    """
    rows: dict[str, DocumentedSetting] = {}
    modes: set[str] = set()
    for line in text.splitlines():
        cells = dict(zip(columns, (cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]), strict=False))
        flags = re.findall(r"`(--[a-z-]+)", cells.get("flag", ""))
        if not line.startswith("| `--") or not flags:
            continue
        if not cells.get("env"):
            modes.update(flags)
            continue
        default = re.match(r"`[^`]*`|\([^)]*\)", cells.get("default", ""))
        rows[flags[0]] = DocumentedSetting(
            env=cells["env"].strip("`"),
            key=cells.get("key", "").strip("`"),
            default=default.group(0) if default else cells.get("default", ""),
            nvidia=cells.get("nvidia"),
        )
    return rows, modes


def table_settings(*, with_keys: bool) -> dict[str, DocumentedSetting]:
    """What a flag table must say about each setting, from the table of settings."""
    return {
        entry.flag: DocumentedSetting(
            env=entry.env,
            key=(entry.key or "") if with_keys else "",
            default=entry.documented_default,
            nvidia=entry.nvidia if with_keys else None,
        )
        for entry in SETTINGS.values()
    }


README_COLUMNS = ("flag", "env", "default", "note")
CONFIGURATION_COLUMNS = ("flag", "env", "key", "default", "nvidia")


def test_the_readme_lists_exactly_the_settings_with_their_defaults() -> None:
    rows, modes = documented_settings((ROOT / "README.md").read_text(), README_COLUMNS)
    assert rows == table_settings(with_keys=False)
    assert modes == MODE_FLAGS


def test_the_configuration_page_lists_exactly_the_settings_with_their_keys_and_defaults() -> None:
    rows, modes = documented_settings((DOCS / "configuration.md").read_text(), CONFIGURATION_COLUMNS)
    assert rows == table_settings(with_keys=True)
    assert modes <= MODE_FLAGS


@pytest.mark.parametrize(
    ("drift", "changed"),
    [
        pytest.param(("| `MPS_ON_EXIT` | `keep` |", "| `MPS_ON_EXIT` | `quit` |"), "--mps-on-exit", id="default"),
        pytest.param(("| `PROC_ROOT` |", "| `HOST_PROC` |"), "--proc-root", id="variable"),
        pytest.param(("| `--proc-root DIR` |", "| `--host-proc DIR` |"), "--proc-root", id="flag"),
        pytest.param(("| `--once` | |", "| `--soon` | `SOON` | `1` | |\n| `--once` | |"), "--soon", id="extra row"),
    ],
)
def test_the_settings_check_catches_a_drifted_readme(drift: tuple[str, str], changed: str) -> None:
    readme = (ROOT / "README.md").read_text()
    assert drift[0] in readme
    rows, _ = documented_settings(readme.replace(*drift), README_COLUMNS)
    expected = table_settings(with_keys=False)
    assert rows != expected
    assert rows.get(changed) != expected.get(changed)


def test_the_settings_check_catches_a_drifted_key() -> None:
    page = (DOCS / "configuration.md").read_text().replace("| `logLevel` |", "| `loglevel` |")
    rows, _ = documented_settings(page, CONFIGURATION_COLUMNS)
    assert rows["--log-level"].key == "loglevel" != SETTINGS["log_level"].key


class _NoProcesses:
    """A GPU source with no processes: enough for the GPU collector to declare its families."""

    def processes(self, gpu: str) -> list[object]:
        return []


def exported_families() -> set[str]:
    from prometheus_client import generate_latest  # noqa: PLC0415

    from mpsagent.documents.metrics import AgentMetrics  # noqa: PLC0415
    from mpsagent.documents.status import starting_document  # noqa: PLC0415
    from mpsagent.web import WebEndpoint  # noqa: PLC0415

    metrics = AgentMetrics(
        starting=starting_document(["nvidia.com/gpu"]),
        gpus=("GPU-00000000-aaaa-bbbb-cccc-dddddddddddd",),
        gpu_source=_NoProcesses(),  # type: ignore[arg-type]
        proc_root=ROOT,
    )
    WebEndpoint(("127.0.0.1", 0), metrics)  # registers the endpoint's own connection metrics
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


def real_node_tests() -> set[str]:
    """The test functions of tests/e2e, by name."""
    names = set()
    for path in (ROOT / "tests" / "e2e").glob("test_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    return names


def test_the_e2e_page_names_every_real_node_scenario_and_the_node_s_pins() -> None:
    from mpsagent_testing.cluster import layout  # noqa: PLC0415

    text = (DOCS / "e2e.md").read_text()
    tests = real_node_tests()
    assert sorted(name for name in tests if f"`{name}`" not in text) == [], "add these scenarios to docs/e2e.md"
    assert sorted(set(re.findall(r"`(test_\w+)`", text)) - tests) == [], "docs/e2e.md names tests that are gone"
    releases = (*layout.KUBERNETES_VERSIONS, layout.VERSION_VARIABLE)
    pins = (*releases, layout.HELM_VERSION, layout.BUSYBOX_IMAGE, layout.SERVICE_CIDR)
    caches = [layout.CACHE_ROOT / version / "bin" for version in layout.KUBERNETES_VERSIONS]
    paths = (*caches, layout.TOOLS_BIN, layout.IMAGES, layout.STATE, layout.RUN, layout.KUBECONFIG, layout.KUBELET_ROOT)
    assert sorted(str(value) for value in (*pins, *paths) if str(value) not in text) == []


def test_the_metrics_table_gives_each_status_metric_its_labels() -> None:
    """The labels an operator writes queries with (`seen_by`, `outcome`, ...) are the ones exported."""
    from mpsagent.documents.status_document import STATUS_METRICS  # noqa: PLC0415

    documented = documented_labels()
    for row in STATUS_METRICS:
        name = row.name + ("_total" if row.kind == "counter" else "")
        assert documented[name] == row.labels, name


def test_the_metrics_table_gives_every_grant_kind() -> None:
    """A grant kind is a value of the grant metrics' `kind` label: a new one is a new series the table names."""
    from mpsagent.domain.grant_kind import GrantKind  # noqa: PLC0415

    (row,) = re.findall(r"^\| `mpsagent_grants_total` \|.*$", (DOCS / "metrics.md").read_text(), re.MULTILINE)
    assert f"`kind` ({', '.join(f'`{kind}`' for kind in GrantKind)})" in row


def test_the_ceiling_watch_fields_of_status_json_are_the_documented_ones() -> None:
    """docs/operations.md's table of the daemon's watch fields names each field of the status document it covers."""
    import msgspec  # noqa: PLC0415

    from mpsagent.mps.daemon_status import CapTamperEvent, ControlLogStatus  # noqa: PLC0415

    text = (DOCS / "operations.md").read_text()
    documented = set()
    for cell in re.findall(r"^\| (`capTamper[^|]*|`lastCapTamper[^|]*|`controlLog[^|]*) \|", text, re.MULTILINE):
        names = re.findall(r"`([\w.]+)`", cell)
        parent = names[0].split(".")[0]
        documented |= {names[0], *(parent + name for name in names[1:] if name.startswith("."))}
    fields = {"capTamper", "capTamperInLog"}
    fields |= {f"lastCapTamper.{f.encode_name}" for f in msgspec.structs.fields(CapTamperEvent)}
    fields |= {f"controlLog.{f.encode_name}" for f in msgspec.structs.fields(ControlLogStatus)}
    assert documented == fields
