"""The Helm chart (packaging/helm/mpsagent) renders the kustomize base's objects (packaging/kubernetes, its
monitoring overlay with `monitoring.enabled`, and its DRA component with `dra.enabled`): the same kinds, names and
specs once Helm's standard labels are removed, and every other difference listed below with its reason. Each value
shows up where it should and nowhere else; bad values fail `helm template` with a message that names them.

helm comes from `HELM`, or from the e2e cluster's cache where `scripts/e2e-cluster build` puts it."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from packaging.version import Version

from mpsagent_testing.cluster.layout import BIN, TOOLS_BIN
from mpsagent_testing.packaging import DRA_RULES
from mpsagent_testing.repo import ROOT

CHART = ROOT / "packaging" / "helm" / "mpsagent"
KUSTOMIZE = ROOT / "packaging" / "kubernetes"
MONITORING = KUSTOMIZE / "monitoring"
DRA = KUSTOMIZE / "dra"
DRA_EXTENDED_RESOURCE = DRA / "extended-resource"
NAMESPACE = "mpsagent"
COMMAND_TIMEOUT_S = 60


def _helm() -> Path | None:
    if configured := os.environ.get("HELM"):
        if not os.access(configured, os.X_OK):
            raise RuntimeError(f"HELM={configured} is not an executable file")
        return Path(configured)
    cached = TOOLS_BIN / "helm"
    return cached if cached.is_file() else None


HELM = _helm()
if HELM is None:
    if os.environ.get("CI"):
        raise RuntimeError(f"helm is missing in CI: `scripts/e2e-cluster build` builds it in {TOOLS_BIN} (or set HELM)")
    pytest.skip(
        f"helm not built (`scripts/e2e-cluster build` builds it in {TOOLS_BIN}; or set HELM)", allow_module_level=True
    )

# Removed before comparing with kustomize: Helm's standard labels, on each object's metadata only.
STANDARD_LABELS = {
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
}
CONFIG_MAP = "ConfigMap/mpsagent-config"
AGENT = "DaemonSet/mpsagent"
HOST = "DaemonSet/mpsagent-mps-daemon"
POD = "spec.template.spec"

# Every difference between the chart's defaults and the kustomize base (ConfigMaps compared modulo their hash
# suffix, Helm's standard labels removed), with the reason it exists. A difference not listed here fails, and so
# does one listed here that went away.
INTENDED_DIFFERENCES = {
    f'{CONFIG_MAP}: data["config.yaml"]': (
        "the same document in other words: Helm's toYaml sorts the keys and drops the file's comment "
        "(test_the_config_is_the_base_s_document; a string config is kept as it is: "
        "test_a_config_file_given_as_a_string_is_kept_as_it_is)"
    ),
    f"{CONFIG_MAP}: metadata.annotations": (
        "helm.sh/resource-policy: keep: an upgrade with another config would delete the old ConfigMap while the "
        "mps-daemon pods (OnDelete) still mount it; `kubectl apply -k` keeps old ones as well"
    ),
}

ABSENT = object()
"""A path's value where it is not there."""
ANY = object()
"""An expected value: changed, checked by a test of its own."""


def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False, cwd=ROOT
    )


def helm_template(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return run(HELM, "template", NAMESPACE, CHART, "--namespace", NAMESPACE, *args)


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render(*args: str | Path) -> list[dict[str, Any]]:
    done = helm_template(*args)
    assert done.returncode == 0, done.stderr
    return documents(done.stdout)


def render_with(values: dict[str, Any], tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return render("-f", path, *args)


def kubectl() -> str:
    found = shutil.which("kubectl") or (str(BIN / "kubectl") if (BIN / "kubectl").is_file() else None)
    assert found, "scripts/install-system-deps.sh installs kubectl (Debian's kubernetes-client)"
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    done = run(kubectl(), "kustomize", directory)
    assert done.returncode == 0, done.stderr
    return documents(done.stdout)


def kustomize_with(directory: Path, components: list[Path]) -> list[dict[str, Any]]:
    """The base with these components, from a kustomization of an operator's own in `directory` (outside the base's
    folder: kustomize refuses an overlay inside its base's folder, and absolute paths)."""
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE, directory)],
        "components": [os.path.relpath(c, directory) for c in components],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(directory)


