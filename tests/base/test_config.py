"""The config file: what is accepted, what is refused (with the key path), what is ignored, and precedence."""

from __future__ import annotations

import contextlib
import json
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpsagent.base.config import (
    AllocationPolicy,
    DeviceIdStrategy,
    DeviceListStrategy,
    SharingConfig,
    check_config,
    parse_config,
    resolve_settings,
)
from mpsagent.base.errors import ConfigError, UsageError
from mpsagent.base.settings import DEFAULT_KUBELET_SOCKET, DEFAULT_MPS_ROOT
from mpsagent_testing.strategies import config_like, json_values

# --- helpers ------------------------------------------------------------------------------------------------

MINIMAL = """\
version: v1
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def load(text: str) -> SharingConfig:
    return check_config(parse_config(textwrap.dedent(text), "config.yaml"))


def refused(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(text)
    return info.value


def with_flags(flags: str) -> str:
    """MINIMAL plus a `flags:` section given as YAML flow text."""
    return MINIMAL + f"flags: {flags}\n"


def with_resources(*entries: str) -> str:
    """A v1 file whose sharing.mps.resources are these YAML flow mappings."""
    return "version: v1\nsharing:\n  mps:\n    resources:\n" + "".join(f"    - {entry}\n" for entry in entries)


# --- the GPU Operator examples ------------------------------------------------------------------------------

MPS_ANY = MINIMAL
MPS_FOUR = """\
version: v1
sharing:
  mps:
    renameByDefault: false
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
MPS_TWO = """\
version: v1
sharing:
  mps:
    renameByDefault: false
    resources:
    - name: nvidia.com/gpu
      replicas: 2
"""


@pytest.mark.parametrize(
    ("text", "replicas"),
    [
        pytest.param(MPS_ANY, 4, id="mps-any"),
        pytest.param(MPS_FOUR, 4, id="mps-four"),
        pytest.param(MPS_TWO, 2, id="mps-two"),
    ],
)
def test_gpu_operator_examples_are_accepted(text: str, replicas: int) -> None:
    sharing = load(text)
    assert len(sharing.resources) == 1
    (spec,) = sharing.resources
    assert spec.name == "nvidia.com/gpu"
    assert spec.advertised_name == "nvidia.com/gpu"
    assert spec.renamed is False
    assert spec.replicas == replicas
    assert spec.devices == "all"
    assert spec.path == "sharing.mps.resources[0]"
    # Omitted in the file: the NVIDIA default applies.
    assert sharing.fail_requests_greater_than_one is True
    assert sharing.enforce_caps is True
    assert sharing.device_list_strategy is DeviceListStrategy.ENVVAR
    assert sharing.device_id_strategy is DeviceIdStrategy.UUID
    assert sharing.allocation_policy is AllocationPolicy.DISTRIBUTED
    assert sharing.ignored_keys == ()


