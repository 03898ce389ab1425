"""The values the configuration speaks of, with no I/O: units, MPS's client limit, the enums a setting or a
`sharing`/`flags` key chooses from, and the checked config (`SharingConfig`) the plan is built from.

`config` (which reads the file) and `settings` (the table of settings) produce these; the domain, `mps.commands`,
`logs` and the daemon supervisor use them without importing any reader.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

MIB = 1 << 20
"""A mebibyte in bytes."""

MAX_CLIENTS_PER_GPU = 48
"""MPS serves at most this many clients a GPU (Volta and later); the 49th fails with
CUDA_ERROR_MPS_MAX_CLIENTS_REACHED. So at most this many replicas a GPU."""
MAX_CLIENTS_PER_GPU_BEFORE_VOLTA = 16

DEFAULT_PROBE_INTERVAL_S = 3.0
"""`--probe-interval-seconds`' default: how often the daemon's liveness and caps are checked."""
DEFAULT_CONTROL_HOLD_S = 2.0
"""How long a process in a pod may hold the MPS control socket before the agent ends its connection."""


# --- `sharing.mps` and `flags.plugin` -----------------------------------------------------------------------


class DeviceListStrategy(enum.StrEnum):
    ENVVAR = "envvar"
    CDI_CRI = "cdi-cri"


class DeviceIdStrategy(enum.StrEnum):
    UUID = "uuid"
    INDEX = "index"


class AllocationPolicy(enum.StrEnum):
    DISTRIBUTED = "distributed"
    PACKED = "packed"


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


DeviceSelector = Literal["all"] | int | list[int | str]


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


# --- the agent's own settings --------------------------------------------------------------------------------


class LogFormat(enum.StrEnum):
    AUTO = "auto"
    JSON = "json"
    CONSOLE = "console"


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class DraMode(enum.StrEnum):
    """Whether the agent also serves its GPUs as a Dynamic Resource Allocation driver, beside the device plugin."""

    OFF = "off"
    ON = "on"


class Enforcement(enum.StrEnum):
    """Who holds a capped container to its memory on a GPU."""

    DRIVER = "driver"
    """The driver, per container cgroup (NVML memory limits, r615+, cgroup v2, no MIG), set by the agent's CDI hook
    before the container's first process runs; MPS's ceilings stay as the second layer."""
    MPS = "mps"
    """MPS alone: the client's CUDA_MPS_* environment, and the daemon's ceilings."""


class TaintEffect(enum.StrEnum):
    """What a device taint does to claims that do not tolerate it (KEP-5055)."""

    NO_SCHEDULE = "NoSchedule"
    """No new claim is allocated the device; the pods of claims already on it keep running."""
    NO_EXECUTE = "NoExecute"
    """And the pods of claims already on it are evicted (their claims deallocated)."""


class MpsOnExit(enum.StrEnum):
    KEEP = "keep"
    QUIT = "quit"


class MpsDaemonOwner(enum.StrEnum):
    """Who starts the MPS control daemons: the agent itself (a host process under systemd, where they outlive it),
    or `mpsagent --daemon-host` in a container of its own (Kubernetes: the daemons outlive the agent's container)."""

    AGENT = "agent"
    HOST = "host"


# Application errors: the GPU stays healthy (the NVIDIA device plugin's list).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


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