def key(obj: dict[str, Any]) -> str:
    """Kind and name; the config's ConfigMap's name without its hash suffix."""
    name = obj["metadata"]["name"]
    if is_config(obj):
        name = name.rsplit("-", 1)[0]
    return f"{obj['kind']}/{name}"


def is_config(obj: dict[str, Any]) -> bool:
    """The ConfigMap of the agent's config (named with its hash; the other, the dashboard's, is not)."""
    return bool(obj["kind"] == "ConfigMap" and obj["metadata"]["name"].startswith("mpsagent-config-"))


def by_key(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    keyed = {key(o): o for o in objects}
    assert len(keyed) == len(objects), sorted(key(o) for o in objects)
    return keyed


def without_hash(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects with the config's ConfigMap's hashed name, wherever it occurs, replaced by one placeholder."""
    (config_map,) = [o for o in objects if is_config(o)]
    hashed = config_map["metadata"]["name"]

    def replace(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: replace(v) for k, v in value.items()}
        if isinstance(value, list):
            return [replace(v) for v in value]
        return "mpsagent-config-<hash>" if value == hashed else value

    return [replace(o) for o in objects]


def without_standard_labels(obj: dict[str, Any]) -> dict[str, Any]:
    metadata = dict(obj["metadata"])
    labels = {k: v for k, v in metadata.pop("labels", {}).items() if k not in STANDARD_LABELS}
    if labels:
        metadata["labels"] = labels
    return {**obj, "metadata": metadata}


def step(path: str, name: str | int) -> str:
    if isinstance(name, int):
        return f"{path}[{name}]"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return f"{path}.{name}" if path else name
    return f'{path}["{name}"]'


def leaf_differences(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, a's value, b's value) for each place where the two differ, as deep as both have it."""
    if isinstance(a, dict) and isinstance(b, dict):
        for name in [*a, *(k for k in b if k not in a)]:
            yield from leaf_differences(a.get(name, ABSENT), b.get(name, ABSENT), step(path, name))
    elif isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            yield from leaf_differences(a[i] if i < len(a) else ABSENT, b[i] if i < len(b) else ABSENT, step(path, i))
    elif a != b:
        yield path, a, b


def differences(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """Every place where two renders differ: `Kind/name: path` (a whole object: `Kind/name`) -> (old, new)."""
    before, after = by_key(old), by_key(new)
    found: dict[str, tuple[Any, Any]] = {}
    for name in [*before, *(k for k in after if k not in before)]:
        if name not in before or name not in after:
            found[name] = (before.get(name, ABSENT), after.get(name, ABSENT))
            continue
        for path, a, b in leaf_differences(before[name], after[name]):
            found[f"{name}: {path}"] = (a, b)
    return found


def only(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return by_key(objects)[name]


def config_text(objects: list[dict[str, Any]]) -> str:
    text: str = only(objects, CONFIG_MAP)["data"]["config.yaml"]
    return text


@pytest.fixture(scope="module")
def defaults() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def with_monitoring() -> list[dict[str, Any]]:
    return render("--set", "monitoring.enabled=true")


# --- the chart as a whole -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], ["--set", "dra.enabled=true", "--set", "dra.extendedResourceClass=true"]],
                         ids=["defaults", "dra"])  # fmt: skip
def test_helm_lint_strict_finds_nothing(values: list[str]) -> None:
    assert HELM is not None
    done = run(HELM, "lint", "--strict", CHART, *values)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not re.search(r"\[(WARNING|ERROR)\]", done.stdout), done.stdout


@pytest.mark.parametrize("monitoring", [False, True], ids=["base", "monitoring"])
def test_the_chart_renders_the_kustomize_objects_differing_only_where_listed(
    monitoring: bool, defaults: list[dict[str, Any]], with_monitoring: list[dict[str, Any]]
) -> None:
    expected = kustomize(KUSTOMIZE) + (kustomize(MONITORING) if monitoring else [])
    rendered = with_monitoring if monitoring else defaults
    assert sorted(by_key(rendered)) == sorted(by_key(expected))
    helm = [without_standard_labels(o) for o in without_hash(rendered)]
    found = differences(without_hash(expected), helm)
    assert sorted(found) == sorted(INTENDED_DIFFERENCES), {
        k: v for k, v in found.items() if k not in INTENDED_DIFFERENCES
    }


def test_every_object_has_helm_s_standard_labels(with_monitoring: list[dict[str, Any]]) -> None:
    for obj in with_monitoring:
        assert obj["metadata"]["labels"].keys() >= STANDARD_LABELS, key(obj)
        assert obj["metadata"]["labels"]["app.kubernetes.io/version"] == "0.1.0"


def test_every_namespaced_object_is_in_the_release_s_namespace(with_monitoring: list[dict[str, Any]]) -> None:
    other = render("--namespace", "gpu-sharing", "--set", "monitoring.enabled=true")
    assert only(other, "Namespace/gpu-sharing")
    for objects, namespace in ((with_monitoring, NAMESPACE), (other, "gpu-sharing")):
        assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {namespace}


def test_the_config_is_the_base_s_document(defaults: list[dict[str, Any]]) -> None:
    base = (KUSTOMIZE / "config.yaml").read_text()
    assert yaml.safe_load((CHART / "values.yaml").read_text())["config"] == yaml.safe_load(base)
    assert yaml.safe_load(config_text(defaults)) == yaml.safe_load(base)


def test_a_config_file_given_as_a_string_is_kept_as_it_is(defaults: list[dict[str, Any]]) -> None:
    rendered = render("--set-file", f"config={KUSTOMIZE / 'config.yaml'}")
    assert config_text(rendered) == config_text(kustomize(KUSTOMIZE)) == (KUSTOMIZE / "config.yaml").read_text()
    assert only(rendered, CONFIG_MAP)["metadata"]["name"] != only(defaults, CONFIG_MAP)["metadata"]["name"]


def config_map_names(objects: list[dict[str, Any]]) -> set[str]:
    """The ConfigMap's name and every name the DaemonSets mount."""
    names = {only(objects, CONFIG_MAP)["metadata"]["name"]}
    for daemonset in (AGENT, HOST):
        pod = only(objects, daemonset)["spec"]["template"]["spec"]
        names |= {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    return names


def test_the_config_map_s_name_is_a_hash_of_the_config(defaults: list[dict[str, Any]]) -> None:
    (name,) = config_map_names(defaults)
    digest = hashlib.sha256(config_text(defaults).removesuffix("\n").encode()).hexdigest()
    assert name == f"mpsagent-config-{digest[:10]}"
    assert config_map_names(render()) == {name}  # the same config, the same name
    assert config_map_names(render("--set", "image.tag=0.2.0", "--set", "hostNetwork=true")) == {name}
    (changed,) = config_map_names(render("--set", "config.sharing.mps.resources[0].replicas=8"))
    assert changed != name and re.fullmatch(r"mpsagent-config-[0-9a-f]{10}", changed)


def comments(path: Path) -> str:
    """A file's comments as one line of words."""
    text = " ".join(line.split("#", 1)[1] for line in path.read_text().splitlines() if "#" in line)
    return " ".join(text.split())


# What the base's comments explain, kept in the templates.
WHY = {
    "mps-daemon.yaml": [
        "Bidirectional propagation (and mount(2)) need a privileged container",
        "OnDelete: replacing this pod ends the CUDA contexts of every MPS client on the node",
        "No probes: a failed liveness probe would restart this container and end every MPS client on the node",
        "Requests only: a memory limit or CPU throttling in this cgroup would hit the MPS daemons",
        "Every capability is dropped except: SETUID, SETGID the control daemon switching",
    ],
    "daemonset.yaml": [
        "Rolling updates are safe here: no MPS daemon or client runs in this pod",
        "A failed liveness probe restarts only the agent",
        "Every capability is dropped except SYS_ADMIN",
        "allowPrivilegeEscalation is left out: the API server refuses `false` together with SYS_ADMIN",
    ],
}


@pytest.mark.parametrize("name", sorted(WHY))
def test_the_templates_keep_the_base_s_explanations(name: str) -> None:
    base, template = comments(KUSTOMIZE / name), comments(CHART / "templates" / name)
    for reason in WHY[name]:
        assert reason in base, reason
        assert reason in template, reason


# --- values --------------------------------------------------------------------------------------------------------


# A test node's fake NVML library, mounted over the driver's.
FAKE_NVML_VOLUME = {"name": "fake-nvml", "hostPath": {"path": "/opt/fake/libnvidia-ml.so.1", "type": "File"}}
FAKE_NVML_MOUNT = {"name": "fake-nvml", "mountPath": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "readOnly": True}
FAKE_NVML = {"extraVolumes": [FAKE_NVML_VOLUME], "extraVolumeMounts": [FAKE_NVML_MOUNT]}


IMAGES = [f"{AGENT}: {POD}.containers[0]", f"{HOST}: {POD}.initContainers[0]", f"{HOST}: {POD}.containers[0]"]
PODS = [f"{AGENT}: {POD}", f"{HOST}: {POD}"]


def on_both_pods(changes: dict[str, Any]) -> dict[str, Any]:
    """The same changes in both DaemonSets' pod specs."""
    return {f"{pod}.{path}": value for pod in PODS for path, value in changes.items()}


AGENT_ENV = 10  # the base's variables: extra ones follow
HOST_ENV = 5

# Each case: values (with monitoring on, as for the render it is compared with) -> every path that changes, with its
# new value. Nothing else may change.
CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "image": (
        {"image": {"repository": "registry.example.com/mpsagent", "tag": "0.2.0"}},
        {f"{c}.image": "registry.example.com/mpsagent:0.2.0" for c in IMAGES},
    ),
    "pull policy": ({"image": {"pullPolicy": "Always"}}, {f"{c}.imagePullPolicy": "Always" for c in IMAGES}),
    "host network": ({"hostNetwork": True}, on_both_pods({"hostNetwork": True})),
    "agent env": (
        {"agent": {"extraEnv": [{"name": "LOG_LEVEL", "value": "debug"}]}},
        {f"{AGENT}: {POD}.containers[0].env[{AGENT_ENV}]": {"name": "LOG_LEVEL", "value": "debug"}},
    ),
    "daemon host env": (
        {"daemonHost": {"extraEnv": [{"name": "LOG_LEVEL", "value": "debug"}]}},
        {f"{HOST}: {POD}.containers[0].env[{HOST_ENV}]": {"name": "LOG_LEVEL", "value": "debug"}},
    ),
    "agent volumes": (
        {"agent": FAKE_NVML},
        {
            f"{AGENT}: {POD}.volumes[6]": FAKE_NVML_VOLUME,
            f"{AGENT}: {POD}.containers[0].volumeMounts[6]": FAKE_NVML_MOUNT,
        },
    ),
    "daemon host volumes": (
        {"daemonHost": FAKE_NVML},
        {
            f"{HOST}: {POD}.volumes[3]": FAKE_NVML_VOLUME,
            f"{HOST}: {POD}.containers[0].volumeMounts[3]": FAKE_NVML_MOUNT,
        },
    ),
    "probe host": (
        {"agent": {p: {"httpGet": {"host": "127.0.0.1"}} for p in ("livenessProbe", "readinessProbe")}},
        {f"{AGENT}: {POD}.containers[0].{p}.httpGet.host": "127.0.0.1" for p in ("livenessProbe", "readinessProbe")},
    ),
    "probe removed": (
        {"agent": {"readinessProbe": None}},
        {f"{AGENT}: {POD}.containers[0].readinessProbe": ABSENT},
    ),
    "metrics port": (
        {"metricsPort": 9500},
        {
            f"{AGENT}: {POD}.containers[0].env[6].value": "0.0.0.0:9500",
            f"{AGENT}: {POD}.containers[0].ports[0].containerPort": 9500,
            f"{AGENT}: {POD}.containers[0].livenessProbe.httpGet.port": 9500,
            f"{AGENT}: {POD}.containers[0].readinessProbe.httpGet.port": 9500,
            "NetworkPolicy/mpsagent-metrics: spec.ingress[0].ports[0].port": 9500,
            "PrometheusRule/mpsagent: spec.groups[0].rules[7].annotations.description": ANY,
        },
    ),
    "shm size": ({"daemonHost": {"shmSize": "2G"}}, {f"{HOST}: {POD}.initContainers[0].env[1].value": "2G"}),
    "resources": (
        {
            "agent": {"resources": {"limits": {"memory": "1Gi"}}},
            "daemonHost": {"resources": {"requests": {"cpu": "1"}}},
        },
        {
            f"{AGENT}: {POD}.containers[0].resources.limits.memory": "1Gi",
            f"{HOST}: {POD}.containers[0].resources.requests.cpu": "1",
        },
    ),
    "node selection": (
        {"affinity": None, "nodeSelector": {"example.com/mps": "true"}},
        on_both_pods({"affinity": ABSENT, "nodeSelector": {"example.com/mps": "true"}}),
    ),
    "tolerations": (
        {"tolerations": [{"operator": "Exists"}]},
        on_both_pods({"tolerations[0].key": ABSENT, "tolerations[0].effect": ABSENT, "tolerations[1]": ABSENT}),
    ),
    "priority and runtime class": (
        {"priorityClassName": "", "runtimeClassName": "nvidia"},
        on_both_pods({"priorityClassName": ABSENT, "runtimeClassName": "nvidia"}),
    ),
    "no namespace": ({"namespace": {"create": False}}, {f"Namespace/{NAMESPACE}": ABSENT}),
    "monitoring labels": (
        {"monitoring": {"labels": {"release": "prometheus"}}},
        {f"{o}: metadata.labels.release": "prometheus" for o in ("PodMonitor/mpsagent", "PrometheusRule/mpsagent")},
    ),
    "prometheus namespace": (
        {"monitoring": {"prometheusNamespace": "observability"}},
        {
            "NetworkPolicy/mpsagent-metrics: "
            'spec.ingress[0].from[0].namespaceSelector.matchLabels["kubernetes.io/metadata.name"]': "observability"
        },
    ),
    "config": (
        {"config": {"sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 8}]}}}},
        {
            f"{CONFIG_MAP}: metadata.name": ANY,
            f'{CONFIG_MAP}: data["config.yaml"]': ANY,
            f"{AGENT}: {POD}.volumes[0].configMap.name": ANY,
            f"{HOST}: {POD}.volumes[0].configMap.name": ANY,
        },
    ),
}

NEWEST_KUBERNETES = str(max(Version(v) for v in all_versions()))
CUSTOM_RESOURCES = {"PodMonitor", "PrometheusRule"}  # not in kubernetes-validate's schemas


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_a_changed_value_shows_up_where_it_should_and_nowhere_else(
    case: str, with_monitoring: list[dict[str, Any]], tmp_path: Path
) -> None:
    values, expected = CHANGES[case]
    rendered = render_with(values, tmp_path, "--set", "monitoring.enabled=true")
    found = differences(with_monitoring, rendered)
    assert sorted(found) == sorted(expected)
    for path, value in expected.items():
        if value is not ANY:
            assert found[path][1] == value, path
    for obj in rendered:
        if obj["kind"] not in CUSTOM_RESOURCES:
            kubernetes_validate.validate(obj, NEWEST_KUBERNETES, strict=True)


def test_the_dashboard_comes_with_monitoring_unless_turned_off() -> None:
    def dashboards(*values: str) -> list[str]:
        return [o["metadata"]["name"] for o in render(*values) if o["metadata"]["name"] == "mpsagent-dashboard"]

    assert dashboards() == []
    assert dashboards("--set", "monitoring.enabled=true") == ["mpsagent-dashboard"]
    assert dashboards("--set", "monitoring.enabled=true", "--set", "monitoring.dashboard=false") == []


def test_the_metrics_port_is_in_the_alert_that_names_it(tmp_path: Path) -> None:
    rendered = render_with({"metricsPort": 9500, "monitoring": {"enabled": True}}, tmp_path)
    rules = only(rendered, "PrometheusRule/mpsagent")["spec"]["groups"][0]["rules"]
    (cut,) = [r for r in rules if r["alert"] == "MpsagentHttpConnectionsCut"]
    assert "connections to port 9500 open" in cut["annotations"]["description"]


def test_a_changed_config_is_in_the_config_map(tmp_path: Path) -> None:
    values, _ = CHANGES["config"]
    config = yaml.safe_load(config_text(render_with(values, tmp_path)))
    assert config["sharing"]["mps"]["resources"] == [{"name": "nvidia.com/gpu", "replicas": 8}]
    assert config["flags"]["migStrategy"] == "none"  # Helm merges a map given in values with the default


def test_monitoring_is_off_by_default(defaults: list[dict[str, Any]]) -> None:
    assert {o["kind"] for o in defaults} == {"Namespace", "ConfigMap", "DaemonSet"}


# --- bad values ----------------------------------------------------------------------------------------------------

BAD_VALUES: dict[str, tuple[list[str], str]] = {
    "no config": (["--set", "config=null"], "config: the agent's config (the NVIDIA device plugin's v1 format"),
    "config not a map": (["--set", "config=7"], "config: expected a map or a string (the file's text), got a int64"),
    "config not YAML": (["--set-string", "config=version: [v1"], "config: not YAML"),
    "config of another version": (
        ["--set", "config.version=v2"],
        'config.version: expected v1 (the NVIDIA device plugin\'s config format), got "v2"',
    ),
    "config without a version": (
        ["--set", "config.version=null"],
        "config.version: expected v1 (the NVIDIA device plugin's config format), got nothing",
    ),
    "no image": (["--set", "image.repository="], "image.repository: the image of the agent"),
    "port 0": (["--set", "metricsPort=0"], "metricsPort: expected a port number (1..65535), got 0"),
    "port not a number": (["--set", "metricsPort=http"], "metricsPort: expected a port number (1..65535), got http"),
    "port too high": (["--set", "metricsPort=70000"], "metricsPort: expected a port number (1..65535), got 70000"),
    "shm size": (["--set", "daemonHost.shmSize=1G;reboot"], "daemonHost.shmSize: expected a tmpfs size"),
    "host network": (["--set-string", "hostNetwork=yes"], "hostNetwork: expected true or false, got yes"),
    "prometheus namespace": (
        ["--set", "monitoring.enabled=true", "--set", "monitoring.prometheusNamespace="],
        "monitoring.prometheusNamespace: the namespace Prometheus runs in is required",
    ),
    "dra not a map": (["--set", "dra=7"], "dra: expected a map (enabled, deviceClasses, extendedResourceClass), got 7"),
    "dra.enabled not a boolean": (["--set-string", "dra.enabled=yes"], "dra.enabled: expected true or false, got yes"),
    "dra.deviceClasses not a boolean": (
        ["--set-string", "dra.deviceClasses=on"],
        "dra.deviceClasses: expected true or false, got on",
    ),
    "dra.extendedResourceClass not a boolean": (
        ["--set-string", "dra.extendedResourceClass=false"],
        "dra.extendedResourceClass: expected true or false, got false",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_fail_with_a_message_naming_them(case: str) -> None:
    args, message = BAD_VALUES[case]
    done = helm_template(*args)
    assert done.returncode != 0, done.stdout
    assert message in done.stderr


# --- the DRA driver (dra.*) ----------------------------------------------------------------------------------------

DRA_ON = ["--set", "dra.enabled=true"]
EXTENDED_RESOURCE_CLASS = ["--set", "dra.extendedResourceClass=true"]
SHARE_CLASS = "DeviceClass/mps-share.mpsagent.io"
GPU_CLASS = "DeviceClass/mps-gpu.mpsagent.io"
DRA_SELECTORS = [{"cel": {"expression": 'device.driver == "mps.mpsagent.io"'}}]
DRA_RBAC = ["ServiceAccount/mpsagent", "ClusterRole/mpsagent-dra", "ClusterRoleBinding/mpsagent-dra"]
DRA_HOST_PATHS = {
    "plugins-registry": "/var/lib/kubelet/plugins_registry",
    "plugins": "/var/lib/kubelet/plugins",
    "cdi": "/var/run/cdi",
}
DRA_ENV = {
    "DRA": {"name": "DRA", "value": "on"},
    "NODE_NAME": {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
}
# resource.k8s.io/v1 with consumable capacity and DeviceClass.spec.extendedResourceName: 1.36 and newer.
DRA_KUBERNETES = [
    v for v in sorted({str(Version(v)) for v in all_versions()}, key=Version) if Version(v) >= Version("1.36")
]


@pytest.fixture(scope="module")
def with_dra() -> list[dict[str, Any]]:
    return render(*DRA_ON, *EXTENDED_RESOURCE_CLASS)


def agent_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = only(objects, AGENT)["spec"]["template"]["spec"]
    return pod


def dra_parts(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """What dra.enabled adds, as found in a render: objects by key, the agent's pod's service account fields,
    DRA env entries, and the mounts and volumes of the driver's host paths."""
    pod = agent_pod(objects)
    (container,) = pod["containers"]
    return {
        "objects": {k: o for k, o in by_key(objects).items() if k in {*DRA_RBAC, SHARE_CLASS, GPU_CLASS}},
        "account": {k: pod.get(k) for k in ("serviceAccountName", "automountServiceAccountToken")},
        "env": {e["name"]: e for e in container["env"] if e["name"] in {*DRA_ENV, "KUBECONFIG"}},
        "mounts": {m["name"]: m["mountPath"] for m in container["volumeMounts"] if m["name"] in DRA_HOST_PATHS},
        "volumes": {v["name"]: v["hostPath"] for v in pod["volumes"] if v["name"] in DRA_HOST_PATHS},
    }


@pytest.mark.parametrize("extended", [False, True], ids=["dra", "dra-extended-resource"])
def test_dra_renders_the_kustomize_component_s_objects_differing_only_where_listed(
    extended: bool, with_dra: list[dict[str, Any]], tmp_path: Path
) -> None:
    components = [DRA, DRA_EXTENDED_RESOURCE] if extended else [DRA]
    expected = kustomize_with(tmp_path, components)
    rendered = with_dra if extended else render(*DRA_ON)
    assert sorted(by_key(rendered)) == sorted(by_key(expected))
    helm = [without_standard_labels(o) for o in without_hash(rendered)]
    found = differences(without_hash(expected), helm)
    assert sorted(found) == sorted(INTENDED_DIFFERENCES), {
        k: v for k, v in found.items() if k not in INTENDED_DIFFERENCES
    }


def test_dra_renders_the_driver_s_rbac_classes_env_and_mounts(with_dra: list[dict[str, Any]]) -> None:
    parts = dra_parts(with_dra)
    objects = parts["objects"]
    assert sorted(objects) == sorted([*DRA_RBAC, SHARE_CLASS, GPU_CLASS])
    assert objects["ClusterRole/mpsagent-dra"]["rules"] == DRA_RULES
    assert objects["ClusterRoleBinding/mpsagent-dra"]["roleRef"]["name"] == "mpsagent-dra"
    assert objects["ClusterRoleBinding/mpsagent-dra"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "mpsagent", "namespace": NAMESPACE}
    ]
    assert objects[SHARE_CLASS]["spec"] == {"selectors": DRA_SELECTORS}
    assert objects[GPU_CLASS]["spec"] == {"selectors": DRA_SELECTORS, "extendedResourceName": "nvidia.com/gpu"}
    assert parts["account"] == {"serviceAccountName": "mpsagent", "automountServiceAccountToken": True}
    assert parts["env"] == DRA_ENV  # DRA the string "on"; no KUBECONFIG: the service account's in-cluster config
    assert parts["mounts"] == DRA_HOST_PATHS
    assert {name: volume["path"] for name, volume in parts["volumes"].items()} == DRA_HOST_PATHS
    # The rest of the agent's variables, mounts and volumes follow, as without DRA.
    (container,) = agent_pod(with_dra)["containers"]
    assert [e["name"] for e in container["env"][:2]] == list(DRA_ENV)
    assert [m["name"] for m in container["volumeMounts"][:3]] == list(DRA_HOST_PATHS)
    # The mps-daemon pods get no token.
    host = only(with_dra, HOST)["spec"]["template"]["spec"]
    assert "serviceAccountName" not in host and host["automountServiceAccountToken"] is False
    for obj in with_dra:
        assert obj["metadata"]["labels"].keys() >= STANDARD_LABELS, key(obj)
        if obj["kind"] not in CUSTOM_RESOURCES:
            for version in DRA_KUBERNETES:
                kubernetes_validate.validate(obj, version, strict=True)


def test_dra_is_off_by_default(defaults: list[dict[str, Any]]) -> None:
    assert dra_parts(defaults) == {
        "objects": {},
        "account": {"serviceAccountName": None, "automountServiceAccountToken": False},
        "env": {},
        "mounts": {},
        "volumes": {},
    }
    # The classes' switches do nothing without dra.enabled.
    assert render(*EXTENDED_RESOURCE_CLASS) == defaults


def test_dra_s_device_classes_are_switched_on_their_own() -> None:
    assert DRA_KUBERNETES, "kubernetes-validate has no schemas of Kubernetes 1.36 or newer"
    keys = set(by_key(render(*DRA_ON)))
    assert {*DRA_RBAC, SHARE_CLASS} <= keys and GPU_CLASS not in keys
    keys = set(by_key(render(*DRA_ON, "--set", "dra.deviceClasses=false")))
    assert set(DRA_RBAC) <= keys and not {SHARE_CLASS, GPU_CLASS} & keys
    keys = set(by_key(render(*DRA_ON, *EXTENDED_RESOURCE_CLASS, "--set", "dra.deviceClasses=false")))
    assert GPU_CLASS in keys and SHARE_CLASS not in keys


def test_dra_s_namespaced_objects_are_in_the_release_s_namespace_and_the_classes_in_none() -> None:
    objects = by_key(render(*DRA_ON, *EXTENDED_RESOURCE_CLASS, "--namespace", "gpu-sharing"))
    assert objects["ServiceAccount/mpsagent"]["metadata"]["namespace"] == "gpu-sharing"
    assert objects["ClusterRoleBinding/mpsagent-dra"]["subjects"][0]["namespace"] == "gpu-sharing"
    for name in ("ClusterRole/mpsagent-dra", "ClusterRoleBinding/mpsagent-dra", SHARE_CLASS, GPU_CLASS):
        assert "namespace" not in objects[name]["metadata"], name