def test_the_same_config_as_json_is_accepted() -> None:
    document = {"version": "v1", "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}}
    assert load(json.dumps(document)) == load(MPS_ANY)


@pytest.mark.parametrize(
    ("mps_extra", "entry", "name", "advertised", "renamed"),
    [
        pytest.param(
            "renameByDefault: true",
            "name: nvidia.com/gpu",
            "nvidia.com/gpu",
            "nvidia.com/gpu.shared",
            True,
            id="by-default",
        ),
        pytest.param(
            "renameByDefault: false",
            "name: nvidia.com/gpu",
            "nvidia.com/gpu",
            "nvidia.com/gpu",
            False,
            id="not-by-default",
        ),
        pytest.param(
            "", "name: nvidia.com/gpu, rename: gpu-mps", "nvidia.com/gpu", "nvidia.com/gpu-mps", True, id="rename-short"
        ),
        pytest.param(
            "",
            "name: nvidia.com/gpu, rename: example.com/mps",
            "nvidia.com/gpu",
            "example.com/mps",
            True,
            id="rename-domain",
        ),
        # An explicit rename wins over renameByDefault.
        pytest.param(
            "renameByDefault: true",
            "name: gpu, rename: gpu-mps",
            "nvidia.com/gpu",
            "nvidia.com/gpu-mps",
            True,
            id="rename-beats-default",
        ),
        # A rename to the name itself is no rename.
        pytest.param(
            "", "name: gpu, rename: nvidia.com/gpu", "nvidia.com/gpu", "nvidia.com/gpu", False, id="rename-to-itself"
        ),
        pytest.param("", "name: gpu", "nvidia.com/gpu", "nvidia.com/gpu", False, id="short-name-gets-nvidia-domain"),
        pytest.param(
            "renameByDefault: true",
            "name: example.com/tpu",
            "example.com/tpu",
            "example.com/tpu.shared",
            True,
            id="by-default-other-domain",
        ),
    ],
)
def test_advertised_names(mps_extra: str, entry: str, name: str, advertised: str, renamed: bool) -> None:
    text = "version: v1\nsharing:\n  mps:\n"
    if mps_extra:
        text += f"    {mps_extra}\n"
    text += f"    resources:\n    - {{{entry}, replicas: 4}}\n"
    (spec,) = load(text).resources
    assert spec.name == name
    assert spec.advertised_name == advertised
    assert spec.renamed is renamed


@pytest.mark.parametrize(
    ("key", "value", "attribute", "expected"),
    [
        ("failRequestsGreaterThanOne", "false", "fail_requests_greater_than_one", False),
        ("failRequestsGreaterThanOne", "true", "fail_requests_greater_than_one", True),
        ("enforceCaps", "false", "enforce_caps", False),
    ],
)
def test_mps_switches(key: str, value: str, attribute: str, expected: bool) -> None:
    text = f"version: v1\nsharing:\n  mps:\n    {key}: {value}\n    resources:\n    - {{name: gpu, replicas: 2}}\n"
    assert getattr(load(text), attribute) is expected


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ("all", "all"),
        ("2", 2),
        ("[0, 3]", [0, 3]),
        ('["1", GPU-aaaa]', ["1", "GPU-aaaa"]),
    ],
)
def test_device_selectors_are_kept_for_the_plan(devices: str, expected: object) -> None:
    (spec,) = load(with_resources(f"{{name: gpu, replicas: 2, devices: {devices}}}")).resources
    assert spec.devices == expected


# --- accepted plugin flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "attribute", "expected"),
    [
        ("{plugin: {deviceListStrategy: envvar}}", "device_list_strategy", DeviceListStrategy.ENVVAR),
        ("{plugin: {deviceListStrategy: cdi-cri}}", "device_list_strategy", DeviceListStrategy.CDI_CRI),
        ("{plugin: {deviceListStrategy: [cdi-cri]}}", "device_list_strategy", DeviceListStrategy.CDI_CRI),
        ("{plugin: {deviceIDStrategy: uuid}}", "device_id_strategy", DeviceIdStrategy.UUID),
        ("{plugin: {deviceIDStrategy: index}}", "device_id_strategy", DeviceIdStrategy.INDEX),
        ("{plugin: {sharedDevicesAllocationPolicy: packed}}", "allocation_policy", AllocationPolicy.PACKED),
        ("{plugin: {sharedDevicesAllocationPolicy: distributed}}", "allocation_policy", AllocationPolicy.DISTRIBUTED),
        ("{migStrategy: none}", "device_list_strategy", DeviceListStrategy.ENVVAR),
        ("{migStrategy: single}", "device_list_strategy", DeviceListStrategy.ENVVAR),
    ],
)
def test_accepted_flags(flags: str, attribute: str, expected: object) -> None:
    assert getattr(load(with_flags(flags)), attribute) == expected


# --- refusals -----------------------------------------------------------------------------------------------

