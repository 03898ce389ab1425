"""The agent's settings: one table, from which come the command-line flags, their precedence and their docs.

Each setting is declared once, as a field of `Settings` made by `setting(...)`: its flag, environment variable,
config-file `flags` key, parser, default, help and NVIDIA equivalent. `cli.build_parser` makes the flags from the
table, `Setting.resolve` applies the precedence flag > environment variable > config `flags` > default,
`config.Flags` (the file's schema) takes its keys from it, and tests/packaging/test_docs.py checks the README's and
docs/configuration.md's tables against it. Reading the config file and the environment is `config.py`'s
(`config.resolve_settings`): this module reads nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast

from mpsagent.base.errors import UsageError, shown
from mpsagent.base.values import (
    APPLICATION_XIDS,
    DEFAULT_CONTROL_HOLD_S,
    DEFAULT_PROBE_INTERVAL_S,
    DraMode,
    LogFormat,
    LogLevel,
    MpsDaemonOwner,
    MpsOnExit,
    SharingConfig,
    TaintEffect,
    XidPolicy,
)

DEFAULT_KUBELET_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
DEFAULT_MPS_ROOT = Path("/run/nvidia/mps")
DEFAULT_MPS_CONTROL_BIN = "nvidia-cuda-mps-control"
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_RECONCILE_GRACE_S = 60.0
# The kubelet lists a container a moment after its Allocate; below this, a grant could be released before then.
MIN_RECONCILE_GRACE_S = 10.0
DEFAULT_NFD_FEATURES_FILE = Path("/etc/kubernetes/node-feature-discovery/features.d/mpsagent")
DEFAULT_PROC_ROOT = Path("/proc")
DEFAULT_CONTAINER_LOGS_DIR = Path("/var/log/containers")
DEFAULT_HEALTH_RECOVERY_S = 60.0
DEFAULT_CDI_SPEC_DIR = Path("/var/run/cdi")
DEFAULT_CDI_HOOK = Path("mpsagent-cdi-hook")
# Longer than this, a tenant keeps every cap switch out and lifted caps in force for minutes at a time.
MAX_CONTROL_HOLD_S = 300.0
MAX_NODE_NAME_CHARS = 253
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Below 1 s the rounds cost more than they protect; above 60 s a lifted cap would last too long.
PROBE_INTERVAL_BOUNDS_S = (1.0, 60.0)
MAX_SECONDS = 86400.0
DISABLE_HEALTHCHECKS_ENV = "DP_DISABLE_HEALTHCHECKS"
ENABLE_HEALTHCHECKS_ENV = "DP_ENABLE_HEALTHCHECKS"


# --- one setting ------------------------------------------------------------------------------------------

T = TypeVar("T")
_SETTING = "setting"  # the metadata key of a `Settings` field's table entry


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting(Generic[T]):
    """How one setting is given, read, defaulted and documented."""

    flag: str
    env: str
    key: str | None
    """The config file's `flags` key; None where the file cannot set it."""
    parse: Callable[[str], T | None]
    """The value of a given text: None means the default; ValueError("must be ..., not") refuses it."""
    default: T | None
    help: str
    metavar: str | None
    choices: tuple[str, ...]
    """Any case is accepted; the parser gets it in lower case."""
    empty_turns_off: bool
    """An explicitly empty value (flag, variable or key) means off (None), over any later source."""
    absent: str | None
    """How the docs write a default that is no value: `(required)`, `(off)`."""
    nvidia: str
    """The NVIDIA device plugin's equivalent, for docs/configuration.md."""
    required: bool

    @property
    def file_attribute(self) -> str | None:
        """The attribute of the file's `config.Flags` that holds its key (`kubeletSocket`: `kubelet_socket`)."""
        return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", self.key).lower() if self.key else None

    def choice(self, text: str) -> str:
        """The choice `text` names in any case (`noexecute`: `NoExecute`), or `text` itself when it names none."""
        return next((choice for choice in self.choices if choice.lower() == text.lower()), text)

    @property
    def on_off(self) -> bool:
        """A switch (`on`/`off`): the file may write it as YAML's boolean too (a bare `on` is YAML's true)."""
        return set(self.choices) == {"on", "off"}

    @property
    def file_type(self) -> Any:
        """What the file's key holds: a number for the seconds, a switch as text or boolean, text otherwise."""
        if isinstance(self.default, float):
            return float
        return str | bool if self.on_off else str

    @property
    def dest(self) -> str:
        """The name argparse gives the flag's value."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def label(self) -> str:
        """How a message names the setting: by its flag, its environment variable and its config file key."""
        key = f", config flags.{self.key}" if self.key else ""
        return f"{self.flag} (env {self.env}{key})"

    @property
    def documented_default(self) -> str:
        """The default as the docs' tables and `--help` write it."""
        return self.absent or f"`{value_text(self.default)}`"

    def help_text(self) -> str:
        where = [f"env {self.env}"] + ([f"config flags.{self.key}"] if self.key else [])
        off = "; empty: off" if self.empty_turns_off else ""
        default = "required" if self.required else f"default {self.documented_default.strip('()`')}"
        return f"{self.help}{off} [{'; '.join([*where, default])}]"

    def given(self, cli: Mapping[str, Any], environ: Mapping[str, str], flags: object | None) -> str | None:
        """The text from the first source that gives one; an empty variable counts only if empty turns it off.
        `flags` is the config file's `config.Flags`, None when there is none."""
        attribute = self.file_attribute
        from_file = getattr(flags, attribute) if flags is not None and attribute else None
        env = environ.get(self.env)
        for chosen in (cli.get(self.dest), env if env or self.empty_turns_off else None, from_file):
            if isinstance(chosen, bool):
                return "on" if chosen else "off"
            if chosen is not None:
                return str(chosen)
        return None

    def resolve(self, cli: Mapping[str, Any], environ: Mapping[str, str], flags: object | None) -> T | None:
        text = self.given(cli, environ, flags)
        if text is None:
            return self.default
        if self.empty_turns_off and not text:
            return None
        if self.choices and self.choice(text) not in self.choices:
            raise UsageError(f"{self.label} must be one of {', '.join(self.choices)}; not `{shown(text)}`")
        try:
            value = self.parse(self.choice(text) if self.choices else text)
        except ValueError as exc:
            raise UsageError(f"{self.label} {exc} `{shown(text)}`") from None
        return self.default if value is None else value


