"""The supervisor: one task group owns every long-lived task of the agent.

Start order: the node guard (one agent per resource and GPU of the node), then per resource: lock, directories,
MPS daemon (up and holding its defaults), plugin endpoint. Any task's failure, or SIGTERM, SIGINT or SIGHUP,
cancels the group; each task cleans up in its own `finally` within a bounded time. The last log line names the
stop reason.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup, TaskStatus

from mpsagent.allocation import Allocation, ResourceAllocator
from mpsagent.config import MpsDaemonOwner, MpsOnExit, Settings
from mpsagent.devices import GpuUuid, gpu_of
from mpsagent.errors import DaemonError, MpsAgentError
from mpsagent.gpu.monitor import GpuHealthMonitor
from mpsagent.gpu.port import GpuSource
from mpsagent.inventory import Inventory
from mpsagent.kubelet.guard import NodeGuard
from mpsagent.kubelet.plugin import PluginEndpoint
from mpsagent.kubelet.podresources import PodResourcesReconciler, ReconcileTarget
from mpsagent.kubelet.servicer import DevicePluginServicer, OnGranted
from mpsagent.logs import get_logger
from mpsagent.mps.daemon import DaemonSupervisor
from mpsagent.mps.paths import DAEMON_OWNER_LOCK_FILE, ResourceLock, prepare_directories
from mpsagent.nfd import remove_features, write_features
from mpsagent.plan import NodePlan, ResourcePlan
from mpsagent.publisher import StatePublisher, feed_watchdog
from mpsagent.status import DaemonView, ResourceView, starting_document
from mpsagent.systemd import SystemdNotifier

if TYPE_CHECKING:
    from mpsagent.web import WebEndpoint

log = get_logger("mpsagent.app")

MAX_LOGGED_GRANTS = 5


@dataclass(kw_only=True, slots=True)
class _Resource:
    """One resource's parts; the daemon exists once the initial reconciliation has decided its first ceilings."""

    plan: ResourcePlan
    allocator: ResourceAllocator
    inventory: Inventory
    daemon: DaemonSupervisor | None = None
    endpoint: PluginEndpoint | None = None

    def view(self) -> ResourceView:
        daemon = self.daemon
        return ResourceView(
            allocator=self.allocator,
            inventory=self.inventory,
            daemon=DaemonView(
                pid=daemon.pid if daemon else None,
                up=daemon.up if daemon else False,
                ceilings=daemon.ceilings if daemon else None,
                restarts=daemon.restarts if daemon else 0,
                restart_attempts=daemon.restart_attempts if daemon else 0,
                multi_user=daemon.multi_user if daemon else None,
                cap_tamper=daemon.cap_tamper_count if daemon else 0,
                last_cap_tamper=daemon.last_cap_tamper if daemon else None,
                front_end_failure=daemon.front_end_failure if daemon else None,
            ),
            registered=self.endpoint is not None and self.endpoint.registered,
            registrations=self.endpoint.statistics().registrations if self.endpoint else 0,
            registration_failures=self.endpoint.statistics().registration_failures if self.endpoint else 0,
        )

    async def hold_caps(self, *, verify: bool = False) -> None:
        """Make the daemon hold the ceilings the ledger's live grants need (`verify`: read back even ceilings it is
        believed to hold); raises DaemonError when it cannot (an Allocate or a pre-start then fails)."""
        assert self.daemon is not None
        await self.daemon.set_ceilings(self.allocator.ceilings(), verify=verify)

    async def hold_ledger_ceilings(self) -> None:
        """Make the daemon hold the ceilings the ledger needs; a daemon that is down takes them when it is back."""
        if self.daemon is None:
            return
        try:
            await self.hold_caps()
        except DaemonError as exc:
            log.error("mps daemon caps not changed", resource=self.plan.name, reason=str(exc))  # noqa: TRY400 (no traceback for a known failure)


def _on_granted(resource: _Resource, reconciler: PodResourcesReconciler) -> OnGranted:
    def on_granted(allocations: Sequence[Allocation]) -> None:
        for allocation in allocations:
            grant = allocation.record.grant
            log.info(
                "granted",
                resource=resource.plan.name,
                grant=grant.grant_id,
                kind=grant.kind.value,
                share=grant.share.describe(),
                replicas=len(grant.replica_ids),
                gpus=sorted({gpu_of(r) for r in grant.replica_ids}),
            )
            ended = allocation.record.ended
            if ended:
                # One line per Allocate however many grants it ends: a full grant can end hundreds at once.
                log.warning(
                    "replicas granted again while believed live",
                    resource=resource.plan.name,
                    grant=grant.grant_id,
                    earlier_grants=[g.grant_id for g in ended[:MAX_LOGGED_GRANTS]],
                    earlier_grant_count=len(ended),
                    containers=sorted({str(g.owner) for g in ended if g.owner})[:MAX_LOGGED_GRANTS],
                    replicas=len(grant.superseded_ids),
                )
        reconciler.request()

    return on_granted


