"""The supervisor: one task group owns every long-lived task of the agent.

Start order: the node guard (one agent per resource and GPU of the node), the directories under the MPS root,
each resource's locks; each resource's server (`resource_server`) built whole, and the kubelet's listing read into
its ledger; then, in the group: the HTTP endpoint, the node labels, the GPU health monitor, each resource's server
(MPS daemon up and holding its ceilings, then the plugin endpoint), the reconciler and the state publisher. Any
task's failure, or SIGTERM, SIGINT or SIGHUP, cancels the group; each task cleans up in its own `finally` within a
bounded time. The last log line names the stop reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup, TaskStatus

from mpsagent.base.devices import GpuUuid
from mpsagent.base.errors import HostError, MpsAgentError, agent_errors
from mpsagent.base.host import node_name
from mpsagent.base.logs import get_logger
from mpsagent.base.settings import Settings
from mpsagent.base.values import DraMode, MpsDaemonOwner, MpsOnExit
from mpsagent.documents.status import starting_document
from mpsagent.domain.plan import NodePlan
from mpsagent.dra.prepared_claims import CHECKPOINT_FILE, live_claims_without_dra
from mpsagent.gpu.monitor import GpuHealthMonitor
from mpsagent.gpu.port import GpuSource
from mpsagent.kubelet.guard import NodeGuard
from mpsagent.kubelet.podresources import PodResourcesReconciler, ReconcileTarget
from mpsagent.mps.paths import DAEMON_OWNER_LOCK_FILE, ResourceLock, prepare_directories
from mpsagent.node.nfd import node_labels, remove_features, write_features
from mpsagent.node.systemd import SystemdNotifier
from mpsagent.supervisor.claim_server import ClaimServer
from mpsagent.supervisor.driver_limits import DriverLimits, driver_limits
from mpsagent.supervisor.pod_events import PodEvents
from mpsagent.supervisor.publisher import StatePublisher, feed_watchdog
from mpsagent.supervisor.resource_server import ResourceServer
from mpsagent.supervisor.stop_signals import wait_stop_signal
from mpsagent.supervisor.stowaway_watch import StowawayWatch

if TYPE_CHECKING:
    from mpsagent.web import WebEndpoint

log = get_logger("mpsagent.app")


class _NoGpuHealth:
    """GPUs from a node snapshot: there is no NVML to ask about their health."""

    def unhealthy(self) -> dict[GpuUuid, str]:
        return {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        log.info("gpu health not watched", reason="GPUs come from a node snapshot")
        task_status.started()


def _gpu_health(
    settings: Settings, plan: NodePlan, gpu_source: GpuSource, resources: Sequence[ResourceServer]
) -> GpuHealthMonitor | _NoGpuHealth:
    if gpu_source.health is None:
        return _NoGpuHealth()
    return GpuHealthMonitor(
        source=gpu_source.health,
        inventories=[r.inventory for r in resources],
        uuids=[gpu.uuid for gpu in plan.gpus],
        policy=settings.xid_policy,
        recovery_s=settings.health_recovery_s,
    )


def _stowaway_watch(
    settings: Settings,
    plan: NodePlan,
    gpu_source: GpuSource,
    resources: Sequence[ResourceServer],
    claims: ClaimServer | None,
) -> StowawayWatch | None:
    if gpu_source.health is None:
        return None  # GPUs not from NVML: no process lists
    return StowawayWatch(
        gpus=[gpu.uuid for gpu in plan.gpus],
        source=gpu_source.health,
        proc_root=settings.proc_root,
        container_logs_dir=settings.container_logs_dir,
        interval_s=settings.probe_interval_s,
        grants=lambda: [grant for r in resources for grant in r.allocator.ledger.live_grants()],
        daemon_pids=lambda: frozenset(pid for r in resources if (pid := r.daemon.status().pid) is not None),
        claims=claims.driver.prepared_claims if claims is not None else tuple,
        read_claim_pods=claims.driver.read_pods_again if claims is not None else None,
    )


def _write_node_labels(settings: Settings, plan: NodePlan) -> None:
    path = settings.nfd_features_file
    if path is None:
        return
    try:
        labels = node_labels(plan.gpus, plan.resources)
        if write_features(path, labels):
            log.info("node labels written for node-feature-discovery", path=str(path), labels=len(labels))
    except FileNotFoundError:
        log.warning(
            "node labels not written: the node-feature-discovery features directory is missing",
            path=str(path),
            hint="install node-feature-discovery, or set --nfd-features-file to '' to turn this off",
        )
    except OSError as exc:
        log.warning("node labels not written", path=str(path), reason=str(exc))


def _web_endpoint(settings: Settings, plan: NodePlan, gpu_source: GpuSource) -> WebEndpoint | None:
    if settings.metrics_address is None:
        return None
    # prometheus_client is only loaded when the endpoint is wanted.
    from mpsagent.documents.metrics import AgentMetrics  # noqa: PLC0415
    from mpsagent.web import WebEndpoint  # noqa: PLC0415

    metrics = AgentMetrics(
        starting=starting_document([resource.name for resource in plan.resources]),
        gpus=tuple(gpu.uuid for gpu in plan.gpus),
        gpu_source=gpu_source.health,
        proc_root=settings.proc_root,
    )
    return WebEndpoint(settings.metrics_address, metrics)


def _claim_server(
    settings: Settings,
    plan: NodePlan,
    resources: Sequence[ResourceServer],
    web: WebEndpoint | None,
    driver: DriverLimits | None,
) -> ClaimServer | None:
    if settings.dra is not DraMode.ON:
        refusal = live_claims_without_dra(plan.mps_root / CHECKPOINT_FILE)
        if refusal is not None:
            raise HostError(refusal)
        return None
    return ClaimServer(
        plan=plan,
        resources=resources,
        node=node_name(settings.node_name),
        kubelet_dir=settings.kubelet_socket.parent.parent,
        cdi_dir=settings.cdi_spec_dir,
        kubeconfig=settings.kubeconfig,
        prepare_timer=web.metrics.claim_timer() if web else None,
        unhealthy_effect=settings.dra_taint_effect,
        limit_devices=None if driver is None else driver.devices,
    )


def _hold_locks(locks: ExitStack, settings: Settings, plan: NodePlan) -> None:
    # Before the MPS root is touched: another agent of this node may serve the resource from another root.
    locks.enter_context(NodeGuard(settings.kubelet_socket.parent, plan.resources))
    prepare_directories(plan)
    for resource_plan in plan.resources:
        locks.enter_context(ResourceLock(resource_plan))
        if settings.mps_daemon is MpsDaemonOwner.AGENT:
            locks.enter_context(
                ResourceLock(
                    resource_plan,
                    file_name=DAEMON_OWNER_LOCK_FILE,
                    role="already runs the MPS daemon of",
                    hint="if it is a daemon host (mpsagent --daemon-host), start the agent with --mps-daemon host",
                )
            )


def _resource_servers(
    settings: Settings,
    plan: NodePlan,
    gpu_source: GpuSource,
    *,
    web: WebEndpoint | None,
    reconciler: PodResourcesReconciler,
    pod_events: PodEvents | None,
    driver: DriverLimits | None,
) -> list[ResourceServer]:
    """Each resource's server, built whole, its ledger reconciled by `reconciler`."""
    resources = [
        ResourceServer(
            plan=resource_plan,
            shm_directory=plan.shm_directory,
            settings=settings,
            gpu_source=gpu_source,
            rpc_timer=web.metrics.rpc_timer(resource_plan.name) if web else None,
            reconcile_soon=reconciler.request,
            on_hold_ended=pod_events.report if pod_events is not None else lambda ended: None,
            limit_devices=None if driver is None else driver.devices,
        )
        for resource_plan in plan.resources
    ]
    for resource in resources:
        reconciler.add_target(
            ReconcileTarget(allocator=resource.allocator, on_ledger_changed=resource.hold_ledger_ceilings)
        )
    return resources


