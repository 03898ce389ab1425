"""The status document's types: what status.json holds, `--status` prints, and `/metrics` and `/readyz` read,
with the metric families each field gives (`STATUS_METRICS`) beside the fields.

Built by `status` from the agent's live state, published by `publisher`; camelCase on the wire. A field that an
older agent did not write has a default, so that `--status` reads that agent's file; a field without one is one
every agent wrote. The daemon's part is the daemon supervisor's own snapshot (`mps.daemon_status`), embedded as it
is. Where a new field goes: see docs/architecture.md ("Documents, and where a new field goes").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, cast

import msgspec

from mpsagent.base.bounded import Count, Pid
from mpsagent.base.metric_rows import Labels, MetricRow, Sample, Samples, counter, each, gauge, one, within
from mpsagent.base.values import MIB, Enforcement
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.stowaways import StowawayStatus
from mpsagent.gpu.limits_watch import ContainerLimit
from mpsagent.mps.daemon_status import DAEMON_METRICS, DaemonStatus


class GpuBound(NamedTuple):
    """A GPU's ceilings and escape bound, as the status document holds them (see docs/cap-model.md)."""

    ordinal: int
    live_grants: int
    memory_ceiling_mib: int
    memory_mib: int
    thread_ceiling: int
    memory_escape_mib: int
    thread_escape: int


class GpuStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """One GPU of a resource; the ceilings and escape bound are absent in an older agent's file."""

    replicas: Count
    healthy: Count
    ordinal: Count | None = None
    live_grants: Count | None = None
    memory_ceiling_mib: Count | None = msgspec.field(default=None, name="memoryCeilingMiB")
    memory_mib: Count | None = msgspec.field(default=None, name="memoryMiB")
    thread_ceiling: Count | None = None
    memory_escape_mib: Count | None = msgspec.field(default=None, name="memoryEscapeMiB")
    thread_escape: Count | None = None
    grant_memory_mib: Count | None = msgspec.field(default=None, name="grantMemoryMiB")
    """What the device-plugin grants hold of the GPU's memory (k/N of it per replica)."""
    grant_compute: Count | None = None
    claim_memory_mib: Count | None = msgspec.field(default=None, name="claimMemoryMiB")
    """What the DRA claims hold of it (the memory they consumed)."""
    claim_compute: Count | None = None
    withheld: Count = 0
    """Free replicas ListAndWatch does not offer: their share no longer fits beside the claims."""
    withheld_reason: str | None = None
    enforcement: str | None = None
    """Who holds a capped container to its memory on the GPU: `driver` (its cgroup's limit, then MPS) or `mps`."""
    enforcement_reason: str | None = None
    """Why the driver does not limit memory on it (`mps`)."""

    def bound(self) -> GpuBound | None:
        """The ceilings and escape bound, when the file holds them all."""
        values = (
            self.ordinal,
            self.live_grants,
            self.memory_ceiling_mib,
            self.memory_mib,
            self.thread_ceiling,
            self.memory_escape_mib,
            self.thread_escape,
        )
        return None if None in values else GpuBound(*cast("tuple[int, ...]", values))


def _bounded(value: Callable[[GpuBound], int]) -> Samples[GpuStatus]:
    """A GPU's bound value, when the document holds its bound."""
    return one(lambda gpu: None if (bound := gpu.bound()) is None else value(bound))


GPU_REPLICA_METRICS: tuple[MetricRow[GpuStatus], ...] = (
    gauge(
        "mpsagent_replicas",
        "Advertised replicas by resource, GPU and health",
        each(
            ("Healthy", "Unhealthy"),
            lambda gpu, health: gpu.healthy if health == "Healthy" else gpu.replicas - gpu.healthy,
        ),
        labels=("health",),
    ),
)
ROUTES = ("device-plugin", "claim")
ENFORCEMENTS = tuple(layer.value for layer in Enforcement)


def _held(gpu: GpuStatus, route: str, memory: bool) -> int:
    if memory:
        value = gpu.grant_memory_mib if route == "device-plugin" else gpu.claim_memory_mib
        return (value or 0) * MIB
    return (gpu.grant_compute if route == "device-plugin" else gpu.claim_compute) or 0