def setting(
    *,
    flag: str,
    env: str,
    key: str | None = None,
    parse: Callable[[str], T | None],
    default: T | None = None,
    help: str,
    metavar: str | None = None,
    choices: tuple[str, ...] = (),
    empty_turns_off: bool = False,
    absent: str | None = None,
    nvidia: str = "",
    required: bool = False,
) -> T:
    """A `Settings` field that is a setting: its default, with the table entry in the field's metadata."""
    entry = Setting(
        flag=flag,
        env=env,
        key=key,
        parse=parse,
        default=default,
        help=help,
        metavar=metavar,
        choices=choices,
        empty_turns_off=empty_turns_off,
        absent=absent,
        nvidia=nvidia,
        required=required,
    )
    if required:
        return cast("T", field(metadata={_SETTING: entry}))
    return cast("T", field(default=default, metadata={_SETTING: entry}))


def value_text(value: object) -> str:
    """A value as the docs write it: `60` for 60.0 seconds, `keep` for MpsOnExit.KEEP."""
    return f"{value:g}" if isinstance(value, float) else str(value)


# --- parsers ----------------------------------------------------------------------------------------------


def _path(text: str) -> Path | None:
    return Path(text) if text else None


def _text(text: str) -> str | None:
    return text or None


def _seconds(low: float, high: float = MAX_SECONDS) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not low <= value <= high:
            raise ValueError(f"must be a number of seconds from {low:g} to {high:g}, not")
        return value

    return parse


