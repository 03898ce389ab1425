"""The config file: the NVIDIA device plugin's `v1` schema, with the agent's own keys under `flags`.

`load_config` parses the file and `check_config` checks its shape into a `values.SharingConfig` (the enums and
value types live in `values`, which does no I/O); checks that need the GPUs (device references, replica limits)
live in `plan.build_plan`. The agent's settings (flags, environment, precedence) are `settings.py`'s, which reads
the `flags` keys of its table from `Flags`, which is built from that table; `resolve_settings` reads the file and
applies the table's precedence.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec

from mpsagent.base.errors import ConfigError, DocumentError, FileReadError, UsageError, shown
from mpsagent.base.host import read_input_file
from mpsagent.base.settings import DEFAULT_MPS_ROOT, SETTINGS, Settings, xid_policy
from mpsagent.base.untrusted import load_yaml
from mpsagent.base.values import (
    MAX_CLIENTS_PER_GPU,
    MIB,
    AllocationPolicy,
    DeviceIdStrategy,
    DeviceListStrategy,
    DeviceSelector,
    GrantRule,
    MpsDaemonOwner,
    MpsOnExit,
    MultiUser,
    ResourceSpec,
    SharingConfig,
)

MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; NVIDIA's largest examples are a few KiB
DEFAULT_RESOURCE_DOMAIN = "nvidia.com"


class _Strict(msgspec.Struct, rename="camel", forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base for config sections: camelCase keys, unknown keys refused (a typo must not pass silently)."""


class MpsResource(_Strict, frozen=True):
    name: str
    replicas: int | msgspec.UnsetType = msgspec.UNSET
    # A Kubernetes quantity (`8Gi`, `8e9`; a JSON number too): each device ID is that much memory of one GPU, instead
    # of `replicas`.
    memory_unit: int | float | str | None = None
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


class NvidiaFlags(_Strict, frozen=True):
    """The NVIDIA plugin's own `flags` keys: `Flags` without the agent's settings."""

    mig_strategy: str | None = None
    plugin: PluginFlags | None = None
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


if TYPE_CHECKING:
    Flags = NvidiaFlags
else:
    # The agent's own settings, for operators who keep everything in one file: one optional key for each setting of
    # settings.py's table that has a `key` (`mpsRoot` is the NVIDIA plugin's too), a number for seconds, else text.
    Flags = msgspec.defstruct(
        "Flags",
        [
            (entry.file_attribute, entry.file_type | None, msgspec.field(default=None, name=entry.key))
            for entry in SETTINGS.values()
            if entry.key
        ],
        bases=(NvidiaFlags,),
        module=__name__,
        rename="camel",
        forbid_unknown_fields=True,
        frozen=True,
        kw_only=True,
    )


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


# NVIDIA `flags` keys accepted and reported as ignored; every other agent key under `flags` is a setting's.
IGNORED_FLAG_KEYS = {
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


# A Kubernetes quantity: a signed number (`1`, `1.5`, `1.`, `.5`), then a binary or decimal SI suffix (the small
# ones too: `500m` is half a unit), or a decimal exponent (`1e9`, `25e+8`, `1E-3`: `E` alone is the exa suffix).
# Bounded: 20 digits a part, 3 for an exponent.
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<number>[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})"
    r"(?:(?P<suffix>[KMGTPE]i|[numkMGTPE])|[eE](?P<exponent>[+-]?[0-9]{1,3}))?"
)
_QUANTITY_FACTORS: dict[str | None, Fraction] = {
    None: Fraction(1),
    **{prefix: Fraction(1, 1000 ** (3 - power)) for power, prefix in enumerate("num")},
    **{f"{prefix}i": Fraction(1024 ** (power + 1)) for power, prefix in enumerate("KMGTPE")},
    **{prefix: Fraction(1000 ** (power + 1)) for power, prefix in enumerate("kMGTPE")},
}


