"""The running agent's state for operators: the status document built from the agent's parts (each resource's
server hands its `ResourceView` to the publisher), what readiness and systemd's `STATUS=` say of it, and the text
`mpsagent --status` prints. `status_file` writes it to `<mps-root>/status.json` and reads it back, so that
`--status` needs no connection to the agent and works the same on a node and in a container.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mpsagent import __version__
from mpsagent.base.cgroups import short_id
from mpsagent.base.clock import ago, utc, utc_of_monotonic
from mpsagent.base.devices import Gpu, GpuUuid, Health, gpu_of
from mpsagent.base.values import MIB
from mpsagent.base.words import counted
from mpsagent.documents.status_document import (
    ClaimDeviceStatus,
    ClaimStatus,
    DraStatus,
    GpuStatus,
    GrantStatus,
    LedgerStatus,
    PodResourcesStatus,
    ResourceStatus,
    StatusDocument,
    TaintRuleStatus,
)
from mpsagent.documents.status_file import agent_running
from mpsagent.domain.accounting import GpuUse, Withheld, gpu_use
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.claims import PreparedClaim, TaintRule
from mpsagent.domain.grant_kind import describe_claim_share
from mpsagent.domain.inventory import AdvertisedDevice, Inventory
from mpsagent.domain.ledger import Grant
from mpsagent.domain.shares import EscapeBound
from mpsagent.domain.stowaways import StowawayStatus
from mpsagent.gpu.limits_watch import ContainerLimit
from mpsagent.kubelet.registration_record import Registration
from mpsagent.mps.daemon_status import ControlHolderStatus, DaemonStatus


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourceView:
    """One resource's snapshot, as its server hands it to the publisher: the daemon's facts as the daemon
    supervisor took them (the document embeds them as they are), and the ledger and inventory, read only when
    the document is built (the publisher watches their versions)."""

    allocator: ResourceAllocator
    inventory: Inventory
    daemon: DaemonStatus
    registration: Registration


def _wall(monotonic: float | None) -> str | None:
    """A monotonic time (the ledger's grace clock) as the UTC time it was."""
    return None if monotonic is None else utc_of_monotonic(monotonic)


def _gpu_entries(
    view: ResourceView, devices: Sequence[AdvertisedDevice], grants: Sequence[Grant]
) -> dict[str, GpuStatus]:
    """Each GPU's replicas and health, with its ceilings and escape bound (see docs/cap-model.md)."""
    counts: dict[GpuUuid, list[int]] = {}  # [replicas, healthy], in the inventory's order
    for device in devices:
        count = counts.setdefault(gpu_of(device.replica_id), [0, 0])
        count[0] += 1
        count[1] += device.health is Health.HEALTHY
    shares = view.allocator.resource.shares
    held = view.daemon.ceilings
    ceilings = view.allocator.ceilings() if held is None else held.ceilings()
    bounds = {b.uuid: b for b in shares.escape_bounds(ceilings, [g.share for g in grants])}
    for uuid in bounds:
        counts.setdefault(uuid, [0, 0])
    withheld = {held.uuid: held for held in view.inventory.withheld()}
    tally = view.allocator.ledger.tally
    gpus = {gpu.uuid: gpu for gpu in view.allocator.resource.gpus}
    return {
        uuid: GpuStatus(replicas=replicas, healthy=healthy)
        if (bound := bounds.get(uuid)) is None
        else _gpu_status(
            replicas, healthy, bound, gpu_use(shares, tally, bound.ordinal), withheld.get(uuid), gpu=gpus.get(uuid)
        )
        for uuid, (replicas, healthy) in counts.items()
    }


def _gpu_status(
    replicas: int, healthy: int, bound: EscapeBound, use: GpuUse, withheld: Withheld | None, *, gpu: Gpu | None
) -> GpuStatus:
    return GpuStatus(
        replicas=replicas,
        healthy=healthy,
        ordinal=bound.ordinal,
        live_grants=bound.live_grants,
        memory_ceiling_mib=bound.memory_ceiling_mib,
        memory_mib=use.gpu.memory_mib,
        thread_ceiling=bound.thread_ceiling,
        memory_escape_mib=bound.memory_escape_mib,
        thread_escape=bound.thread_escape,
        grant_memory_mib=use.grant_memory_mib,
        grant_compute=use.grant_compute,
        claim_memory_mib=use.claim_memory_mib,
        claim_compute=use.claim_compute,
        withheld=0 if withheld is None else len(withheld.replica_ids),
        withheld_reason=None if withheld is None else withheld.reason,
        enforcement=None if gpu is None else gpu.enforcement.value,
        enforcement_reason=None if gpu is None else gpu.memory_limits_unavailable,
    )


class GrantEntries:
    """Each live grant's status entry as last built, per resource, with what it was built from (the grant object,
    its owner, its missing_since). The publisher builds a document every 0.5 s while grants change, on the event
    loop, and most of its grants are the same objects as last time: their entries are kept, not built again."""

    def __init__(self) -> None:
        self._built: dict[str, dict[int, tuple[Grant, object, float | None, GrantStatus]]] = {}

    def of(self, resource: str, grants: Sequence[Grant]) -> tuple[GrantStatus, ...]:
        """The grants' entries, each built again only when its grant changed (only these grants are kept)."""
        earlier = self._built.get(resource, {})
        now: dict[int, tuple[Grant, object, float | None, GrantStatus]] = {}
        for grant in grants:
            owner, missing_since = grant.owner, grant.missing_since
            hit = earlier.get(grant.grant_id)
            if hit is not None and hit[0] is grant and hit[1] == owner and hit[2] == missing_since:
                now[grant.grant_id] = hit
            else:
                now[grant.grant_id] = (grant, owner, missing_since, _grant_status(grant))
        self._built[resource] = now
        return tuple(entry[3] for entry in now.values())


def _grant_status(grant: Grant) -> GrantStatus:
    return GrantStatus(
        grant_id=grant.grant_id,
        kind=grant.kind.value,
        share=grant.share.describe(),
        container=str(grant.owner) if grant.owner else None,
        adopted=grant.adopted,
        granted_at=utc(grant.granted_at),
        unlisted_since=_wall(grant.missing_since),
        device_ids=grant.replica_ids,
        claim=str(grant.claim) if grant.claim else None,
        memory_limit=grant.share.memory_limit_env() or None,
    )


def _resource_status(view: ResourceView, entries: GrantEntries) -> ResourceStatus:
    devices = view.inventory.snapshot().devices
    grants = sorted(view.allocator.ledger.live_grants(), key=lambda g: g.grant_id)
    stats = view.allocator.ledger.statistics()
    name = view.allocator.resource.name
    return ResourceStatus(
        name=name,
        registered=view.registration.registered,
        registrations=view.registration.registrations,
        registration_failures=view.registration.registration_failures,
        replicas=len(devices),
        healthy=sum(d.health is Health.HEALTHY for d in devices),
        gpus=_gpu_entries(view, devices, grants),
        daemon=view.daemon,
        ledger=LedgerStatus(
            allocated={kind.value: count for kind, count in stats.grants.items()},
            adopted=stats.adopted_grants,
            superseded=stats.superseded_grants,
            released=stats.released_grants,
            live={kind.value: count for kind, count in stats.live_grants.items()},
        ),
        grants=entries.of(name, grants),
    )


def status_document(
    *,
    version: str,
    pid: int,
    tasks: int,
    pod_resources: PodResourcesStatus,
    unhealthy_gpus: dict[GpuUuid, str],
    resources: Sequence[ResourceView],
    dra: DraStatus | None = None,
    grant_entries: GrantEntries | None = None,
    container_limits: Sequence[ContainerLimit] = (),
    stowaways: StowawayStatus | None = None,
) -> StatusDocument:
    """`grant_entries`: the entries the last document's builder kept (the publisher's own); none, built anew."""
    entries = grant_entries or GrantEntries()
    return StatusDocument(
        version=version,
        pid=pid,
        tasks=tasks,
        pod_resources=pod_resources,
        unhealthy_gpus=dict(sorted(unhealthy_gpus.items())),
        resources=tuple(_resource_status(view, entries) for view in resources),
        dra=dra,
        container_limits=tuple(container_limits),
        stowaways=stowaways,
    )


def readiness_problems(document: StatusDocument) -> list[str]:
    """What keeps the agent from being ready: each resource must be registered with the kubelet and its MPS daemon
    up, and not kept busy by another control session (its cap switches fail meanwhile). Empty when ready."""
    problems = []
    for res in document.resources:
        if not res.registered:
            problems.append(f"{res.name}: not registered with the kubelet")
        if res.daemon.unresponsive is not None:
            problems.append(f"{res.name}: mps daemon does not answer since {res.daemon.unresponsive.at}")
        elif not res.daemon.up:
            problems.append(f"{res.name}: mps daemon down")
        elif res.daemon.busy is not None:
            problems.append(
                f"{res.name}: mps control daemon busy since {res.daemon.busy.at} (another control session is open)"
            )
    if document.dra is not None and not document.dra.registered:
        problems.append(f"DRA driver {document.dra.driver}: not registered with the kubelet")
    return problems


def starting_document(resources: Sequence[str]) -> StatusDocument:
    """What the agent publishes before its first real document: every resource unregistered, its daemon down and
    no grants, so that metrics and probes have every series and line from the first scrape."""
    return StatusDocument(
        version=__version__,
        pid=os.getpid(),
        pod_resources=PodResourcesStatus(available=False),
        resources=tuple(ResourceStatus(name=name, daemon=DaemonStatus(up=False)) for name in resources),
    )


def summary(document: StatusDocument) -> str:
    """One line for systemd's STATUS=."""
    problems = readiness_problems(document)
    if problems:
        return "; ".join(problems)
    return "serving " + "; ".join(
        f"{res.name} ({res.healthy}/{res.replicas} healthy, {counted(len(res.grants), 'grant')}, "
        f"caps {res.daemon.cap_mode})"
        for res in document.resources
    )


def _users(multi_user: bool | None) -> str:
    if multi_user is None:
        return "user mode unknown (adopted from an older agent)"
    return "one server for every user (-M)" if multi_user else "one server per user"


def _daemon_events(daemon: DaemonStatus) -> list[str]:
    lines = []
    tampered = daemon.last_cap_tamper
    if tampered:
        seen = "seen in the control log" if tampered.seen_by == "control_log" else "read back"
        lines.append(
            f"  ceilings changed behind the agent {counted(daemon.cap_tamper, 'time')} "
            f"({daemon.cap_tamper_in_log} seen in the control log), last at {tampered.at} (restored; {seen}): "
            f"{tampered.found}"
        )
    watch = daemon.control_log
    if watch is not None and not watch.watched:
        why = watch.problem or f"a line not understood: {watch.first_unknown_line}"
        lines.append(
            f"  control log NOT WATCHED ({watch.file}): {why}; ceiling changes are seen by the read-back only, "
            "in whole GiB (docs/cap-model.md)"
        )
    elif watch is not None and watch.problem is not None:
        lines.append(f"  control log followed ({watch.file}); last at {watch.problem_at}: {watch.problem}")
    failing = daemon.front_end_failure
    if failing:
        lines.append(
            f"  control front-end CANNOT RUN since {failing.at}: {failing.reason} "
            "(the daemon is kept; cap switches fail until it runs)"
        )
    damage = daemon.record_damage
    if damage:
        lines.append(
            f"  daemon record {damage.path} DAMAGED since {damage.at}: {damage.problem} "
            "(no daemon is adopted from it until it is rewritten: see docs/troubleshooting.md)"
        )
    busy = daemon.busy
    if busy:
        lines.append(f"  control daemon BUSY since {busy.at} (kept; cap switches fail until it answers): {busy.reason}")
    return lines + _control_socket_lines(daemon)


def _described_holder(holder: ControlHolderStatus) -> str:
    place = (
        f"in pod {holder.pod_uid}, container {short_id(holder.container_id or '')}"
        if holder.pod_uid is not None
        else "on the host"
    )
    what = "a connection that sends nothing" if holder.silent else "a session"
    process = "a process that is gone" if holder.pid is None else f"PID {holder.pid}"
    return f"{process} {place} ({what} on `{holder.socket}`) since {holder.since}"


def _control_socket_lines(daemon: DaemonStatus) -> list[str]:
    """The daemon's liveness and who holds its control socket."""
    lines = []
    silent = daemon.unresponsive
    if silent:
        lines.append(
            f"  mps daemon DOES NOT ANSWER since {silent.at} (replicas Unhealthy, devices tainted): {silent.reason}"
        )
    lines += [f"  control socket HELD by {_described_holder(holder)}" for holder in daemon.control_holders]
    ended = daemon.last_control_hold_ended
    if ended:
        lines.append(
            f"  control socket holds ended: {daemon.control_holds_ended}, last at {ended.at} after "
            f"{ended.held_for_s:g} s: {_described_holder(ended.holder)}"
        )
    if daemon.control_holders_unseen:
        lines.append(f"  who holds the control socket CANNOT BE SEEN: {daemon.control_holders_unseen}")
    return lines


def _gpu_lines(gpus: dict[str, GpuStatus]) -> list[str]:
    """Each GPU's ceilings and escape bound: what a container on it gets at most by unsetting its variables."""
    lines = []
    for uuid, gpu in gpus.items():
        bound = gpu.bound()
        if bound is None:
            continue
        lines.append(
            f"  GPU {bound.ordinal} ({uuid}): {counted(bound.live_grants, 'live grant')}; ceilings "
            f"{bound.memory_ceiling_mib} of {bound.memory_mib} MiB, threads {bound.thread_ceiling}%; escape bound: "
            f"+{bound.memory_escape_mib} MiB, +{bound.thread_escape} threads % over the smallest live share"
        )
        if gpu.claim_memory_mib or gpu.claim_compute:
            lines.append(
                f"    held: device-plugin grants {gpu.grant_memory_mib} MiB and {gpu.grant_compute} % of the SMs, "
                f"DRA claims {gpu.claim_memory_mib} MiB and {gpu.claim_compute} %"
            )
        if gpu.withheld:
            lines.append(
                f"    {counted(gpu.withheld, 'free replica')} WITHHELD from the kubelet: {gpu.withheld_reason}"
            )
        if gpu.enforcement is not None:
            why = f" ({gpu.enforcement_reason})" if gpu.enforcement_reason else ""
            lines.append(f"    memory enforced by: {gpu.enforcement}{why}")
    return lines


def _container_limit_lines(limits: Sequence[ContainerLimit]) -> list[str]:
    """Each container the hook limited: the driver's limit on each of its GPUs, and its use there."""
    if not limits:
        return []
    lines = ["", f"container memory limits set by the driver: {counted(len(limits), 'limit')}"]
    for limit in limits:
        pod = f" (pod {limit.pod_uid})" if limit.pod_uid else ""
        lines.append(
            f"  {short_id(limit.container_id)}{pod} on {limit.gpu}: {limit.limit_bytes // MIB} MiB, using "
            f"{limit.used_bytes // MIB} MiB, since {limit.set_at}"
        )
    return lines


def _stowaway_lines(status: StowawayStatus | None) -> list[str]:
    """The processes on the GPUs whose pods hold no share there, or that none could be judged."""
    if status is None or not (status.stowaways or status.unchecked):
        return []
    lines = ["", f"processes on a GPU without a grant or claim there: {len(status.stowaways)} ({status.found} found)"]
    if status.unchecked:
        lines.append(
            f"  processes in pods NOT judged: the kubelet's container names cannot be read ({status.unchecked})"
        )
    for stowaway in status.stowaways:
        used = "" if stowaway.used_bytes is None else f", using {stowaway.used_bytes // MIB} MiB"
        lines.append(f"  {stowaway.describe()} on {stowaway.gpu}{used}, since {stowaway.seen_at}")
    return lines


def _holder(grant: GrantStatus, now: float) -> str:
    """The grant's container, or that it is waiting for one: the kubelet lists a container only once its Allocate
    has returned, so a new grant is not "unlisted" until its container was listed once."""
    if grant.claim is not None:
        return f"claim {grant.claim}"
    if grant.container is None:
        return f"waiting for the kubelet to list its container (granted {ago(grant.granted_at, now)})"
    holder = grant.container + (" (adopted)" if grant.adopted else "")
    if grant.unlisted_since:
        holder += f" (not listed by the kubelet since {grant.unlisted_since})"
    return holder


def _grant_line(grant: GrantStatus, now: float) -> str:
    ids = grant.device_ids
    shown = ", ".join(ids) if len(ids) <= 2 else f"{ids[0]} ... ({len(ids)} replicas)"
    limit = f", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={grant.memory_limit}" if grant.memory_limit else ""
    share = f" [{grant.share}{limit}]" if grant.share else ""
    return f"    #{grant.grant_id} {grant.kind:<6} {_holder(grant, now)}{share}" + (f": {shown}" if ids else "")


def claim_status(prepared: PreparedClaim) -> ClaimStatus:
    """A prepared claim as the status document shows it (the claim server gives the DRA part its claims)."""
    return ClaimStatus(
        claim=str(prepared.claim),
        uid=prepared.claim.uid,
        pods=prepared.pods,
        devices=tuple(
            ClaimDeviceStatus(
                device=d.device,
                gpu=d.gpu,
                resource=d.resource,
                memory_mib=d.memory_mib,
                thread_percentage=d.thread_percentage,
                kind=d.kind,
                rounded_off_bytes=d.rounded_off_bytes,
            )
            for d in prepared.devices
        ),
        prepared_at=utc(prepared.prepared_at),
    )


def taint_rule_status(rule: TaintRule, devices: Sequence[str]) -> TaintRuleStatus:
    """An administrator's DeviceTaintRule on the node's `devices` as the status document shows it."""
    return TaintRuleStatus(
        rule=rule.name,
        devices=tuple(devices),
        key=rule.key,
        value=rule.value,
        effect=rule.effect,
        time_added=None if rule.added is None else utc(rule.added),
    )


def _taint_rule_lines(dra: DraStatus) -> list[str]:
    count = len(dra.taint_rules)
    if dra.taint_rules_unseen is None:
        lines = [f"  DeviceTaintRules on its devices: {count}"]
    else:
        last_seen = f"; {count} on its devices when last seen" if count else ""
        lines = [f"  DeviceTaintRules not watched: {dra.taint_rules_unseen}{last_seen}"]
    for rule in dra.taint_rules:
        since = f" (since {rule.time_added})" if rule.time_added else ""
        lines.append(f"    {rule.rule}: {rule.key}={rule.value}:{rule.effect} on {', '.join(rule.devices)}{since}")
    return lines


def _health_watched(services: Sequence[str]) -> str:
    return f"watched by the kubelet over {', '.join(services)}" if services else "not watched by the kubelet"


def _dra_lines(dra: DraStatus) -> list[str]:
    lines = [
        "",
        f"DRA driver {dra.driver} on node {dra.node}: {'registered' if dra.registered else 'NOT registered'} with "
        f"the kubelet, ResourceSlice {'published' if dra.slice_published else 'NOT published'}; "
        f"{counted(dra.prepared, 'prepare')}, {dra.refused} refused, {dra.unprepared} unprepared",
        f"  device health {_health_watched(dra.health_watched)}",
        *_taint_rule_lines(dra),
        f"  prepared claims: {len(dra.claims)}",
    ]
    for claim in dra.claims:
        pods = ", ".join(claim.pods) or "no pod reserved"
        lines.append(f"    {claim.claim} (uid {claim.uid}, prepared {claim.prepared_at}) for {pods}")
        lines += [f"      {d.device} ({d.gpu}, {d.resource}): {describe_claim_share(d)}" for d in claim.devices]
    return lines


def render_status_text(document: StatusDocument) -> str:
    now = time.time()
    pod_resources = document.pod_resources
    alive = "" if agent_running(document) else " -- NOT RUNNING: this is its last state"
    lines = [
        f"mpsagent {document.version} (pid {document.pid}), written {document.written_at or '?'}{alive}",
        f"pod-resources: {'answering' if pod_resources.available else 'NOT answering'} "
        f"({pod_resources.socket or 'socket not known'})",
    ]
    for uuid, reason in document.unhealthy_gpus.items():
        lines.append(f"GPU {uuid} unhealthy: {reason}")
    for res in document.resources:
        daemon = res.daemon
        lines += [
            "",
            f"{res.name}: {res.healthy}/{res.replicas} replicas healthy, "
            f"{'registered' if res.registered else 'NOT registered'} with the kubelet",
            f"  mps daemon: {'up' if daemon.up else 'DOWN'}, pid {daemon.pid}, caps {daemon.cap_mode}, "
            f"{counted(daemon.restarts, 'restart')}, {_users(daemon.multi_user)}",
            *_daemon_events(daemon),
            *_gpu_lines(res.gpus),
            f"  grants: {len(res.grants)}",
            *(_grant_line(grant, now) for grant in res.grants),
        ]
    lines += _container_limit_lines(document.container_limits)
    lines += _stowaway_lines(document.stowaways)
    if document.dra is not None:
        lines += _dra_lines(document.dra)
    return "\n".join(lines)