REFUSALS = [
    # version
    pytest.param(MINIMAL.replace("version: v1", "version: v2"), "version", "`v2` is not supported", id="version-v2"),
    pytest.param(MINIMAL.replace("version: v1", "version: 1"), "version", "expected `str | null`", id="version-int"),
    # time-slicing and MIG
    pytest.param(
        MINIMAL + "  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
        "sharing.timeSlicing",
        "time-slicing is not supported",
        id="time-slicing",
    ),
    pytest.param(
        "version: v1\nsharing:\n  timeSlicing: {}\n",
        "sharing.timeSlicing",
        "time-slicing is not supported",
        id="time-slicing-alone",
    ),
    pytest.param(with_flags("{migStrategy: mixed}"), "flags.migStrategy", "`mixed` is not supported", id="mig-mixed"),
    pytest.param(
        with_flags("{migStrategy: bogus}"), "flags.migStrategy", "use one of: none, single, mixed", id="mig-unknown"
    ),
    # unknown keys, at several depths
    pytest.param(MINIMAL + "sharng: {}\n", "sharng", "unknown key", id="unknown-top-level"),
    pytest.param(
        with_flags("{plugin: {deviceListStrategey: envvar}}"),
        "flags.plugin.deviceListStrategey",
        "unknown key",
        id="unknown-in-flags-plugin",
    ),
    pytest.param(with_flags("{migStrategie: none}"), "flags.migStrategie", "unknown key", id="unknown-in-flags"),
    pytest.param(
        MINIMAL.replace("  mps:\n", "  mps:\n    renameByDefaults: true\n"),
        "sharing.mps.renameByDefaults",
        "unknown key",
        id="unknown-in-mps",
    ),
    pytest.param(
        with_resources("{name: a, replicas: 2}", "{name: b, replica: 2}"),
        "sharing.mps.resources[1].replica",
        "unknown key",
        id="unknown-in-resources[1]",
    ),
    # wrong types
    pytest.param(
        with_resources("{name: gpu, replicas: four}"),
        "sharing.mps.resources[0].replicas",
        "expected `int`, got `str`",
        id="replicas-str",
    ),
    pytest.param(
        with_resources('{name: gpu, replicas: "4"}'),
        "sharing.mps.resources[0].replicas",
        "expected `int`, got `str`",
        id="replicas-quoted",
    ),
    pytest.param(
        with_resources("{name: gpu, replicas: 4.5}"),
        "sharing.mps.resources[0].replicas",
        "expected `int`, got `float`",
        id="replicas-float",
    ),
    pytest.param(
        with_resources("{name: gpu, replicas: true}"),
        "sharing.mps.resources[0].replicas",
        "expected `int`, got `bool`",
        id="replicas-bool",
    ),
    pytest.param(
        with_resources("{replicas: 4}"), "sharing.mps.resources[0]", "required key `name` is missing", id="name-missing"
    ),
    pytest.param(
        with_resources("{name: gpu}"),
        "sharing.mps.resources[0]",
        "required key `replicas` is missing",
        id="replicas-missing",
    ),
    pytest.param("version: v1\nsharing:\n  mps: [1, 2]\n", "sharing.mps", "expected `object", id="mps-list"),
    pytest.param(
        MINIMAL.replace("  mps:\n", "  mps:\n    renameByDefault: yes please\n"),
        "sharing.mps.renameByDefault",
        "expected `bool`",
        id="rename-by-default-str",
    ),
    # replica limits
    pytest.param(
        with_resources("{name: gpu, replicas: 0}"),
        "sharing.mps.resources[0].replicas",
        "must be between 1 and 48",
        id="replicas-0",
    ),
    pytest.param(
        with_resources("{name: gpu, replicas: 49}"),
        "sharing.mps.resources[0].replicas",
        "must be between 1 and 48",
        id="replicas-49",
    ),
    pytest.param(
        with_resources("{name: gpu, replicas: -1}"),
        "sharing.mps.resources[0].replicas",
        "must be between 1 and 48",
        id="replicas-negative",
    ),
    # device selectors that need no GPU to refuse
    pytest.param(
        with_resources("{name: gpu, replicas: 2, devices: 0}"),
        "sharing.mps.resources[0].devices",
        "a device count must be at least 1",
        id="devices-0",
    ),
    pytest.param(
        with_resources("{name: gpu, replicas: 2, devices: []}"),
        "sharing.mps.resources[0].devices",
        "the device list is empty",
        id="devices-empty-list",
    ),
    pytest.param(
        with_resources("{name: gpu, replicas: 2, devices: some}"),
        "sharing.mps.resources[0].devices",
        "invalid enum value 'some'",
        id="devices-word",
    ),
    # resource names the kubelet would refuse
    pytest.param(
        with_resources("{name: kubernetes.io/gpu, replicas: 2}"),
        "sharing.mps.resources[0].name",
        "is in the kubernetes.io domain",
        id="name-kubernetes.io",
    ),
    pytest.param(
        with_resources("{name: foo.kubernetes.io/gpu, replicas: 2}"),
        "sharing.mps.resources[0].name",
        "is in the kubernetes.io domain",
        id="name-sub.kubernetes.io",
    ),
    pytest.param(
        with_resources("{name: requests.foo/gpu, replicas: 2}"),
        "sharing.mps.resources[0].name",
        "must not start with `requests.`",
        id="name-requests.",
    ),
    pytest.param(
        with_resources("{name: Example.COM/gpu, replicas: 2}"),
        "sharing.mps.resources[0].name",
        "domain `Example.COM` must be a lowercase DNS subdomain",
        id="name-uppercase-domain",
    ),
    pytest.param(
        with_resources(f"{{name: nvidia.com/{'g' * 64}, replicas: 2}}"),
        "sharing.mps.resources[0].name",
        "must be at most 63 characters",
        id="name-64-chars",
    ),
    pytest.param(
        with_resources('{name: "nvidia.com/gp*u", replicas: 2}'),
        "sharing.mps.resources[0].name",
        "name part `gp*u` must be",
        id="name-star",
    ),
    pytest.param(
        with_resources("{name: nvidia.com/-gpu, replicas: 2}"),
        "sharing.mps.resources[0].name",
        "starting and ending with a letter or digit",
        id="name-leading-dash",
    ),
    pytest.param(
        with_resources("{name: a/b/c, replicas: 2}"),
        "sharing.mps.resources[0].name",
        "`a/b/c` must be of the form domain/name",
        id="name-two-slashes",
    ),
    pytest.param(
        with_resources("{name: nvidia.com/, replicas: 2}"),
        "sharing.mps.resources[0].name",
        "must be of the form domain/name",
        id="name-empty-part",
    ),
    pytest.param(
        with_resources("{name: ok, replicas: 2}", "{name: /gpu, replicas: 2}"),
        "sharing.mps.resources[1].name",
        "domain `` must be a lowercase DNS subdomain",
        id="name-empty-domain",
    ),
    # a final newline, which `$` lets through (re.match), and the kubelet's further rules
    pytest.param(
        with_resources('{name: "nvidia.com/gpu\\n", replicas: 2}'),
        "sharing.mps.resources[0].name",
        "name part `gpu\\n` must be",
        id="name-final-newline",
    ),
    pytest.param(
        with_resources('{name: "nvidia.com\\n/gpu", replicas: 2}'),
        "sharing.mps.resources[0].name",
        "domain `nvidia.com\\n` must be a lowercase DNS subdomain",
        id="domain-final-newline",
    ),
    pytest.param(
        with_resources('{name: gpu, rename: "gpu-shared\\n", replicas: 2}'),
        "sharing.mps.resources[0].rename",
        "name part `gpu-shared\\n` must be",
        id="rename-final-newline",
    ),
    pytest.param(
        with_resources("{name: notkubernetes.io/gpu, replicas: 2}"),
        "sharing.mps.resources[0].name",
        "is in the kubernetes.io domain",
        id="name-ends-in-kubernetes.io",
    ),
    pytest.param(
        with_resources(f"{{name: {'a' * 245}/gpu, replicas: 2}}"),
        "sharing.mps.resources[0].name",
        "DNS subdomain of at most 244 characters",
        id="domain-no-room-for-requests.",
    ),
    # rename
    pytest.param(
        with_resources("{name: gpu, rename: kubernetes.io/mps, replicas: 2}"),
        "sharing.mps.resources[0].rename",
        "is in the kubernetes.io domain",
        id="rename-kubernetes.io",
    ),
    pytest.param(
        with_resources('{name: gpu, rename: "mps gpu", replicas: 2}'),
        "sharing.mps.resources[0].rename",
        "name part `mps gpu` must be",
        id="rename-space",
    ),
    pytest.param(
        with_resources("{name: gpu, rename: Bad_Domain/gpu, replicas: 2}"),
        "sharing.mps.resources[0].rename",
        "must be a lowercase DNS subdomain",
        id="rename-bad-domain",
    ),
    pytest.param(
        "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n"
        f"    - {{name: {'g' * 60}, replicas: 2}}\n",
        "sharing.mps.resources[0].name",
        "with renameByDefault the advertised name is invalid",
        id="rename-by-default-too-long",
    ),
    # two resources advertised under one name
    pytest.param(
        with_resources("{name: gpu, replicas: 2, devices: [0]}", "{name: gpu, replicas: 3, devices: [1]}"),
        "sharing.mps.resources[1].name",
        "`nvidia.com/gpu` is already advertised by sharing.mps.resources[0]",
        id="same-name",
    ),
    pytest.param(
        with_resources("{name: gpu, replicas: 2, devices: [0]}", "{name: nvidia.com/gpu, replicas: 3, devices: [1]}"),
        "sharing.mps.resources[1].name",
        "is already advertised",
        id="same-name-once-qualified",
    ),
    pytest.param(
        with_resources(
            "{name: gpu, replicas: 2, devices: [0]}", "{name: other, rename: gpu, replicas: 3, devices: [1]}"
        ),
        "sharing.mps.resources[1].name",
        "`nvidia.com/gpu` is already advertised",
        id="same-name-by-rename",
    ),
    # nothing to share
    pytest.param("version: v1\n", "sharing.mps.resources", "no MPS sharing is configured", id="no-sharing"),
    pytest.param("version: v1\nsharing: {}\n", "sharing.mps.resources", "no MPS sharing is configured", id="no-mps"),
    pytest.param(
        "version: v1\nsharing:\n  mps: {}\n", "sharing.mps.resources", "no MPS sharing is configured", id="no-resources"
    ),
    pytest.param(
        "version: v1\nsharing:\n  mps:\n    resources: []\n",
        "sharing.mps.resources",
        "no MPS sharing is configured",
        id="empty-resources",
    ),
    # plugin flags
    pytest.param(
        with_flags("{plugin: {deviceListStrategy: volume-mounts}}"),
        "flags.plugin.deviceListStrategy",
        "`volume-mounts` is not supported; use one of: envvar, cdi-cri",
        id="list-volume-mounts",
    ),
    pytest.param(
        with_flags("{plugin: {deviceListStrategy: [envvar, cdi-cri]}}"),
        "flags.plugin.deviceListStrategy",
        "give exactly one strategy (envvar or cdi-cri), not 2",
        id="list-two-items",
    ),
    pytest.param(
        with_flags("{plugin: {deviceListStrategy: []}}"),
        "flags.plugin.deviceListStrategy",
        "give exactly one strategy (envvar or cdi-cri), not 0",
        id="list-empty",
    ),
    pytest.param(
        with_flags("{plugin: {deviceListStrategy: cdi-annotations}}"),
        "flags.plugin.deviceListStrategy",
        "`cdi-annotations` is not supported",
        id="list-cdi-annotations",
    ),
    pytest.param(
        with_flags("{plugin: {deviceIDStrategy: serial}}"),
        "flags.plugin.deviceIDStrategy",
        "`serial` is not supported; use one of: uuid, index",
        id="id-serial",
    ),
    pytest.param(
        with_flags("{plugin: {sharedDevicesAllocationPolicy: random}}"),
        "flags.plugin.sharedDevicesAllocationPolicy",
        "`random` is not supported; use one of: distributed, packed",
        id="policy-random",
    ),
]