@dataclass(frozen=True, kw_only=True, slots=True)
class _Parts:
    """The agent's parts that are built whole, with the locks held, before anything runs."""

    web: WebEndpoint | None
    reconciler: PodResourcesReconciler
    pod_events: PodEvents | None
    driver: DriverLimits | None
    resources: tuple[ResourceServer, ...]
    claims: ClaimServer | None


def _parts(
    settings: Settings, plan: NodePlan, gpu_source: GpuSource, cdi_hook: Path | None, web: WebEndpoint | None
) -> _Parts:
    reconciler = PodResourcesReconciler(socket=settings.pod_resources_socket, grace_s=settings.reconcile_grace_s)
    # Where the API server is reachable, a control-socket hold the agent ends is told on the holder's pod too.
    pod_events = PodEvents(node=node_name(settings.node_name)) if settings.dra is DraMode.ON else None
    servers: list[ResourceServer] = []
    driver = driver_limits(settings, plan, gpu_source, cdi_hook, servers)
    servers += _resource_servers(
        settings, plan, gpu_source, web=web, reconciler=reconciler, pod_events=pod_events, driver=driver
    )
    resources = tuple(servers)
    claims = _claim_server(settings, plan, resources, web, driver)
    return _Parts(
        web=web, reconciler=reconciler, pod_events=pod_events, driver=driver, resources=resources, claims=claims
    )