def _address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6]:PORT`, or `:PORT` for every address)."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isascii() or not port.isdigit() or not 0 <= int(port) < 65536 or " " in host:
        raise ValueError("must be HOST:PORT, for example 0.0.0.0:9402, or empty to turn the endpoint off; not")
    return host or "0.0.0.0", int(port)  # `:PORT` means every address


def _node_name(text: str) -> str | None:
    """A node's name is a DNS subdomain (RFC 1123): the ResourceSlice's pool and `spec.nodeName`."""
    if text and (len(text) > MAX_NODE_NAME_CHARS or not _NODE_NAME.fullmatch(text)):
        raise ValueError("must be the node's name as the API server has it (lower case, digits, '-' and '.'); not")
    return text or None


def _mps_root(text: str) -> Path | None:
    """Absolute: Allocate hands paths under it to the kubelet, which resolves them on the host, not here."""
    if text and not Path(text).is_absolute():
        raise ValueError("must be an absolute path: the kubelet mounts it into containers from the host; not")
    return _path(text)


# --- the table --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """Everything the agent runs with, after precedence is applied. A field made by `setting(...)` is a setting:
    a new one is one such field plus its use (and its `flags` key in `config.Flags`, if the file may set it)."""

    config_file: Path = setting(
        flag="--config-file",
        env="CONFIG_FILE",
        parse=_path,
        metavar="FILE",
        help="NVIDIA device plugin v1 config, YAML or JSON",
        absent="(required)",
        nvidia="same",
        required=True,
    )
    kubelet_socket: Path = setting(
        flag="--kubelet-socket",
        env="KUBELET_SOCKET",
        key="kubeletSocket",
        parse=_path,
        default=DEFAULT_KUBELET_SOCKET,
        metavar="PATH",
        help="kubelet registration socket; plugin sockets go in the same directory",
        nvidia="fixed path",
    )
    mps_root: Path = setting(
        flag="--mps-root",
        env="MPS_ROOT",
        key="mpsRoot",
        parse=_mps_root,
        default=DEFAULT_MPS_ROOT,
        metavar="DIR",
        help="MPS pipe, log and shm directories",
        nvidia="`flags.mpsRoot`",
    )
    mps_control_bin: str = setting(
        flag="--mps-control-bin",
        env="MPS_CONTROL_BIN",
        key="mpsControlBin",
        parse=_text,
        default=DEFAULT_MPS_CONTROL_BIN,
        metavar="PATH",
        help="nvidia-cuda-mps-control to run (a bare name is looked up in PATH)",
        nvidia="the `mps-control-daemon` image",
    )
    mps_on_exit: MpsOnExit = setting(
        flag="--mps-on-exit",
        env="MPS_ON_EXIT",
        key="mpsOnExit",
        parse=MpsOnExit,
        default=MpsOnExit.KEEP,
        choices=tuple(MpsOnExit),
        help="leave the MPS daemons running on exit (keep) or quit them",
        nvidia="(separate daemon)",
    )
    mps_daemon: MpsDaemonOwner = setting(
        flag="--mps-daemon",
        env="MPS_DAEMON",
        key="mpsDaemon",
        parse=MpsDaemonOwner,
        default=MpsDaemonOwner.AGENT,
        choices=tuple(MpsDaemonOwner),
        help="who starts the MPS control daemons: the agent (agent; systemd) or `mpsagent --daemon-host` "
        "in a container of its own, whose daemons outlive the agent's container (host; Kubernetes)",
        nvidia="the `mps-control-daemon` DaemonSet",
    )
    node_snapshot: Path | None = setting(
        flag="--node-snapshot",
        env="NODE_SNAPSHOT",
        parse=_path,
        metavar="FILE",
        help="take the GPUs from a YAML/JSON snapshot or `nvidia-smi -q -x` output instead of NVML",
        absent="(NVML)",
    )
    pod_resources_socket: Path = setting(
        flag="--pod-resources-socket",
        env="POD_RESOURCES_SOCKET",
        key="podResourcesSocket",
        parse=_path,
        default=DEFAULT_POD_RESOURCES_SOCKET,
        metavar="PATH",
        help="kubelet pod-resources socket, to reconcile grants",
        nvidia="(not used)",
    )
    reconcile_grace_s: float = setting(
        flag="--reconcile-grace-seconds",
        env="RECONCILE_GRACE_SECONDS",
        key="reconcileGraceSeconds",
        parse=_seconds(MIN_RECONCILE_GRACE_S),
        default=DEFAULT_RECONCILE_GRACE_S,
        metavar="S",
        help=f"free a grant only after its container has been unlisted this long, {MIN_RECONCILE_GRACE_S:g} to "
        f"{MAX_SECONDS:g}",
    )
    health_recovery_s: float = setting(
        flag="--health-recovery-seconds",
        env="HEALTH_RECOVERY_SECONDS",
        key="healthRecoverySeconds",
        parse=_seconds(0.0),
        default=DEFAULT_HEALTH_RECOVERY_S,
        metavar="S",
        help="a failed GPU is healthy again after answering NVML without a critical Xid this long",
        nvidia="never recovers",
    )
    probe_interval_s: float = setting(
        flag="--probe-interval-seconds",
        env="PROBE_INTERVAL_SECONDS",
        key="probeIntervalSeconds",
        parse=_seconds(*PROBE_INTERVAL_BOUNDS_S),
        default=DEFAULT_PROBE_INTERVAL_S,
        metavar="S",
        help="read the MPS daemon's caps back (and restore any that changed) this often, "
        f"{PROBE_INTERVAL_BOUNDS_S[0]:g} to {PROBE_INTERVAL_BOUNDS_S[1]:g}",
    )
    control_hold_s: float = setting(
        flag="--control-hold-seconds",
        env="CONTROL_HOLD_SECONDS",
        key="controlHoldSeconds",
        parse=_seconds(0.0, MAX_CONTROL_HOLD_S),
        default=DEFAULT_CONTROL_HOLD_S,
        metavar="S",
        help="end the MPS control-socket connection of a process in a pod that holds it this long (a session open, "
        f"or a connection that sends nothing: every other session waits), 0 to {MAX_CONTROL_HOLD_S:g}; 0: never. "
        "A process on the host is never ended",
        nvidia="none: a held socket blocks the daemon until it is let go",
    )
    nfd_features_file: Path | None = setting(
        flag="--nfd-features-file",
        env="NFD_FEATURES_FILE",
        key="nfdFeaturesFile",
        parse=_path,
        default=DEFAULT_NFD_FEATURES_FILE,
        metavar="PATH",
        help="write the node labels there for node-feature-discovery",
        empty_turns_off=True,
        nvidia="GPU feature discovery's `features.d/gfd`",
    )
    metrics_address: tuple[str, int] | None = setting(
        flag="--metrics-address",
        env="METRICS_ADDRESS",
        key="metricsAddress",
        parse=_address,
        metavar="HOST:PORT",
        help="serve /metrics, /healthz and /readyz over HTTP there",
        empty_turns_off=True,
        absent="(off)",
    )
    proc_root: Path = setting(
        flag="--proc-root",
        env="PROC_ROOT",
        key="procRoot",
        parse=_path,
        default=DEFAULT_PROC_ROOT,
        metavar="DIR",
        help="the host's /proc, to map GPU processes to containers",
    )
    container_logs_dir: Path = setting(
        flag="--container-logs-dir",
        env="CONTAINER_LOGS_DIR",
        key="containerLogsDir",
        parse=_path,
        default=DEFAULT_CONTAINER_LOGS_DIR,
        metavar="DIR",
        help="the host's /var/log/containers, where the kubelet links each container's log under its pod's name: "
        "to name the pod of a process on a GPU that holds no grant or claim there",
    )
    dra: DraMode = setting(
        flag="--dra",
        env="DRA",
        key="dra",
        parse=DraMode,
        default=DraMode.OFF,
        choices=tuple(DraMode),
        help="also serve the GPUs as the Dynamic Resource Allocation driver mps.mpsagent.io: a ResourceSlice whose "
        "devices claims take memory and compute of, prepared beside the device plugin's grants",
        nvidia="the NVIDIA DRA driver (a component of its own)",
    )
    kubeconfig: Path | None = setting(
        flag="--kubeconfig",
        env="KUBECONFIG",
        key="kubeconfig",
        parse=_path,
        metavar="FILE",
        help="the API server's address and credentials, for --dra on",
        absent="(the pod's service account)",
    )
    node_name: str | None = setting(
        flag="--node-name",
        env="NODE_NAME",
        key="nodeName",
        parse=_node_name,
        metavar="NAME",
        help="this node's name in the API server, for --dra on",
        absent="(the host name)",
    )
    cdi_spec_dir: Path = setting(
        flag="--cdi-spec-dir",
        env="CDI_SPEC_DIR",
        key="cdiSpecDir",
        parse=_path,
        default=DEFAULT_CDI_SPEC_DIR,
        metavar="DIR",
        help="where the CDI specs are written for the container runtime: prepared claims' (--dra on), and the "
        "memory-limit devices where the driver limits memory per cgroup",
    )
    cdi_hook: Path | None = setting(
        flag="--cdi-hook",
        env="CDI_HOOK",
        key="cdiHook",
        parse=_path,
        default=DEFAULT_CDI_HOOK,
        metavar="PATH",
        help="the agent's CDI hook (mpsagent-cdi-hook) as the container runtime runs it on the host, which sets a "
        "capped container's memory limits where the driver has them; a bare name is looked for beside the agent's "
        "Python; empty: the driver's limits are not used",
        empty_turns_off=True,
    )
    dra_taint_effect: TaintEffect = setting(
        flag="--dra-taint-effect",
        env="DRA_TAINT_EFFECT",
        key="draTaintEffect",
        parse=TaintEffect,
        default=TaintEffect.NO_SCHEDULE,
        choices=tuple(TaintEffect),
        help="the effect of the taint on a failed GPU's device, for --dra on: NoSchedule keeps new claims off it, "
        "NoExecute also evicts the pods of the claims on it",
        nvidia="(the device plugin withdraws a failed GPU's replicas)",
    )
    log_format: LogFormat = setting(
        flag="--log-format",
        env="LOG_FORMAT",
        key="logFormat",
        parse=LogFormat,
        default=LogFormat.AUTO,
        choices=tuple(LogFormat),
        help="console on a terminal, JSON lines otherwise (auto), or either",
    )
    log_level: LogLevel = setting(
        flag="--log-level",
        env="LOG_LEVEL",
        key="logLevel",
        parse=LogLevel,
        default=LogLevel.INFO,
        choices=tuple(LogLevel),
        help="the least severe events logged",
    )
    library_log_level: LogLevel = setting(
        flag="--library-log-level",
        env="LIBRARY_LOG_LEVEL",
        key="libraryLogLevel",
        parse=LogLevel,
        default=LogLevel.WARNING,
        choices=tuple(LogLevel),
        help="the least severe events logged by the libraries the agent uses (HTTP/2, gRPC, the API client)",
    )
    # Not settings: what the config file says, the run mode (plain flags in cli.py), and the Xid variables.
    sharing: SharingConfig
    once: bool = False
    output: Literal["text", "json"] = "text"
    daemon_host: bool = False
    xid_policy: XidPolicy = XidPolicy()


SETTINGS: Mapping[str, Setting[Any]] = {
    each.name: each.metadata[_SETTING] for each in fields(Settings) if _SETTING in each.metadata
}
"""The table: each setting by its `Settings` attribute, in `--help`'s order."""


# --- precedence -------------------------------------------------------------------------------------------


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
