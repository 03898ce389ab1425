"""The configuration: the NVIDIA device plugin's `v1` config file, plus the agent's own settings.

The only module that reads files or the environment for configuration. `load_config` parses and checks the
file's shape; checks that need the GPUs (device references, replica limits) live in `plan.build_plan`.
`resolve_settings` applies the precedence flag > environment variable > config `flags` > default.
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from mpsagent.documents import load_yaml
from mpsagent.errors import ConfigError, DocumentError, FileReadError, UsageError, shown
from mpsagent.host import read_input_file

DEFAULT_KUBELET_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
DEFAULT_MPS_ROOT = Path("/run/nvidia/mps")
DEFAULT_MPS_CONTROL_BIN = "nvidia-cuda-mps-control"
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_RECONCILE_GRACE_S = 60.0
# The kubelet lists a container a moment after its Allocate; below this, a grant could be released before then.
MIN_RECONCILE_GRACE_S = 10.0
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; NVIDIA's largest examples are a few KiB
DEFAULT_NFD_FEATURES_FILE = Path("/etc/kubernetes/node-feature-discovery/features.d/mpsagent")
DEFAULT_PROC_ROOT = Path("/proc")
DEFAULT_HEALTH_RECOVERY_S = 60.0
DEFAULT_PROBE_INTERVAL_S = 3.0
# Below 1 s the rounds cost more than they protect; above 60 s a lifted cap would last too long.
PROBE_INTERVAL_BOUNDS_S = (1.0, 60.0)
# Application errors: the GPU stays healthy (the NVIDIA device plugin's list).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
DEFAULT_RESOURCE_DOMAIN = "nvidia.com"
MAX_REPLICAS = 48
MAX_REPLICAS_BEFORE_VOLTA = 16
MIB_BYTES = 1 << 20


class _Strict(msgspec.Struct, rename="camel", forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base for config sections: camelCase keys, unknown keys refused (a typo must not pass silently)."""


DeviceSelector = Literal["all"] | int | list[int | str]


class MpsResource(_Strict, frozen=True):
    name: str
    replicas: int | msgspec.UnsetType = msgspec.UNSET
    # A Kubernetes quantity (`8Gi`): each device ID is that much memory of one GPU, instead of `replicas`.
    memory_unit: int | str | None = None
    rename: str | None = None
    # A float too: the NVIDIA plugin reads its files through YAML-to-JSON, so `devices: 2.0` means a count of 2.
    devices: Literal["all"] | int | float | list[int | str] = "all"


class MpsSharing(_Strict, frozen=True):
    rename_by_default: bool = False
    # Omitted means true: the NVIDIA plugin refuses multi-replica requests unless told otherwise.
    fail_requests_greater_than_one: bool = True
    enforce_caps: bool = True
    # proportional (the default): a grant's caps follow its share of each GPU; equal: 1/replicas for any partial grant.
    grants: str = "proportional"
    # auto (the default), true or false: run the daemon with one MPS server for every user (`-M`).
    multi_user: bool | str = "auto"
    resources: list[MpsResource] | None = None


class Sharing(_Strict, frozen=True):
    mps: MpsSharing | None = None
    time_slicing: dict[str, Any] | None = None


class PluginFlags(_Strict, frozen=True):
    device_list_strategy: str | list[str] | None = None
    device_id_strategy: str | None = msgspec.field(default=None, name="deviceIDStrategy")
    shared_devices_allocation_policy: str | None = None
    # NVIDIA keys without meaning here: accepted so that the same file works, reported as ignored.
    pass_device_specs: bool | None = None
    cdi_annotation_prefix: str | None = None
    nvidia_ctk_path: str | None = msgspec.field(default=None, name="nvidiaCTKPath")
    container_driver_root: str | None = None