@pytest.mark.parametrize(("text", "path", "phrase"), REFUSALS)
def test_refusals_name_the_key(text: str, path: str, phrase: str) -> None:
    error = refused(text)
    assert error.path == path
    assert phrase in error.message
    assert str(error) == f"{path}: {error.message}"


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        pytest.param("", "config.yaml is empty", id="empty"),
        pytest.param("   \n\n  \n", "config.yaml is empty", id="blank"),
        pytest.param("# only a comment\n", "config.yaml is empty", id="comment"),
        pytest.param("~\n", "config.yaml is empty", id="null"),
        pytest.param("- version: v1\n- sharing: {}\n", "must hold a mapping at the top level, not a list", id="list"),
        pytest.param("v1\n", "must hold a mapping at the top level, not a str", id="scalar"),
        pytest.param("42\n", "must hold a mapping at the top level, not a int", id="int"),
        pytest.param("version: v1\nsharing: [\n", "is not valid YAML or JSON at line 3", id="unclosed-bracket"),
        pytest.param(
            "version: v1\nsharing:\n  mps: {}\n bad: indent\n", "is not valid YAML or JSON at line 4", id="bad-indent"
        ),
        pytest.param('{"version": "v1",,}', "is not valid YAML or JSON at line 1", id="bad-json"),
        pytest.param("a: 1\n---\nb: 2\n", "is not valid YAML or JSON", id="two-documents"),
        pytest.param("a: !!python/object:os.system x\n", "is not valid YAML or JSON", id="python-tag"),
        pytest.param("a: &x [*x]\n", "refers to itself through the alias *x at line 1", id="self-reference"),
        pytest.param("a: &x {b: [*x]}\n", "refers to itself through the alias *x", id="self-reference-deeper"),
        pytest.param("a: 2024-13-45\n", "holds a value that cannot be read (month must be in 1..12)", id="bad-date"),
        pytest.param("a: \x1f\n", "is not valid YAML or JSON", id="control-character"),
        pytest.param("2024-01-01: 1\n", "neither YAML nor JSON data", id="date-key"),
    ],
)
def test_unreadable_documents(text: str, phrase: str) -> None:
    error = refused(text)
    assert error.path == ""
    assert phrase in error.message
    assert "config.yaml" in error.message