GPU_HELD_METRICS: tuple[MetricRow[GpuStatus], ...] = (
    gauge(
        "mpsagent_gpu_memory_bytes",
        "The GPU's memory, as its shares are computed from (the ceiling with no live share)",
        one(lambda gpu: None if gpu.memory_mib is None else gpu.memory_mib * MIB),
    ),
    gauge(
        "mpsagent_gpu_held_memory_bytes",
        "Memory of the GPU the live shares hold, by route: device-plugin grants (k/N per replica), DRA claims",
        each(ROUTES, lambda gpu, route: _held(gpu, route, memory=True)),
        labels=("route",),
    ),
    gauge(
        "mpsagent_gpu_held_compute_percent",
        "Per cent of the GPU's SMs the live shares hold, by route",
        each(ROUTES, lambda gpu, route: _held(gpu, route, memory=False)),
        labels=("route",),
    ),
    gauge(
        "mpsagent_gpu_enforcement",
        "1 for who holds a capped container to its memory on the GPU: the driver (per container cgroup, then MPS's "
        "ceilings) or MPS alone",
        each(ENFORCEMENTS, lambda gpu, layer: gpu.enforcement == layer),
        labels=("layer",),
    ),
    gauge(
        "mpsagent_replicas_withheld",
        "Free replicas ListAndWatch does not offer: their share no longer fits beside the claims on the GPU",
        one(lambda gpu: gpu.withheld),
    ),
)
GPU_BOUND_METRICS: tuple[MetricRow[GpuStatus], ...] = (
    gauge(
        "mpsagent_daemon_memory_ceiling_bytes",
        "The pinned memory the MPS daemon allows any client on the GPU",
        _bounded(lambda bound: bound.memory_ceiling_mib * MIB),
    ),
    gauge(
        "mpsagent_gpu_live_grants",
        "Live grants (MPS clients) holding a share of the GPU",
        _bounded(lambda bound: bound.live_grants),
    ),
    gauge(
        "mpsagent_escape_memory_bytes",
        "Most memory beyond its own cap that a container on the GPU gets by unsetting its variables",
        _bounded(lambda bound: bound.memory_escape_mib * MIB),
    ),
    gauge(
        "mpsagent_escape_thread_percent",
        "Most thread percentage points beyond its own cap that a container on the GPU gets by unsetting them",
        _bounded(lambda bound: bound.thread_escape),
    ),
)


GRANT_KINDS = tuple(kind.value for kind in GrantKind)
"""The metrics' `kind` label of a grant: every kind, so that a kind with no grant yet is a 0."""


class LedgerStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    allocated: dict[str, Count] = {}
    """Grants made by Allocate, by kind (`GrantKind`'s values: text, so that an older reader takes a newer kind)."""
    adopted: Count = 0
    superseded: Count = 0
    released: Count = 0
    live: dict[str, Count] = {}


LEDGER_METRICS: tuple[MetricRow[LedgerStatus], ...] = (
    counter(
        "mpsagent_grants",
        f"Grants made by Allocate, by kind ({', '.join(GRANT_KINDS)})",
        each(GRANT_KINDS, lambda ledger, kind: ledger.allocated.get(kind, 0)),
        labels=("kind",),
    ),
    counter(
        "mpsagent_grants_adopted",
        "Grants learned from the kubelet's pod-resources listing",
        one(lambda ledger: ledger.adopted),
    ),
    counter(
        "mpsagent_grants_released",
        "Grants released because their container is gone",
        one(lambda ledger: ledger.released),
    ),
    gauge(
        "mpsagent_active_grants",
        "Live grants in the ledger",
        each(GRANT_KINDS, lambda ledger, kind: ledger.live.get(kind, 0)),
        labels=("kind",),
    ),
)


class GrantStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    grant_id: Count = msgspec.field(name="id")
    kind: str
    share: str | None = None
    container: str | None = None
    adopted: bool = False
    granted_at: str
    unlisted_since: str | None = None
    device_ids: tuple[str, ...]
    claim: str | None = None
    """The DRA claim (`namespace/name`) whose share of a GPU this is; None for a device-plugin grant."""
    memory_limit: str | None = None
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT as its container has it (`0=20389M`: the GPUs it sees); None uncapped."""


class ResourceStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    name: str
    registered: bool = False
    registrations: Count = 0
    registration_failures: Count = 0
    replicas: Count = 0
    healthy: Count = 0
    gpus: dict[str, GpuStatus] = {}
    daemon: DaemonStatus
    ledger: LedgerStatus = LedgerStatus()
    grants: tuple[GrantStatus, ...] = ()


REGISTRATION_METRICS: tuple[MetricRow[ResourceStatus], ...] = (
    counter(
        "mpsagent_kubelet_registrations",
        "Successful registrations with the kubelet",
        one(lambda res: res.registrations),
    ),
    gauge("mpsagent_kubelet_registered", "1 while registered with the kubelet", one(lambda res: res.registered)),
    counter(
        "mpsagent_kubelet_registration_failures",
        "Failed registrations with the kubelet",
        one(lambda res: res.registration_failures),
    ),
)


def _gpus(res: ResourceStatus) -> Iterable[tuple[Labels, GpuStatus]]:
    return (((uuid,), gpu) for uuid, gpu in res.gpus.items())


RESOURCE_METRICS: tuple[MetricRow[ResourceStatus], ...] = (
    *within(("gpu",), _gpus, GPU_REPLICA_METRICS),
    *within((), lambda res: (((), res.ledger),), LEDGER_METRICS),
    *within((), lambda res: (((), res.daemon),), DAEMON_METRICS),
    *REGISTRATION_METRICS,
    *within(("gpu",), _gpus, GPU_BOUND_METRICS),
    *within(("gpu",), _gpus, GPU_HELD_METRICS),
)
"""Each resource's families, in the order /metrics shows them; each sample also gets the resource's label."""


class PodResourcesStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    socket: str | None = None
    available: bool
    answers: Count = 0
    failures: Count = 0


POD_RESOURCES_METRICS: tuple[MetricRow[PodResourcesStatus], ...] = (
    gauge(
        "mpsagent_pod_resources_up",
        "1 while the kubelet's pod-resources API answers",
        one(lambda pod_resources: pod_resources.available),
    ),
    counter(
        "mpsagent_pod_resources_failures",
        "Failed pod-resources List calls",
        one(lambda pod_resources: pod_resources.failures),
    ),
)


class ClaimDeviceStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    device: str
    gpu: str
    resource: str
    memory_mib: Count = msgspec.field(name="memoryMiB")
    thread_percentage: Count
    kind: GrantKind
    """Its grant kind. Agents before it wrote a flag, `whole`, instead: such an agent's file with a prepared claim
    is a one-line error naming this field, until an agent of this version starts and rewrites it."""
    rounded_off_bytes: Count = 0
    """The allocated memory below a whole MiB, which the cap leaves out."""


class ClaimStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    claim: str
    """`namespace/name`."""
    uid: str
    pods: tuple[str, ...] = ()
    devices: tuple[ClaimDeviceStatus, ...] = ()
    prepared_at: str


class TaintRuleStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """An administrator's DeviceTaintRule that taints devices of the node's slice (the scheduler honours it; the
    agent shows it)."""

    rule: str
    devices: tuple[str, ...]
    key: str
    value: str = ""
    effect: str
    time_added: str | None = None


class DraStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The DRA driver's part (`--dra on`): its registration with the kubelet, the node's slice, the claims."""

    driver: str
    node: str
    registered: bool = False
    slice_published: bool = False
    slice_writes: Count = 0
    """Writes of the node's ResourceSlice (create, apply, delete) since the start: none while nothing changes."""
    prepared: Count = 0
    """Claims prepared, all time (a retried prepare of a claim already prepared is answered, not counted)."""
    refused: Count = 0
    unprepared: Count = 0
    claims: tuple[ClaimStatus, ...] = ()
    health_watched: tuple[str, ...] = ()
    """The health service of each stream the kubelet holds open now, as it called it: `v1.DRAResourceHealth`
    (kubelet 1.37 and later), `v1alpha1.DRAResourceHealth` (1.36); none while its `ResourceHealthStatus` is off."""
    taint_rules: tuple[TaintRuleStatus, ...] = ()
    """The administrators' DeviceTaintRules that taint devices of the node's slice, as last seen."""
    taint_rules_unseen: str | None = None
    """Why the DeviceTaintRules are not watched now (not listed yet, none served before Kubernetes 1.37, a failing
    list or watch); None while they are."""