class Flags(_Strict, frozen=True):
    mig_strategy: str | None = None
    mps_root: str | None = None
    plugin: PluginFlags | None = None
    # The agent's own settings, for operators who keep everything in one file.
    kubelet_socket: str | None = None
    log_format: str | None = None
    log_level: str | None = None
    mps_control_bin: str | None = None
    mps_on_exit: str | None = None
    mps_daemon: str | None = None
    pod_resources_socket: str | None = None
    reconcile_grace_seconds: float | None = None
    health_recovery_seconds: float | None = None
    probe_interval_seconds: float | None = None
    nfd_features_file: str | None = None
    metrics_address: str | None = None
    proc_root: str | None = None
    # NVIDIA keys without meaning here.
    fail_on_init_error: bool | None = None
    nvidia_driver_root: str | None = None
    nvidia_dev_root: str | None = None
    gds_enabled: bool | None = None
    gdrcopy_enabled: bool | None = None
    mofed_enabled: bool | None = None
    use_node_feature_api: bool | None = msgspec.field(default=None, name="useNodeFeatureAPI")
    device_discovery_strategy: str | None = None
    gfd: dict[str, Any] | None = None


class Imex(_Strict, frozen=True):
    channel_ids: list[int] | None = msgspec.field(default=None, name="channelIDs")
    required: bool | None = None


class ConfigFile(_Strict, frozen=True):
    version: str | None = None
    flags: Flags | None = None
    sharing: Sharing | None = None
    # NVIDIA sections without meaning here.
    resources: dict[str, Any] | None = None
    imex: Imex | None = None


_IGNORED_FLAG_KEYS = {
    "fail_on_init_error": "flags.failOnInitError",
    "nvidia_driver_root": "flags.nvidiaDriverRoot",
    "nvidia_dev_root": "flags.nvidiaDevRoot",
    "gds_enabled": "flags.gdsEnabled",
    "gdrcopy_enabled": "flags.gdrcopyEnabled",
    "mofed_enabled": "flags.mofedEnabled",
    "use_node_feature_api": "flags.useNodeFeatureAPI",
    "device_discovery_strategy": "flags.deviceDiscoveryStrategy",
    "gfd": "flags.gfd",
}
_IGNORED_PLUGIN_KEYS = {
    "pass_device_specs": "flags.plugin.passDeviceSpecs",
    "cdi_annotation_prefix": "flags.plugin.cdiAnnotationPrefix",
    "nvidia_ctk_path": "flags.plugin.nvidiaCTKPath",
    "container_driver_root": "flags.plugin.containerDriverRoot",
}


class DeviceListStrategy(enum.StrEnum):
    ENVVAR = "envvar"
    CDI_CRI = "cdi-cri"


class DeviceIdStrategy(enum.StrEnum):
    UUID = "uuid"
    INDEX = "index"


class AllocationPolicy(enum.StrEnum):
    DISTRIBUTED = "distributed"
    PACKED = "packed"


class LogFormat(enum.StrEnum):
    AUTO = "auto"
    JSON = "json"
    CONSOLE = "console"


class MpsOnExit(enum.StrEnum):
    KEEP = "keep"
    QUIT = "quit"


class MpsDaemonOwner(enum.StrEnum):
    """Who starts the MPS control daemons: the agent itself (a host process under systemd, where they outlive it),
    or `mpsagent --daemon-host` in a container of its own (Kubernetes: the daemons outlive the agent's container)."""

    AGENT = "agent"
    HOST = "host"


class GrantRule(enum.StrEnum):
    """`sharing.mps.grants`: how a grant's caps follow the replicas it holds. Proportional: k of a GPU's N IDs are
    k/N of that GPU; equal: the NVIDIA device plugin's rule (every replica of the resource: no caps; anything else:
    1/replicas of every GPU of the resource)."""

    PROPORTIONAL = "proportional"
    EQUAL = "equal"


class MultiUser(enum.StrEnum):
    """`sharing.mps.multiUser`: one MPS server for every user when the control binary offers it (auto), always
    (true: a binary without it is refused), or never (false: pods of different users take turns)."""

    AUTO = "auto"
    ON = "true"
    OFF = "false"


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourceSpec:
    """One `sharing.mps.resources[]` entry, normalised; `path` is its key path for error messages."""

    path: str
    name: str
    advertised_name: str
    replicas: int | None
    """Device IDs per GPU; None for a memory-unit resource."""
    memory_unit_bytes: int | None
    """Memory per device ID; None for a replica resource."""
    devices: DeviceSelector
    renamed: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class SharingConfig:
    """What the config file says about sharing and allocation, checked and with defaults applied."""

    resources: tuple[ResourceSpec, ...]
    fail_requests_greater_than_one: bool
    enforce_caps: bool
    device_list_strategy: DeviceListStrategy
    device_id_strategy: DeviceIdStrategy
    allocation_policy: AllocationPolicy
    ignored_keys: tuple[str, ...]
    multi_user: MultiUser = MultiUser.AUTO
    # Accepted as the NVIDIA plugin accepts them, but worth a warning (a missing `version`).
    warnings: tuple[str, ...] = ()
    grants: GrantRule = GrantRule.PROPORTIONAL