def test_invalid_yaml_names_line_and_column() -> None:
    error = refused("version: v1\nsharing:\n  mps:\n    resources: [\n  - :\n")
    assert error.message.startswith("config.yaml is not valid YAML or JSON at line ")
    assert ", column " in error.message


# --- NVIDIA keys with no meaning here -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "ignored"),
    [
        ("flags: {gdsEnabled: true}\n", ("flags.gdsEnabled",)),
        ("flags: {mofedEnabled: false}\n", ("flags.mofedEnabled",)),
        ("flags: {nvidiaDriverRoot: /run/nvidia/driver}\n", ("flags.nvidiaDriverRoot",)),
        ("flags: {nvidiaDevRoot: /}\n", ("flags.nvidiaDevRoot",)),
        ("flags: {failOnInitError: true}\n", ("flags.failOnInitError",)),
        ("flags: {useNodeFeatureAPI: false}\n", ("flags.useNodeFeatureAPI",)),
        ("flags: {deviceDiscoveryStrategy: auto}\n", ("flags.deviceDiscoveryStrategy",)),
        ("flags: {gfd: {oneshot: false, sleepInterval: 60s}}\n", ("flags.gfd",)),
        ("flags: {plugin: {passDeviceSpecs: false}}\n", ("flags.plugin.passDeviceSpecs",)),
        ("flags: {plugin: {cdiAnnotationPrefix: cdi.k8s.io/}}\n", ("flags.plugin.cdiAnnotationPrefix",)),
        ("flags: {plugin: {nvidiaCTKPath: /usr/bin/nvidia-ctk}}\n", ("flags.plugin.nvidiaCTKPath",)),
        ("flags: {plugin: {containerDriverRoot: /driver-root}}\n", ("flags.plugin.containerDriverRoot",)),
        ("resources:\n  gpus:\n  - pattern: '*'\n    name: gpu\n", ("resources",)),
        ("imex: {channelIDs: [0]}\n", ("imex",)),
        (
            "flags:\n  migStrategy: none\n  failOnInitError: true\n  nvidiaDriverRoot: /\n"
            "  plugin:\n    passDeviceSpecs: true\n    deviceListStrategy: envvar\n    deviceIDStrategy: uuid\n"
            "resources: {}\n",
            ("flags.failOnInitError", "flags.nvidiaDriverRoot", "flags.plugin.passDeviceSpecs", "resources"),
        ),
        # The agent's own keys are not ignored.
        ("flags: {kubeletSocket: /k.sock, mpsRoot: /m, logLevel: debug, logFormat: json}\n", ()),
        ("flags: {mpsControlBin: /bin/ctl, mpsOnExit: quit, migStrategy: single}\n", ()),
    ],
)
def test_nvidia_keys_without_meaning_are_listed_as_ignored(extra: str, ignored: tuple[str, ...]) -> None:
    assert load(MINIMAL + extra).ignored_keys == ignored