def quantity_value(text: str) -> Fraction | None:
    """The exact amount of a Kubernetes quantity (`500m` is 1/2, `-8Gi` is negative); None when it is not one."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        return None
    whole, _, fraction = match.group("number").partition(".")
    value = Fraction(int(whole or "0") * 10 ** len(fraction) + int(fraction or "0"), 10 ** len(fraction))
    exponent = match.group("exponent")
    value *= Fraction(10) ** int(exponent) if exponent else _QUANTITY_FACTORS[match.group("suffix")]
    return -value if match.group("sign") == "-" else value


def parse_quantity(text: str) -> int | None:
    """Bytes of a Kubernetes quantity (`512Mi`, `8G`, `1.5Gi`, `1e9`), rounded down; None when it is not one."""
    value = quantity_value(text)
    return None if value is None else math.floor(value)


def _quantity_text(value: int | float | str) -> str:
    """A memory unit as a quantity's text: a JSON number (1.5e9) as Kubernetes reads it, by its digits."""
    return repr(value) if isinstance(value, float) else str(value)


def _memory_unit(path: str, entry: MpsResource) -> int | None:
    """The resource's memory unit in bytes (None: a replica resource); the GPU-dependent bound is the plan's."""
    if entry.memory_unit is None:
        return None
    if not isinstance(entry.replicas, msgspec.UnsetType):
        raise ConfigError(path, "give either `replicas` or `memoryUnit`, not both")
    value = entry.memory_unit
    unit: int | None = value if isinstance(value, int) else parse_quantity(_quantity_text(value))
    if unit is None:
        raise ConfigError(path, f"`{shown(value)}` is not a Kubernetes quantity; write it like 1Gi, 512Mi or 8G")
    if unit < MIB:
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
    if replicas is not None and not 1 <= replicas <= MAX_CLIENTS_PER_GPU:
        raise ConfigError(
            f"{path}.replicas",
            f"must be between 1 and {MAX_CLIENTS_PER_GPU} (MPS client limit), not {shown(entry.replicas)}",
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
    ignored = [key for attr, key in IGNORED_FLAG_KEYS.items() if getattr(flags, attr) is not None]
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


# --- the settings, with the file ------------------------------------------------------------------------


def config_file_path(cli: Mapping[str, Any], environ: Mapping[str, str]) -> Path:
    chosen = SETTINGS["config_file"].resolve(cli, environ, None)
    if chosen is None:
        raise UsageError(
            "no configuration given: pass --config-file (or set CONFIG_FILE) with a file that configures "
            "sharing.mps.resources"
        )
    return Path(chosen)


def status_mps_root(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Path:
    """The MPS root `--status` reads: flag, environment, the config file's `flags.mpsRoot` if one is named, default."""
    environ = os.environ if environ is None else environ
    chosen = SETTINGS["mps_root"].given(cli, environ, None)
    if chosen:
        return Path(chosen)
    if SETTINGS["config_file"].given(cli, environ, None):
        flags = load_config(config_file_path(cli, environ)).flags
        from_file = SETTINGS["mps_root"].given({}, {}, flags)
        if from_file:
            return Path(from_file)
    return DEFAULT_MPS_ROOT


def resolve_settings(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    """Read the config file and apply precedence: flag, then environment variable, then file `flags`, then default.

    `cli` holds the parsed command-line flags, None for those not given.
    """
    environ = os.environ if environ is None else environ
    path = config_file_path(cli, environ)
    config = load_config(path)
    sharing = check_config(config)
    values: dict[str, Any] = {name: entry.resolve(cli, environ, config.flags) for name, entry in SETTINGS.items()}
    if values["mps_daemon"] is MpsDaemonOwner.HOST and values["mps_on_exit"] is MpsOnExit.QUIT:
        raise UsageError(
            "--mps-on-exit quit needs --mps-daemon agent: with --mps-daemon host the daemon host owns the MPS "
            "daemons and stops them itself"
        )
    return Settings(
        **{**values, "config_file": path},
        sharing=sharing,
        once=bool(cli.get("once")),
        output=cli.get("output") or "text",
        daemon_host=bool(cli.get("daemon_host")),
        xid_policy=xid_policy(environ),
    )
