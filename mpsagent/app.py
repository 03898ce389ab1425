"""The supervisor: one task group owns every long-lived task of the agent.

Start order per resource: lock, directories, MPS daemon (up and holding its defaults), plugin endpoint. Any
task's failure, or SIGTERM or SIGINT, cancels the group; each task cleans up in its own `finally` within a
bounded time. The last log line names the stop reason.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack

import anyio
from anyio.abc import TaskGroup

from mpsagent.allocation import Allocation, ResourceAllocator
from mpsagent.config import Settings
from mpsagent.devices import gpu_of
from mpsagent.errors import MpsAgentError
from mpsagent.gpu.port import GpuSource
from mpsagent.inventory import Inventory
from mpsagent.kubelet.plugin import PluginEndpoint
from mpsagent.kubelet.servicer import DevicePluginServicer
from mpsagent.logs import get_logger
from mpsagent.mps.daemon import DaemonSupervisor
from mpsagent.mps.paths import ResourceLock, prepare_directories
from mpsagent.plan import NodePlan, ResourcePlan

log = get_logger("mpsagent.app")


class _Stop(Exception):
    """Raised inside the task group to stop the agent with a reason."""


def _after_allocate(
    resource: ResourcePlan, allocator: ResourceAllocator, daemon: DaemonSupervisor
) -> Callable[[Sequence[Allocation]], Awaitable[None]]:
    async def after_allocate(allocations: Sequence[Allocation]) -> None:
        for allocation in allocations:
            grant = allocation.record.grant
            log.info(
                "granted",
                resource=resource.name,
                grant=grant.grant_id,
                kind=grant.kind.value,
                replicas=len(grant.replica_ids),
                gpus=sorted({gpu_of(r) for r in grant.replica_ids}),
            )
            for ended in allocation.record.ended:
                log.warning(
                    "replicas granted again while believed live",
                    resource=resource.name,
                    grant=grant.grant_id,
                    earlier_grant=ended.grant_id,
                    replicas=len(set(ended.replica_ids) & set(grant.replica_ids)),
                )
        await daemon.set_mode(allocator.daemon_mode())

    return after_allocate


def _before_start(allocator: ResourceAllocator, daemon: DaemonSupervisor) -> Callable[[Sequence[str]], Awaitable[None]]:
    async def before_start(replica_ids: Sequence[str]) -> None:
        await daemon.set_mode(allocator.mode_for_grant(replica_ids))

    return before_start


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


async def _watch_signals(task_group: TaskGroup) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("stopping", reason=signal.Signals(signum).name)
            task_group.cancel_scope.cancel()
            return


async def run_agent(settings: Settings, plan: NodePlan, gpu_source: GpuSource) -> None:
    """Run until a signal or a failure; raises MpsAgentError for a failure the operator must see."""
    reason = "signal"
    with ExitStack() as locks:
        prepare_directories(plan)
        for resource in plan.resources:
            locks.enter_context(ResourceLock(resource))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_signals, tg)
                for resource in plan.resources:
                    inventory = Inventory(resource)
                    allocator = ResourceAllocator(resource, plan.shm_directory)
                    daemon = DaemonSupervisor(
                        resource=resource,
                        inventory=inventory,
                        gpu_source=gpu_source,
                        control_bin=settings.mps_control_bin,
                        on_exit=settings.mps_on_exit,
                        initial_mode=allocator.daemon_mode(),
                    )
                    await tg.start(daemon.run)
                    servicer = DevicePluginServicer(
                        allocator,
                        inventory,
                        pre_start_required=resource.enforce_caps,
                        after_allocate=_after_allocate(resource, allocator, daemon),
                        before_start=_before_start(allocator, daemon),
                    )
                    endpoint = PluginEndpoint(
                        resource_name=resource.name,
                        servicer=servicer,
                        kubelet_socket=settings.kubelet_socket,
                        pre_start_required=resource.enforce_caps,
                    )
                    await tg.start(endpoint.run)
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
            log.info("agent stopped", reason=reason)