class _NoGpuHealth:
    """GPUs from a node snapshot: there is no NVML to ask about their health."""

    def unhealthy(self) -> dict[GpuUuid, str]:
        return {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        log.info("gpu health not watched", reason="GPUs come from a node snapshot")
        task_status.started()


def _gpu_health(
    settings: Settings, plan: NodePlan, gpu_source: GpuSource, resources: Sequence[_Resource]
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


def _write_node_labels(settings: Settings, plan: NodePlan) -> None:
    path = settings.nfd_features_file
    if path is None:
        return
    try:
        if write_features(path, plan.labels):
            log.info("node labels written for node-feature-discovery", path=str(path), labels=len(plan.labels))
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
    from mpsagent.metrics import AgentMetrics  # noqa: PLC0415
    from mpsagent.web import WebEndpoint  # noqa: PLC0415

    metrics = AgentMetrics(
        starting=starting_document([resource.name for resource in plan.resources]),
        gpus=tuple(gpu.uuid for gpu in plan.gpus),
        gpu_source=gpu_source.health,
        proc_root=settings.proc_root,
    )
    return WebEndpoint(settings.metrics_address, metrics)


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


async def _watch_signals(task_group: TaskGroup, notifier: SystemdNotifier) -> None:
    # SIGHUP stops as SIGTERM does: there is nothing to reload in place (a new configuration means a new plan, new
    # daemons), and a hang-up must not end the agent without its clean-up.
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("stopping", reason=signal.Signals(signum).name)
            notifier.notify("STOPPING=1", f"STATUS=stopping on {signal.Signals(signum).name}")
            task_group.cancel_scope.cancel()
            return


async def run_agent(settings: Settings, plan: NodePlan, gpu_source: GpuSource) -> None:
    """Run until a signal or a failure; raises MpsAgentError for a failure the operator must see."""
    reason = "signal"
    notifier = SystemdNotifier()
    notifier.status("starting")
    web = _web_endpoint(settings, plan, gpu_source)
    with ExitStack() as locks:
        locks.callback(notifier.close)
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
        resources = [
            _Resource(plan=r, allocator=ResourceAllocator(r, plan.shm_directory), inventory=Inventory(r))
            for r in plan.resources
        ]
        reconciler = PodResourcesReconciler(
            socket=settings.pod_resources_socket,
            targets=[
                ReconcileTarget(allocator=r.allocator, on_ledger_changed=r.hold_ledger_ceilings) for r in resources
            ],
            grace_s=settings.reconcile_grace_s,
        )
        # Before any daemon holds ceilings: containers that run since before this start must keep their caps.
        grants_known = await reconciler.reconcile_once()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_signals, tg, notifier)
                if notifier.watchdog_interval_s is not None:
                    tg.start_soon(feed_watchdog, notifier, notifier.watchdog_interval_s)
                if web is not None:
                    await tg.start(web.run)
                _write_node_labels(settings, plan)
                health = _gpu_health(settings, plan, gpu_source, resources)
                await tg.start(health.run)
                for resource in resources:
                    resource.daemon = DaemonSupervisor(
                        resource=resource.plan,
                        inventory=resource.inventory,
                        gpu_source=gpu_source,
                        control_bin=settings.mps_control_bin,
                        on_exit=settings.mps_on_exit,
                        initial_ceilings=resource.allocator.ceilings() if grants_known else None,
                        owner=settings.mps_daemon,
                        probe_interval_s=settings.probe_interval_s,
                    )
                    await tg.start(resource.daemon.run)
                    servicer = DevicePluginServicer(
                        resource.allocator,
                        resource.inventory,
                        pre_start_required=resource.plan.enforce_caps,
                        hold_caps=resource.hold_caps,
                        on_granted=_on_granted(resource, reconciler),
                        rpc_timer=web.metrics.rpc_timer(resource.plan.name) if web else None,
                    )
                    resource.endpoint = PluginEndpoint(
                        resource_name=resource.plan.name,
                        servicer=servicer,
                        kubelet_socket=settings.kubelet_socket,
                        pre_start_required=resource.plan.enforce_caps,
                    )
                    await tg.start(resource.endpoint.run)
                await tg.start(reconciler.run)
                publisher = StatePublisher(
                    mps_root=settings.mps_root,
                    pod_resources_socket=settings.pod_resources_socket,
                    resources=lambda: [r.view() for r in resources],
                    reconciler=reconciler,
                    unhealthy_gpus=health.unhealthy,
                    notifier=notifier,
                    web=web,
                )
                tg.start_soon(publisher.run)
                log.info("agent running", resources=[r.name for r in plan.resources], gpus=len(plan.gpus))
        except MpsAgentError as exc:
            reason = str(exc)
            raise
        except BaseExceptionGroup as group:
            failures = [e for e in _leaves(group) if isinstance(e, MpsAgentError)]
            reason = "; ".join(str(e) for e in failures) if failures else "internal error"
            if failures:
                raise failures[0] from group
            raise
        finally:
            if settings.nfd_features_file is not None and settings.mps_on_exit is MpsOnExit.QUIT and reason == "signal":
                remove_features(settings.nfd_features_file)  # the node no longer offers MPS
            notifier.notify("STOPPING=1", f"STATUS=stopped: {reason}")
            log.info("agent stopped", reason=reason)