# --- precedence ---------------------------------------------------------------------------------------------

SETTINGS = {
    # setting: (cli key, environment variable, key under `flags`, default)
    "kubelet_socket": ("kubelet_socket", "KUBELET_SOCKET", "kubeletSocket", DEFAULT_KUBELET_SOCKET),
    "mps_root": ("mps_root", "MPS_ROOT", "mpsRoot", DEFAULT_MPS_ROOT),
    "pod_resources_socket": (
        "pod_resources_socket",
        "POD_RESOURCES_SOCKET",
        "podResourcesSocket",
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
    ),
    "nfd_features_file": (
        "nfd_features_file",
        "NFD_FEATURES_FILE",
        "nfdFeaturesFile",
        Path("/etc/kubernetes/node-feature-discovery/features.d/mpsagent"),
    ),
    "proc_root": ("proc_root", "PROC_ROOT", "procRoot", Path("/proc")),
}


def test_defaults_are_the_documented_paths() -> None:
    assert Path("/var/lib/kubelet/device-plugins/kubelet.sock") == DEFAULT_KUBELET_SOCKET
    assert Path("/run/nvidia/mps") == DEFAULT_MPS_ROOT


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize(
    ("from_flag", "from_env", "from_file", "winner"),
    [
        (True, True, True, "flag"),
        (True, False, False, "flag"),
        (True, False, True, "flag"),
        (False, True, True, "env"),
        (False, True, False, "env"),
        (False, False, True, "file"),
        (False, False, False, "default"),
    ],
)
def test_precedence_flag_env_file_default(
    tmp_path: Path, setting: str, from_flag: bool, from_env: bool, from_file: bool, winner: str
) -> None:
    cli_key, env_var, file_key, default = SETTINGS[setting]
    values = {"flag": "/from/flag", "env": "/from/env", "file": "/from/file"}
    config = tmp_path / "config.yaml"
    text = MINIMAL + (f"flags:\n  {file_key}: {values['file']}\n" if from_file else "")
    config.write_text(text)
    cli: dict[str, object] = {"config_file": str(config)}
    if from_flag:
        cli[cli_key] = values["flag"]
    environ = {env_var: values["env"]} if from_env else {}
    resolved = getattr(resolve_settings(cli, environ), setting)
    assert resolved == (default if winner == "default" else Path(values[winner]))