DRA_METRICS: tuple[MetricRow[DraStatus], ...] = (
    gauge(
        "mpsagent_dra_registered", "1 while the DRA driver is registered with the kubelet", one(lambda d: d.registered)
    ),
    gauge(
        "mpsagent_dra_slice_published",
        "1 once the node's ResourceSlice is published (and its last publish worked)",
        one(lambda d: d.slice_published),
    ),
    counter(
        "mpsagent_dra_slice_writes",
        "Writes of the node's ResourceSlice (none while what it offers does not change)",
        one(lambda d: d.slice_writes),
    ),
    gauge("mpsagent_dra_prepared_claims", "DRA claims prepared on the node now", one(lambda d: len(d.claims))),
    counter(
        "mpsagent_dra_prepares",
        "DRA claim prepares, by outcome (ok, refused)",
        each(("ok", "refused"), lambda d, outcome: d.prepared if outcome == "ok" else d.refused),
        labels=("outcome",),
    ),
    counter("mpsagent_dra_unprepares", "DRA claims unprepared", one(lambda d: d.unprepared)),
)


class StatusDocument(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What status.json holds, `--status` prints, and metrics and `/readyz` read."""

    version: str
    pid: Pid | None = None
    tasks: Count = 0
    pod_resources: PodResourcesStatus
    unhealthy_gpus: dict[str, str] = {}
    resources: tuple[ResourceStatus, ...]
    dra: DraStatus | None = None
    """Absent unless the agent runs with --dra on."""
    container_limits: tuple[ContainerLimit, ...] = ()
    """The driver's memory limit of each container the agent's hook limited, on each GPU, and its use there."""
    stowaways: StowawayStatus | None = None
    """The processes on the GPUs whose pods hold no grant or claim there; None where the agent cannot list GPU
    processes (GPUs not from NVML)."""
    written_at: str | None = None
    """Set by write_status."""


def _resources(document: StatusDocument) -> Iterable[tuple[Labels, ResourceStatus]]:
    return (((res.name,), res) for res in document.resources)


def _container_limits(document: StatusDocument) -> Iterable[tuple[Labels, ContainerLimit]]:
    return (((limit.gpu, limit.pod_uid or "", limit.container_id), limit) for limit in document.container_limits)


CONTAINER_LIMIT_METRICS: tuple[MetricRow[ContainerLimit], ...] = (
    gauge(
        "mpsagent_container_gpu_memory_limit_bytes",
        "The driver's memory limit of a container's cgroup on the GPU (set by the agent's CDI hook)",
        one(lambda limit: limit.limit_bytes),
    ),
    gauge(
        "mpsagent_container_gpu_memory_used_bytes",
        "GPU memory a container's processes use, as the driver counts it against the container's limit",
        one(lambda limit: limit.used_bytes),
    ),
)


def _stowaway_pods(status: StowawayStatus) -> Iterable[Sample]:
    """The stowaways counted by GPU and pod (no pod: the host's processes)."""
    counts: dict[Labels, int] = {}
    for stowaway in status.stowaways:
        labels = (stowaway.gpu, stowaway.pod_uid or "", stowaway.namespace or "", stowaway.pod or "")
        counts[labels] = counts.get(labels, 0) + 1
    return sorted(counts.items())


STOWAWAY_METRICS: tuple[MetricRow[StowawayStatus], ...] = (
    gauge(
        "mpsagent_stowaway_processes",
        "Processes on the GPU whose pod holds no grant or claim on it (no pod: processes on the host), by pod",
        _stowaway_pods,
        labels=("gpu", "pod_uid", "pod_namespace", "pod_name"),
    ),
    counter(
        "mpsagent_stowaways_found",
        "Processes found on a GPU their pod holds no grant or claim on, since the start (each once)",
        one(lambda status: status.found),
    ),
    gauge(
        "mpsagent_stowaways_unchecked",
        "1 while processes in pods cannot be judged (the kubelet's container names cannot be read)",
        one(lambda status: status.unchecked is not None),
    ),
)

STATUS_METRICS: tuple[MetricRow[StatusDocument], ...] = (
    *within(("resource",), _resources, RESOURCE_METRICS),
    *within((), lambda document: (((), document.pod_resources),), POD_RESOURCES_METRICS),
    *within((), lambda document: (((), document.dra),) if document.dra else (), DRA_METRICS),
    *within(("gpu", "pod_uid", "container_id"), _container_limits, CONTAINER_LIMIT_METRICS),
    *within((), lambda document: (((), document.stowaways),) if document.stowaways else (), STOWAWAY_METRICS),
)
"""Every family `/metrics` reads from the status document, in the order it shows them."""
