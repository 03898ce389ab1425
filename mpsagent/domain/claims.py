"""Dynamic Resource Allocation: what the node publishes (one device per GPU with consumable `memory` and `compute`),
what a claim's allocation asks of each GPU, and what a prepared claim holds.

Pure and synchronous, like the rest of the domain: the DRA adapter (`mpsagent.dra`) turns API objects and kubelet
messages into these Structs and back, the supervisor's claim server (`supervisor.claim_server`) decides with them,
and `--once` shows them. A claim's share of a GPU is a `shares.Share` like a device-plugin grant's, entered in the
same ledger, so that both routes share one daemon, its ceilings and its client limit.
"""

from __future__ import annotations

import re

import msgspec

from mpsagent.base.values import TaintEffect
from mpsagent.domain.grant_kind import GrantKind

DRA_DRIVER = "mps.mpsagent.io"
"""The DRA driver's name: its DeviceClass selects devices of this driver, and the kubelet registers it so."""
CDI_VENDOR_CLASS = "mpsagent.io/mps-share"
"""The CDI kind of a prepared claim's devices: `mpsagent.io/mps-share=<claim UID>-<device>`."""
DEVICE_NAME_PREFIX = "gpu-"
MEMORY = "memory"
COMPUTE = "compute"
CLIENTS = "clients"
"""A device's MPS clients: each claim allocated on it consumes one, so that the scheduler places no more claims on
a GPU than its MPS server takes (48; 16 before Volta) beside the device-plugin grants."""
MEMORY_STEP_BYTES = 1 << 20
"""A claim's memory is counted in MiB (MPS's pinned-memory limits are MiB): the request policy's step and least."""
FULL_COMPUTE = 100
MAX_CLAIM_UID_CHARS = 64
CLAIM_UID_FORM = "0-9, a-f and '-', from a digit or letter"
CLAIM_UID = re.compile(r"[0-9a-f][0-9a-f-]*")
"""A claim's UID as the API server makes them (a UUID): it names the claim's CDI spec file and devices, so never a
`/`, `.` or `..` (the kubelet's request and the checkpoint are both checked against it)."""


def cdi_device_id(name: str) -> str:
    """The fully-qualified CDI device name the kubelet hands the runtime for one of a claim's devices."""
    return f"{CDI_VENDOR_CLASS}={name}"


class ClaimRef(msgspec.Struct, frozen=True, kw_only=True):
    """A ResourceClaim as the kubelet names it in NodePrepareResources."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class ClaimDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device result of a claim's allocation that is this driver's and this node's."""

    request: str
    """The request's name (`gpu`, or `gpu/sub` for a subrequest)."""
    pool: str
    device: str
    share_id: str | None = None
    memory_bytes: int | None = None
    """The consumed `memory` capacity; None when the allocation names none (no consumable capacity)."""
    compute: int | None = None
    """The consumed `compute` capacity (per cent of the SMs); None when the allocation names none."""


class OpaqueConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One opaque configuration of this driver in the claim (its class's first, then the claim's own)."""

    requests: tuple[str, ...]
    """The requests it applies to; empty: every request."""
    parameters: bytes
    """The raw JSON of `opaque.parameters`, checked by `share_parameters`."""
    source: str
    """Where it came from, for messages: `claim` or `class`."""


class ClaimAllocation(msgspec.Struct, frozen=True, kw_only=True):
    """What the API server says a claim was allocated, of this driver on this node."""

    claim: ClaimRef
    devices: tuple[ClaimDevice, ...]
    configs: tuple[OpaqueConfig, ...] = ()
    pods: tuple[str, ...] = ()
    """The pods it is reserved for (`namespace/name`), for `--status`."""


# --- what the node publishes -------------------------------------------------------------------------------


class CapacityPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """A consumable capacity with its request policy (a valid range with a step); no policy when less than one step
    is left (the API server refuses a step larger than the value): then any request beyond it does not fit."""

    value: int
    default: int
    minimum: int
    maximum: int
    step: int

    @property
    def has_policy(self) -> bool:
        return self.value >= self.step


TAINT_UNHEALTHY = f"{DRA_DRIVER}/unhealthy"
"""The taint of a device whose GPU failed (a critical Xid, NVML lost it) or whose MPS daemon is down or hung."""
TAINT_FULL = f"{DRA_DRIVER}/no-memory-left"
"""The taint of a device whose memory the device-plugin grants hold whole: no claim fits beside them."""
TAINT_NO_CLIENTS = f"{DRA_DRIVER}/no-clients-left"
"""The taint of a device whose MPS clients the device-plugin grants are all of: no claim's client would be served.
(A capacity with nothing left has no request policy, and a request that does not name it then consumes its value,
0: the taint, not the capacity, keeps the scheduler off.)"""


class DeviceTaint(msgspec.Struct, frozen=True, kw_only=True):
    """A device taint (KEP-5055): the scheduler allocates the device to no claim that does not tolerate it
    (NoSchedule), and evicts the pods of claims that do not (NoExecute)."""

    key: str
    value: str
    effect: TaintEffect
    added: float
    """Wall-clock time it was added (the taint's `timeAdded`, second precision)."""


class SliceDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU as the ResourceSlice shows it."""

    name: str
    uuid: str
    index: int
    product_name: str
    compute_capability: str
    """A semantic version (`9.0.0`)."""
    driver_version: str
    """A semantic version (`580.65.6`), or `0.0.0` when unknown."""
    resource: str
    """The device-plugin resource whose MPS daemon serves the GPU."""
    memory: CapacityPolicy
    compute: CapacityPolicy
    clients: CapacityPolicy
    taints: tuple[DeviceTaint, ...] = ()


class NodeSlice(msgspec.Struct, frozen=True, kw_only=True):
    """The node's one ResourceSlice: a pool named after the node, one device per shared GPU."""

    driver: str
    node: str
    pool: str
    devices: tuple[SliceDevice, ...]


class TaintSelector(msgspec.Struct, frozen=True, kw_only=True):
    """Which devices a DeviceTaintRule taints: every field given must match the device's driver, pool and name; none
    given, every device."""

    driver: str | None = None
    pool: str | None = None
    device: str | None = None


class TaintRule(msgspec.Struct, frozen=True, kw_only=True):
    """An administrator's DeviceTaintRule (KEP-5055; `resource.k8s.io/v1` from Kubernetes 1.37): one taint on every
    device its selector matches. The scheduler (and the eviction controller, for NoExecute) adds it to those devices
    as if their slice carried it, without changing the slice: the agent neither writes nor removes it, it shows it."""

    name: str
    selector: TaintSelector | None
    """None: the rule has no selector, and taints no device."""
    key: str
    value: str
    effect: str
    """As the rule says it: `NoSchedule`, `NoExecute`, `None`, or one a later release adds (the scheduler takes an
    effect it does not know for `None`)."""
    added: float | None = None
    """Wall-clock time the taint was added or its effect changed (`timeAdded`)."""


def tainted_devices(rule: TaintRule, node_slice: NodeSlice) -> tuple[str, ...]:
    """The devices of the node's slice that `rule` taints, matched as the scheduler matches them (k8s.io/dynamic-
    resource-allocation's resourceslice tracker)."""
    selector = rule.selector
    if (
        selector is None
        or selector.driver not in (None, node_slice.driver)
        or selector.pool not in (None, node_slice.pool)
    ):
        return ()
    return tuple(device.name for device in node_slice.devices if selector.device in (None, device.name))


# --- what a prepared claim holds ---------------------------------------------------------------------------


class PreparedDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device of a prepared claim: what the kubelet is told, and the share the ledger holds for it."""

    request: str
    pool: str
    device: str
    share_id: str | None
    cdi_device_ids: tuple[str, ...]
    resource: str
    gpu: str
    memory_mib: int
    """Its memory cap; the GPU's whole memory for a whole-GPU share."""
    thread_percentage: int
    kind: GrantKind
    """Its kind, as the checkpoint and the status file store it."""
    rounded_off_bytes: int = 0
    """The allocated memory below a whole MiB, which its cap leaves out (MPS limits are whole MiB)."""
    compute: int = 0
    """The compute (per cent of the SMs) it consumed, which the GPU's accounting holds for it; 0: none asked (its
    threads follow its memory). A checkpoint of an older agent has none."""


class PreparedClaim(msgspec.Struct, frozen=True, kw_only=True):
    """A claim the agent prepared: checkpointed, so that an agent restart keeps it."""

    claim: ClaimRef
    devices: tuple[PreparedDevice, ...]
    pods: tuple[str, ...] = ()
    prepared_at: float = 0.0
    """Wall-clock time, for people."""