@pytest.mark.parametrize("setting", sorted(set(SETTINGS) - {"nfd_features_file"}))  # there, empty means off
def test_an_empty_environment_variable_does_not_count(tmp_path: Path, setting: str) -> None:
    _, env_var, file_key, _ = SETTINGS[setting]
    config = tmp_path / "config.yaml"
    config.write_text(MINIMAL + f"flags:\n  {file_key}: /from/file\n")
    assert getattr(resolve_settings({"config_file": str(config)}, {env_var: ""}), setting) == Path("/from/file")


def test_flags_given_as_none_do_not_count(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(MINIMAL)
    settings_ = resolve_settings(
        {"config_file": str(config), "kubelet_socket": None, "mps_root": None}, {"MPS_ROOT": "/env/mps"}
    )
    assert settings_.kubelet_socket == DEFAULT_KUBELET_SOCKET
    assert settings_.mps_root == Path("/env/mps")


def test_config_file_from_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(MPS_TWO)
    settings_ = resolve_settings({}, {"CONFIG_FILE": str(config)})
    assert settings_.config_file == config
    assert settings_.sharing.resources[0].replicas == 2


def test_settings_carry_the_checked_sharing_config(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(MPS_FOUR)
    settings_ = resolve_settings({"config_file": str(config)}, {})
    assert settings_.sharing == load(MPS_FOUR)
    assert settings_.config_file == config
    assert settings_.log_level == "info"
    assert settings_.once is False
    assert settings_.node_snapshot is None


def test_missing_config_file_is_a_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(UsageError, match="--config-file") as info:
        resolve_settings({"config_file": str(missing)}, {})
    assert str(missing) in str(info.value)
    assert "no such file" in str(info.value)


@pytest.mark.parametrize(
    ("cli", "environ"),
    [({}, {}), ({"config_file": None}, {}), ({}, {"CONFIG_FILE": ""}), ({"config_file": ""}, {})],
)
def test_no_config_at_all_is_a_usage_error(cli: dict[str, object], environ: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="no configuration given: pass --config-file"):
        resolve_settings(cli, environ)


def test_a_bad_file_through_resolve_settings_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(MINIMAL.replace("replicas: 4", "replicas: 49"))
    with pytest.raises(ConfigError) as info:
        resolve_settings({"config_file": str(config)}, {})
    assert info.value.path == "sharing.mps.resources[0].replicas"


# --- nothing but ConfigError, whatever the input ------------------------------------------------------------


def only_config_errors(text: str) -> None:
    with contextlib.suppress(ConfigError):
        check_config(parse_config(text, "fuzz.yaml"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=json_values | config_like)
def test_any_json_document_raises_only_config_error(document: object) -> None:
    only_config_errors(json.dumps(document))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=json_values | config_like)
def test_any_yaml_document_raises_only_config_error(document: object) -> None:
    only_config_errors(yaml.safe_dump(document))


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_any_text_raises_only_config_error(text: str) -> None:
    only_config_errors(text)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("{}[]:,-&*!'\"#|>? \n\tav1")), max_size=80),
)
def test_any_yaml_punctuation_raises_only_config_error(text: str) -> None:
    only_config_errors(text)


def test_a_huge_integer_is_a_config_error() -> None:
    only_config_errors("version: v1\nflags:\n  gfd:\n    x: " + "1" * 5000 + "\n")


def test_a_document_of_too_many_values_is_refused_before_all_are_read() -> None:
    error = refused(MINIMAL + "flags:\n  gfd:\n    x: [" + "0," * 200_000 + "0]\n")
    assert error.message.startswith("config.yaml holds more than 100000 values (at line 9, column ")
    column = int(error.message.rpartition(" ")[2].rstrip(")"))
    assert column < 250_000  # stopped near the 100,001st value of 200,001


def test_a_deeply_nested_document_is_a_config_error() -> None:
    only_config_errors("[" * 1000 + "]" * 1000)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(MINIMAL + "flags:\n  plugin:\n", id="plugin-null"),
        pytest.param(MINIMAL + "flags:\n  plugin: {}\n", id="plugin-empty"),
        pytest.param(MINIMAL + "flags: {}\n", id="flags-empty"),
        pytest.param(MINIMAL.replace("replicas: 4", "replicas: 4\n      rename: null"), id="rename-null"),
    ],
)
def test_empty_sections_mean_defaults(text: str) -> None:
    assert load(text) == load(MINIMAL)