async def _start_node_layers(tg: TaskGroup, parts: _Parts, stowaways: StowawayWatch | None) -> None:
    """The DRA driver, then the pod events told through its API client; the driver's memory limits' read-back; the
    stowaway watch (which may read claims through the driver's client)."""
    if parts.claims is not None:
        await tg.start(parts.claims.run)
        if parts.pod_events is not None:
            tg.start_soon(parts.pod_events.run, parts.claims.api)
    if parts.driver is not None:
        tg.start_soon(parts.driver.watch.run)
    if stowaways is not None:
        tg.start_soon(stowaways.run)


async def _watch_signals(task_group: TaskGroup, notifier: SystemdNotifier) -> None:
    received = await wait_stop_signal()
    log.info("stopping", reason=received.name)
    notifier.notify("STOPPING=1", f"STATUS=stopping on {received.name}")
    task_group.cancel_scope.cancel()


async def _read_grants(parts: _Parts) -> None:
    """What the node holds since before this start, before any daemon holds ceilings: containers that run must keep
    their caps (the prepared claims' too), and a container the kubelet restarts must find its memory-limit device."""
    if parts.claims is not None:
        parts.claims.restore()
    if await parts.reconciler.reconcile_once():
        for resource in parts.resources:
            resource.grants_known()
    if parts.driver is not None:
        parts.driver.devices.rewrite()


def _state_publisher(
    settings: Settings,
    notifier: SystemdNotifier,
    parts: _Parts,
    health: GpuHealthMonitor | _NoGpuHealth,
    stowaways: StowawayWatch | None,
) -> StatePublisher:
    """The state publisher, reading each part of the agent that has something to show."""
    resources, claims, driver = parts.resources, parts.claims, parts.driver
    return StatePublisher(
        mps_root=settings.mps_root,
        pod_resources_socket=settings.pod_resources_socket,
        resources=lambda: [r.view() for r in resources],
        reconciler=parts.reconciler,
        unhealthy_gpus=health.unhealthy,
        notifier=notifier,
        web=parts.web,
        dra=claims.status if claims is not None else lambda: None,
        container_limits=(lambda: driver.watch.limits) if driver is not None else tuple,
        stowaways=(lambda: stowaways.status) if stowaways is not None else lambda: None,
    )


@contextmanager
def _stop_reported(settings: Settings, notifier: SystemdNotifier) -> Iterator[None]:
    """The agent's way out of its task group, said: the stop reason (a signal, or the failures, of which the first
    the operator must see is raised) in the last log line and systemd's status; the node's MPS features removed when
    a signal quits the daemons."""
    reason = "signal"
    try:
        yield
    except MpsAgentError as exc:
        reason = str(exc)
        raise
    except BaseExceptionGroup as group:
        failures = agent_errors(group)
        reason = "; ".join(str(e) for e in failures) if failures else "internal error"
        if failures:
            raise failures[0] from group
        raise
    finally:
        if settings.nfd_features_file is not None and settings.mps_on_exit is MpsOnExit.QUIT and reason == "signal":
            remove_features(settings.nfd_features_file)  # the node no longer offers MPS
        notifier.notify("STOPPING=1", f"STATUS=stopped: {reason}")
        log.info("agent stopped", reason=reason)


async def run_agent(settings: Settings, plan: NodePlan, gpu_source: GpuSource, cdi_hook: Path | None = None) -> None:
    """Run until a signal or a failure; raises MpsAgentError for a failure the operator must see. `cdi_hook`: the
    agent's CDI hook, where the driver's memory limits are used."""
    notifier = SystemdNotifier()
    notifier.status("starting")
    web = _web_endpoint(settings, plan, gpu_source)
    with ExitStack() as locks:
        locks.callback(notifier.close)
        _hold_locks(locks, settings, plan)
        parts = _parts(settings, plan, gpu_source, cdi_hook, web)
        await _read_grants(parts)
        with _stop_reported(settings, notifier):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_signals, tg, notifier)
                if notifier.watchdog_interval_s is not None:
                    tg.start_soon(feed_watchdog, notifier, notifier.watchdog_interval_s)
                if web is not None:
                    await tg.start(web.run)
                _write_node_labels(settings, plan)
                health = _gpu_health(settings, plan, gpu_source, parts.resources)
                await tg.start(health.run)
                for resource in parts.resources:
                    await tg.start(resource.run)
                stowaways = _stowaway_watch(settings, plan, gpu_source, parts.resources, parts.claims)
                await _start_node_layers(tg, parts, stowaways)
                await tg.start(parts.reconciler.run)
                tg.start_soon(_state_publisher(settings, notifier, parts, health, stowaways).run)
                log.info("agent running", resources=[r.name for r in plan.resources], gpus=len(plan.gpus))