@dataclass(frozen=True, kw_only=True, slots=True)
class XidPolicy:
    """Which NVML critical Xids make a GPU unhealthy, from DP_DISABLE_HEALTHCHECKS and DP_ENABLE_HEALTHCHECKS.

    As in the NVIDIA device plugin: the application Xids are ignored; DISABLE adds Xids to ignore (`all` or
    `xids` ignores every Xid); ENABLE names Xids that count even so (`all` makes every Xid count).
    """

    ignored: frozenset[int] = APPLICATION_XIDS
    ignore_all: bool = False
    enabled: frozenset[int] = frozenset()
    enable_all: bool = False

    def is_critical(self, xid: int) -> bool:
        if self.enable_all or xid in self.enabled:
            return True
        return not self.ignore_all and xid not in self.ignored

    @property
    def watching(self) -> bool:
        """False when no Xid can ever count: the event watch is not started at all."""
        return self.enable_all or bool(self.enabled) or not self.ignore_all


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """Everything the agent runs with, after precedence is applied."""

    config_file: Path
    sharing: SharingConfig
    kubelet_socket: Path
    mps_root: Path
    mps_control_bin: str
    mps_on_exit: MpsOnExit
    node_snapshot: Path | None
    once: bool
    output: Literal["text", "json"]
    log_format: LogFormat
    log_level: str
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET
    reconcile_grace_s: float = DEFAULT_RECONCILE_GRACE_S
    health_recovery_s: float = DEFAULT_HEALTH_RECOVERY_S
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S
    xid_policy: XidPolicy = XidPolicy()
    nfd_features_file: Path | None = DEFAULT_NFD_FEATURES_FILE
    metrics_address: tuple[str, int] | None = None
    proc_root: Path = DEFAULT_PROC_ROOT
    mps_daemon: MpsDaemonOwner = MpsDaemonOwner.AGENT
    daemon_host: bool = False


_E = TypeVar("_E", bound=enum.StrEnum)


# --- reading the file -------------------------------------------------------------------------------------