def test_a_null_resources_list_is_refused_on_its_path() -> None:
    assert refused("version: v1\nsharing:\n  mps:\n    resources:\n").path == "sharing.mps.resources"


def test_a_null_flags_section_means_defaults() -> None:
    assert load(MINIMAL + "flags:\n  # migStrategy: none\n") == load(MINIMAL)


# --- the agent's numeric and address settings ------------------------------------------------------------------


def settings_with(tmp_path: Path, file_flags: str = "", cli: dict[str, object] | None = None, **environ: str):
    config = tmp_path / "config.yaml"
    config.write_text(MINIMAL + (f"flags:\n{file_flags}" if file_flags else ""))
    return resolve_settings({"config_file": str(config), **(cli or {})}, environ)


def test_seconds_from_flag_env_and_file(tmp_path: Path) -> None:
    assert settings_with(tmp_path).reconcile_grace_s == 60
    assert settings_with(tmp_path, "  reconcileGraceSeconds: 15\n").reconcile_grace_s == 15
    assert settings_with(tmp_path, "  healthRecoverySeconds: 2.5\n").health_recovery_s == 2.5
    assert settings_with(tmp_path, RECONCILE_GRACE_SECONDS="17").reconcile_grace_s == 17
    assert settings_with(tmp_path, cli={"reconcile_grace_seconds": "10"}).reconcile_grace_s == 10
    assert (
        settings_with(tmp_path, cli={"health_recovery_seconds": "0"}, HEALTH_RECOVERY_SECONDS="9").health_recovery_s
        == 0
    )


@pytest.mark.parametrize("bad", ["-1", "soon", "1e9", "nan"])
def test_bad_seconds_name_the_flag_the_variable_and_the_key(tmp_path: Path, bad: str) -> None:
    with pytest.raises(UsageError) as info:
        settings_with(tmp_path, RECONCILE_GRACE_SECONDS=bad)
    message = str(info.value)
    assert "--reconcile-grace-seconds" in message and "RECONCILE_GRACE_SECONDS" in message
    assert "flags.reconcileGraceSeconds" in message and f"`{bad}`" in message


@pytest.mark.parametrize(
    ("file_flags", "cli", "environ", "shown"),
    [
        ("  reconcileGraceSeconds: 0\n", {}, {}, "0.0"),
        ("", {}, {"RECONCILE_GRACE_SECONDS": "9.99"}, "9.99"),
        ("", {"reconcile_grace_seconds": "0"}, {}, "0"),
    ],
)
def test_a_grace_period_below_the_floor_names_where_it_came_from(
    tmp_path: Path, file_flags: str, cli: dict[str, object], environ: dict[str, str], shown: str
) -> None:
    # The kubelet lists a container a moment after its Allocate; released before then, its caps would be lifted.
    with pytest.raises(UsageError) as info:
        settings_with(tmp_path, file_flags, cli, **environ)
    assert str(info.value) == (
        "--reconcile-grace-seconds (env RECONCILE_GRACE_SECONDS, config flags.reconcileGraceSeconds) must be a "
        f"number of seconds from 10 to 86400, not `{shown}`"
    )


@pytest.mark.parametrize(
    ("text", "address"),
    [("0.0.0.0:9402", ("0.0.0.0", 9402)), (":9402", ("0.0.0.0", 9402)), ("[::1]:80", ("::1", 80)), ("", None)],
)
def test_metrics_address_forms(tmp_path: Path, text: str, address: tuple[str, int] | None) -> None:
    assert settings_with(tmp_path, METRICS_ADDRESS=text).metrics_address == address
    assert settings_with(tmp_path, f"  metricsAddress: '{text}'\n").metrics_address == address


@pytest.mark.parametrize("bad", ["9402", "host:", "host:65536", "host:http", "a b:1"])
def test_bad_metrics_addresses_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(UsageError, match=r"--metrics-address .* must be HOST:PORT"):
        settings_with(tmp_path, cli={"metrics_address": bad})


def test_an_empty_nfd_path_turns_the_feature_file_off_even_over_the_file(tmp_path: Path) -> None:
    assert settings_with(tmp_path, "  nfdFeaturesFile: /x\n", NFD_FEATURES_FILE="").nfd_features_file is None
    assert settings_with(tmp_path, "  nfdFeaturesFile: ''\n").nfd_features_file is None