_MSGSPEC_PATH = re.compile(r"(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.DOTALL)
_SHOWN_MESSAGE_CHARS = 200


def _key_path(msgspec_path: str) -> str:
    return shown(msgspec_path.lstrip("."), _SHOWN_MESSAGE_CHARS)


def _explain(exc: msgspec.ValidationError) -> ConfigError:
    match = _MSGSPEC_PATH.fullmatch(str(exc))
    what, path = (match.group("what"), match.group("path") or "") if match else (str(exc), "")
    unknown = re.fullmatch(r"Object contains unknown field `(?P<key>.*)`", what, re.DOTALL)
    if unknown:
        key = shown(unknown.group("key"))
        full = f"{_key_path(path)}.{key}" if path else key
        return ConfigError(full, "unknown key (check its spelling; see docs/configuration.md)")
    missing = re.fullmatch(r"Object missing required field `(?P<key>[^`]*)`", what)
    if missing:
        return ConfigError(_key_path(path), f"required key `{missing.group('key')}` is missing")
    return ConfigError(_key_path(path), shown(what[:1].lower() + what[1:], _SHOWN_MESSAGE_CHARS))


def parse_config(text: str, source: str) -> ConfigFile:
    """Parse YAML or JSON text into the file's structure; shape errors name the key path."""
    try:
        document = load_yaml(text)
    except DocumentError as exc:
        raise ConfigError("", f"{source} {exc}") from exc
    if document is None:
        raise ConfigError("", f"{source} is empty: it must configure sharing.mps.resources")
    if not isinstance(document, dict):
        raise ConfigError("", f"{source} must hold a mapping at the top level, not a {type(document).__name__}")
    try:
        # YAML gives dates, sets and non-string keys that JSON cannot carry; going through JSON makes them plain.
        plain = json.loads(json.dumps(document, default=str))
        return msgspec.convert(plain, ConfigFile, str_keys=True)
    except msgspec.ValidationError as exc:
        raise _explain(exc) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError("", f"{source} holds values that are neither YAML nor JSON data: {shown(exc)}") from exc


def load_config(path: Path) -> ConfigFile:
    try:
        text = read_input_file(path, max_bytes=MAX_CONFIG_BYTES, what="--config-file").decode("utf-8")
    except FileReadError as exc:
        raise UsageError(str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config-file {path}: is not UTF-8 text (at byte {exc.start})") from exc
    return parse_config(text, str(path))


# --- checking it ------------------------------------------------------------------------------------------

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
# The kubelet also checks `requests.<name>` (the name a quota uses), so the domain has that much less room.
_QUOTA_PREFIX = "requests."
_MAX_DOMAIN_CHARS = 253 - len(_QUOTA_PREFIX)


def qualify_resource_name(name: str) -> str:
    """A name without a domain means one under `nvidia.com`, as in the NVIDIA device plugin."""
    return name if "/" in name else f"{DEFAULT_RESOURCE_DOMAIN}/{name}"


def resource_name_problem(name: str) -> str | None:
    """Why the kubelet would refuse this extended resource name, or None when it is acceptable (the rules of
    Kubernetes' `IsExtendedResourceName`)."""
    domain, _, short = name.partition("/")
    if not short or "/" in short:
        return f"`{shown(name)}` must be of the form domain/name"
    if len(domain) > _MAX_DOMAIN_CHARS or not _DNS_SUBDOMAIN.fullmatch(domain):
        return f"domain `{shown(domain)}` must be a lowercase DNS subdomain of at most {_MAX_DOMAIN_CHARS} characters"
    if "kubernetes.io/" in name:
        return f"`{shown(name)}` is in the kubernetes.io domain, which the kubelet keeps for native resources"
    if name.startswith(_QUOTA_PREFIX):
        return f"`{shown(name)}` must not start with `{_QUOTA_PREFIX}`"
    if len(short) > 63 or not _QUALIFIED_NAME.fullmatch(short):
        return (
            f"name part `{shown(short)}` must be at most 63 characters of [A-Za-z0-9_.-], "
            "starting and ending with a letter or digit"
        )
    return None


def _one_of(kind: type[_E], value: str | None, default: _E, path: str) -> _E:
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise ConfigError(path, f"`{shown(value)}` is not supported; use one of: {choices}") from None


def _device_list_strategy(value: str | list[str] | None) -> DeviceListStrategy:
    path = "flags.plugin.deviceListStrategy"
    if isinstance(value, list):
        if len(value) != 1:
            raise ConfigError(path, f"give exactly one strategy (envvar or cdi-cri), not {len(value)}")
        value = value[0]
    return _one_of(DeviceListStrategy, value, DeviceListStrategy.ENVVAR, path)


_QUANTITY = re.compile(r"(?P<number>[0-9]{1,20}(?:\.[0-9]{1,20})?)(?P<suffix>[KMGTPE]i|[kMGTPE])?")
_QUANTITY_FACTORS: dict[str | None, int] = {
    None: 1,
    **{f"{prefix}i": 1024 ** (power + 1) for power, prefix in enumerate("KMGTPE")},
    **{prefix: 1000 ** (power + 1) for power, prefix in enumerate("kMGTPE")},
}


def parse_quantity(text: str) -> int | None:
    """Bytes of a Kubernetes quantity (`512Mi`, `8G`, `1.5Gi`), rounded down; None when it is not one."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        return None
    whole, _, fraction = match.group("number").partition(".")
    factor = _QUANTITY_FACTORS[match.group("suffix")]
    scale = int("1" + "0" * len(fraction))
    return int(whole) * factor + int(fraction or "0") * factor // scale


def _memory_unit(path: str, entry: MpsResource) -> int | None:
    """The resource's memory unit in bytes (None: a replica resource); the GPU-dependent bound is the plan's."""
    if entry.memory_unit is None:
        return None
    if not isinstance(entry.replicas, msgspec.UnsetType):
        raise ConfigError(path, "give either `replicas` or `memoryUnit`, not both")
    value = entry.memory_unit
    unit: int | None = value if isinstance(value, int) else parse_quantity(value)
    if unit is None:
        raise ConfigError(path, f"`{shown(value)}` is not a Kubernetes quantity; write it like 1Gi, 512Mi or 8G")
    if unit < MIB_BYTES:
        raise ConfigError(path, f"`{shown(value)}` is less than 1Mi; a memory unit is at least 1Mi, for example 1Gi")
    return unit


def _resource_spec(index: int, entry: MpsResource, rename_by_default: bool) -> ResourceSpec:
    path = f"sharing.mps.resources[{index}]"
    name = qualify_resource_name(entry.name)
    problem = resource_name_problem(name)
    if problem:
        raise ConfigError(f"{path}.name", problem)
    if entry.rename is not None:
        advertised = qualify_resource_name(entry.rename)
        problem = resource_name_problem(advertised)
        if problem:
            raise ConfigError(f"{path}.rename", problem)
    elif rename_by_default:
        advertised = f"{name}.shared"
        problem = resource_name_problem(advertised)
        if problem:
            raise ConfigError(f"{path}.name", f"with renameByDefault the advertised name is invalid: {problem}")
    else:
        advertised = name
    unit = _memory_unit(f"{path}.memoryUnit", entry)
    replicas = None if isinstance(entry.replicas, msgspec.UnsetType) else entry.replicas
    if unit is None and replicas is None:
        raise ConfigError(
            path, "required key `replicas` is missing (or give `memoryUnit`, the memory of one ID, e.g. 1Gi)"
        )
    if replicas is not None and not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(
            f"{path}.replicas",
            f"must be between 1 and {MAX_REPLICAS} (MPS client limit), not {shown(entry.replicas)}",
        )
    devices = _device_selector(f"{path}.devices", entry.devices)
    return ResourceSpec(
        path=path,
        name=name,
        advertised_name=advertised,
        replicas=replicas,
        memory_unit_bytes=unit,
        devices=devices,
        renamed=advertised != name,
    )


# The NVIDIA plugin's MIG references: a MIG index `<gpu>:<mig>`, `MIG-<uuid>` and `MIG-GPU-<uuid>/<gi>/<ci>`.
_MIG_REFERENCE = re.compile(r"[0-9]+:[0-9]+|MIG-.*", re.DOTALL)


def _device_selector(path: str, devices: Literal["all"] | float | list[int | str]) -> DeviceSelector:
    if isinstance(devices, float):
        # Beyond 2**53 a float is no exact count (and its digits would flood the messages that quote it).
        if not devices.is_integer() or abs(devices) > 2**53:
            raise ConfigError(path, f"a device count must be a whole number of GPUs, not {shown(devices)}")
        devices = int(devices)
    if isinstance(devices, int) and devices < 1:
        raise ConfigError(path, f"a device count must be at least 1, not {shown(devices)}")
    if isinstance(devices, list):
        if not devices:
            raise ConfigError(path, "the device list is empty; omit the key to mean all GPUs")
        for position, ref in enumerate(devices):
            if isinstance(ref, str) and _MIG_REFERENCE.fullmatch(ref):
                raise ConfigError(
                    f"{path}[{position}]",
                    f"`{shown(ref)}` is a MIG device; MIG devices cannot be shared through MPS: "
                    "list whole GPUs (an index or a GPU UUID)",
                )
    return devices


def _check_imex(imex: Imex | None) -> None:
    """As the NVIDIA plugin: channel 0 or none (the agent itself injects no IMEX channel)."""
    if imex is not None and imex.channel_ids not in (None, [], [0]):
        raise ConfigError("imex.channelIDs", f"must be [] or [0], not {shown(imex.channel_ids)}")


def check_config(config: ConfigFile) -> SharingConfig:
    """Apply the checks that need no GPUs; raises ConfigError naming the key path."""
    if config.version not in (None, "v1"):
        version = shown(config.version)
        raise ConfigError("version", f"`{version}` is not supported; this agent reads `version: v1` files")
    missing_version = "version is missing; reading the file as `version: v1` (add `version: v1` to say so)"
    warnings = (missing_version,) if config.version is None else ()
    _check_imex(config.imex)
    if config.sharing is not None and config.sharing.time_slicing is not None:
        raise ConfigError("sharing.timeSlicing", "time-slicing is not supported: mpsagent shares GPUs through MPS only")
    mps = config.sharing.mps if config.sharing else None
    if mps is None or not mps.resources:
        raise ConfigError("sharing.mps.resources", "no MPS sharing is configured; list at least one resource to share")
    flags = config.flags or Flags()
    mig = _one_of(_MigStrategy, flags.mig_strategy, _MigStrategy.NONE, "flags.migStrategy")
    if mig is _MigStrategy.MIXED:
        raise ConfigError("flags.migStrategy", "`mixed` is not supported with MPS sharing; use none or single")
    plugin = flags.plugin or PluginFlags()
    resources = tuple(_resource_spec(i, r, mps.rename_by_default) for i, r in enumerate(mps.resources))
    seen: dict[str, str] = {}
    for spec in resources:
        if spec.advertised_name in seen:
            raise ConfigError(
                f"{spec.path}.name", f"`{spec.advertised_name}` is already advertised by {seen[spec.advertised_name]}"
            )
        seen[spec.advertised_name] = spec.path
    ignored = [key for attr, key in _IGNORED_FLAG_KEYS.items() if getattr(flags, attr) is not None]
    ignored += [key for attr, key in _IGNORED_PLUGIN_KEYS.items() if getattr(plugin, attr) is not None]
    ignored += [key for key in ("resources", "imex") if getattr(config, key) is not None]
    return SharingConfig(
        resources=resources,
        fail_requests_greater_than_one=mps.fail_requests_greater_than_one,
        enforce_caps=mps.enforce_caps,
        device_list_strategy=_device_list_strategy(plugin.device_list_strategy),
        device_id_strategy=_one_of(
            DeviceIdStrategy, plugin.device_id_strategy, DeviceIdStrategy.UUID, "flags.plugin.deviceIDStrategy"
        ),
        allocation_policy=_one_of(
            AllocationPolicy,
            plugin.shared_devices_allocation_policy,
            AllocationPolicy.DISTRIBUTED,
            "flags.plugin.sharedDevicesAllocationPolicy",
        ),
        ignored_keys=tuple(ignored),
        multi_user=_one_of(MultiUser, str(mps.multi_user).lower(), MultiUser.AUTO, "sharing.mps.multiUser"),
        warnings=warnings,
        grants=_one_of(GrantRule, mps.grants, GrantRule.PROPORTIONAL, "sharing.mps.grants"),
    )


class _MigStrategy(enum.StrEnum):
    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


# --- precedence -------------------------------------------------------------------------------------------

_ENV = {
    "config_file": "CONFIG_FILE",
    "kubelet_socket": "KUBELET_SOCKET",
    "mps_root": "MPS_ROOT",
    "mps_control_bin": "MPS_CONTROL_BIN",
    "mps_on_exit": "MPS_ON_EXIT",
    "mps_daemon": "MPS_DAEMON",
    "node_snapshot": "NODE_SNAPSHOT",
    "log_format": "LOG_FORMAT",
    "log_level": "LOG_LEVEL",
    "pod_resources_socket": "POD_RESOURCES_SOCKET",
    "reconcile_grace_seconds": "RECONCILE_GRACE_SECONDS",
    "health_recovery_seconds": "HEALTH_RECOVERY_SECONDS",
    "probe_interval_seconds": "PROBE_INTERVAL_SECONDS",
    "nfd_features_file": "NFD_FEATURES_FILE",
    "metrics_address": "METRICS_ADDRESS",
    "proc_root": "PROC_ROOT",
}
DISABLE_HEALTHCHECKS_ENV = "DP_DISABLE_HEALTHCHECKS"
ENABLE_HEALTHCHECKS_ENV = "DP_ENABLE_HEALTHCHECKS"
MAX_SECONDS = 86400.0


def _pick(name: str, cli: Mapping[str, Any], environ: Mapping[str, str], from_file: str | None) -> str | None:
    if cli.get(name) is not None:
        return str(cli[name])
    env = environ.get(_ENV[name])
    if env:
        return env
    return from_file


def _setting(name: str) -> str:
    """How a message names a setting: by its flag, its environment variable and its config file key."""
    return f"--{name.replace('_', '-')} (env {_ENV[name]}, config flags.{_camel(name)})"


def _choice(
    name: str,
    cli: Mapping[str, Any],
    environ: Mapping[str, str],
    from_file: str | None,
    *,
    choices: Sequence[str],
    default: str,
) -> str:
    chosen = _pick(name, cli, environ, from_file)
    if chosen is None:
        return default
    if chosen.lower() not in choices:
        raise UsageError(f"{_setting(name)} must be one of {', '.join(choices)}; not `{shown(chosen)}`")
    return chosen.lower()


def _seconds(
    name: str,
    cli: Mapping[str, Any],
    environ: Mapping[str, str],
    from_file: float | None,
    bounds: tuple[float, float] = (0.0, MAX_SECONDS),
) -> float | None:
    chosen = _pick(name, cli, environ, None if from_file is None else str(from_file))
    if chosen is None:
        return None
    try:
        value = float(chosen)
    except ValueError:
        value = -1.0
    low, high = bounds
    if not low <= value <= high:
        raise UsageError(
            f"{_setting(name)} must be a number of seconds from {low:g} to {high:g}, not `{shown(chosen)}`"
        )
    return value


def _address(chosen: str | None) -> tuple[str, int] | None:
    """`HOST:PORT` (`[v6]:PORT`, or `:PORT` for every address); unset or empty means off."""
    if not chosen:
        return None
    host, sep, port = str(chosen).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isascii() or not port.isdigit() or not 0 <= int(port) < 65536 or " " in host:
        raise UsageError(
            f"--metrics-address (env METRICS_ADDRESS, config flags.metricsAddress) must be HOST:PORT, for example "
            f"0.0.0.0:9402, or empty to turn the endpoint off; not `{shown(chosen)}`"
        )
    return host or "0.0.0.0", int(port)  # `:PORT` means every address


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _xid_list(variable: str, text: str) -> tuple[frozenset[int], bool]:
    """Xids of a DP_*_HEALTHCHECKS value, and whether it says `all` (or `xids`)."""
    xids: set[int] = set()
    for item in (part.strip().lower() for part in text.split(",")):
        if item in ("all", "xids"):
            return frozenset(), True
        if not item:
            continue
        if not item.isascii() or not item.isdigit():
            raise UsageError(
                f"{variable}: `{shown(item)}` is not an Xid; use a comma-separated list of Xid numbers, `xids` or `all`"
            )
        xids.add(int(item))
    return frozenset(xids), False


def xid_policy(environ: Mapping[str, str]) -> XidPolicy:
    disabled, ignore_all = _xid_list(DISABLE_HEALTHCHECKS_ENV, environ.get(DISABLE_HEALTHCHECKS_ENV, ""))
    enabled, enable_all = _xid_list(ENABLE_HEALTHCHECKS_ENV, environ.get(ENABLE_HEALTHCHECKS_ENV, ""))
    return XidPolicy(ignored=APPLICATION_XIDS | disabled, ignore_all=ignore_all, enabled=enabled, enable_all=enable_all)


def _pick_switchable(
    name: str, cli: Mapping[str, Any], environ: Mapping[str, str], from_file: str | None
) -> str | None:
    """Like `_pick`, for a setting that an explicitly empty value turns off: "" is a choice, None is unset."""
    for chosen in (cli.get(name), environ.get(_ENV[name]), from_file):
        if chosen is not None:
            return str(chosen)
    return None


def _mps_root(chosen: str | None) -> Path:
    """Absolute: Allocate hands paths under it to the kubelet, which resolves them on the host, not here."""
    if chosen and not Path(chosen).is_absolute():
        raise UsageError(
            "--mps-root (env MPS_ROOT, config flags.mpsRoot) must be an absolute path: the kubelet mounts it into "
            f"containers from the host; not `{chosen}`"
        )
    return Path(chosen) if chosen else DEFAULT_MPS_ROOT


def config_file_path(cli: Mapping[str, Any], environ: Mapping[str, str]) -> Path:
    chosen = _pick("config_file", cli, environ, None)
    if not chosen:
        raise UsageError(
            "no configuration given: pass --config-file (or set CONFIG_FILE) with a file that configures "
            "sharing.mps.resources"
        )
    return Path(chosen)


def status_mps_root(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Path:
    """The MPS root `--status` reads: flag, environment, the config file's `flags.mpsRoot` if one is named, default."""
    environ = os.environ if environ is None else environ
    chosen = _pick("mps_root", cli, environ, None)
    if chosen:
        return Path(chosen)
    if _pick("config_file", cli, environ, None):
        flags = load_config(config_file_path(cli, environ)).flags
        if flags is not None and flags.mps_root:
            return Path(flags.mps_root)
    return DEFAULT_MPS_ROOT


def resolve_settings(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    """Read the config file and apply precedence: flag, then environment variable, then file `flags`, then default.

    `cli` holds the parsed command-line flags, None for those not given.
    """
    environ = os.environ if environ is None else environ
    path = config_file_path(cli, environ)
    config = load_config(path)
    sharing = check_config(config)
    flags = config.flags or Flags()
    log_level = _choice("log_level", cli, environ, flags.log_level, choices=LOG_LEVELS, default="info")
    log_format = LogFormat(
        _choice("log_format", cli, environ, flags.log_format, choices=tuple(LogFormat), default=LogFormat.AUTO)
    )
    mps_on_exit = MpsOnExit(
        _choice("mps_on_exit", cli, environ, flags.mps_on_exit, choices=tuple(MpsOnExit), default=MpsOnExit.KEEP)
    )
    mps_daemon = MpsDaemonOwner(
        _choice(
            "mps_daemon", cli, environ, flags.mps_daemon, choices=tuple(MpsDaemonOwner), default=MpsDaemonOwner.AGENT
        )
    )
    if mps_daemon is MpsDaemonOwner.HOST and mps_on_exit is MpsOnExit.QUIT:
        raise UsageError(
            "--mps-on-exit quit needs --mps-daemon agent: with --mps-daemon host the daemon host owns the MPS "
            "daemons and stops them itself"
        )
    snapshot = _pick("node_snapshot", cli, environ, None)
    grace = _seconds(
        "reconcile_grace_seconds",
        cli,
        environ,
        flags.reconcile_grace_seconds,
        bounds=(MIN_RECONCILE_GRACE_S, MAX_SECONDS),
    )
    recovery = _seconds("health_recovery_seconds", cli, environ, flags.health_recovery_seconds)
    probe = _seconds("probe_interval_seconds", cli, environ, flags.probe_interval_seconds, PROBE_INTERVAL_BOUNDS_S)
    nfd_file = _pick_switchable("nfd_features_file", cli, environ, flags.nfd_features_file)
    return Settings(
        config_file=path,
        sharing=sharing,
        kubelet_socket=Path(_pick("kubelet_socket", cli, environ, flags.kubelet_socket) or DEFAULT_KUBELET_SOCKET),
        mps_root=_mps_root(_pick("mps_root", cli, environ, flags.mps_root)),
        mps_control_bin=_pick("mps_control_bin", cli, environ, flags.mps_control_bin) or DEFAULT_MPS_CONTROL_BIN,
        mps_on_exit=mps_on_exit,
        mps_daemon=mps_daemon,
        daemon_host=bool(cli.get("daemon_host")),
        node_snapshot=Path(snapshot) if snapshot else None,
        once=bool(cli.get("once")),
        output=cli.get("output") or "text",
        log_format=log_format,
        log_level=log_level,
        pod_resources_socket=Path(
            _pick("pod_resources_socket", cli, environ, flags.pod_resources_socket) or DEFAULT_POD_RESOURCES_SOCKET
        ),
        reconcile_grace_s=DEFAULT_RECONCILE_GRACE_S if grace is None else grace,
        health_recovery_s=DEFAULT_HEALTH_RECOVERY_S if recovery is None else recovery,
        probe_interval_s=DEFAULT_PROBE_INTERVAL_S if probe is None else probe,
        xid_policy=xid_policy(environ),
        nfd_features_file=DEFAULT_NFD_FEATURES_FILE if nfd_file is None else (Path(nfd_file) if nfd_file else None),
        metrics_address=_address(_pick_switchable("metrics_address", cli, environ, flags.metrics_address)),
        proc_root=Path(_pick("proc_root", cli, environ, flags.proc_root) or DEFAULT_PROC_ROOT),
    )
