"""`mpsagent --daemon-host`: runs only the MPS control daemons of the configured resources, one keeper each, for
an agent started with `--mps-daemon host` in another container (or DaemonSet), so that the daemons and their CUDA
clients outlive the agent's container. One task group owns the keepers; SIGTERM, SIGINT or SIGHUP (the pod is
being deleted) quits the daemons."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from functools import partial

import anyio
from anyio.abc import TaskStatus

from mpsagent.base.errors import MpsAgentError, agent_errors
from mpsagent.base.logs import get_logger
from mpsagent.base.settings import Settings
from mpsagent.domain.plan import NodePlan
from mpsagent.mps.discovery import record_answering_daemon
from mpsagent.mps.keeper import DaemonKeeper
from mpsagent.mps.paths import DAEMON_OWNER_LOCK_FILE, ResourceLock, prepare_directories
from mpsagent.supervisor.stop_signals import wait_stop_signal

log = get_logger("mpsagent.daemon_host")

KEEPER_RETRY_S = 1.0


async def _watch_signals(scope: anyio.CancelScope) -> None:
    log.info("stopping", reason=(await wait_stop_signal()).name)
    scope.cancel()


class _StartedOnce(TaskStatus[None]):
    """Passes the first `started()` on to the task's owner; a keeper run again reports started again."""

    def __init__(self, owner: TaskStatus[None]) -> None:
        self._owner = owner
        self.reported = False

    def started(self, value: None = None) -> None:
        if not self.reported:
            self.reported = True
            self._owner.started()


async def _keep(
    keeper: DaemonKeeper,
    record_found_daemon: Callable[[], Awaitable[None]],
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a keeper for good. A failure before its daemon first answers stops the daemon host (a broken install
    must be loud); after that, the daemon host is the container's first process, and its exit would end every
    daemon and client with the container: a keeper that fails is logged and run again, adopting its daemon. Each
    run first calls `record_found_daemon`, which records again a daemon that answers without a live PID in
    `daemon.json` (a damaged record)."""
    status = _StartedOnce(task_status)
    while True:
        try:
            await record_found_daemon()
            await keeper.run(task_status=status)
        except MpsAgentError as exc:
            if not status.reported:
                raise
            log.error("daemon keeper failed; the daemon is kept", pid=keeper.pid, reason=str(exc))  # noqa: TRY400
        except Exception:
            if not status.reported:
                raise
            log.exception("daemon keeper failed unexpectedly; the daemon is kept", pid=keeper.pid)
        await anyio.sleep(KEEPER_RETRY_S)


async def run_daemon_host(settings: Settings, plan: NodePlan) -> None:
    """Keep every resource's daemon running until a signal; raises MpsAgentError when a daemon cannot be kept."""
    reason = "signal"
    with ExitStack() as locks:
        prepare_directories(plan)
        for resource in plan.resources:
            locks.enter_context(
                ResourceLock(
                    resource,
                    file_name=DAEMON_OWNER_LOCK_FILE,
                    role="already runs the MPS daemon of",
                    hint="one daemon owner per resource: an agent started with --mps-daemon host, and one daemon host",
                )
            )
        keepers = [
            DaemonKeeper(resource=r, control_bin=settings.mps_control_bin, probe_interval_s=settings.probe_interval_s)
            for r in plan.resources
        ]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_signals, tg.cancel_scope)
                for keeper, resource in zip(keepers, plan.resources, strict=True):
                    record = partial(record_answering_daemon, resource, settings.mps_control_bin, settings.proc_root)
                    await tg.start(_keep, keeper, record)
                log.info(
                    "daemon host running",
                    resources=[r.name for r in plan.resources],
                    pids=[keeper.pid for keeper in keepers],
                )
        except BaseExceptionGroup as group:
            failures = agent_errors(group)
            reason = "; ".join(str(e) for e in failures) if failures else "internal error"
            if failures:
                raise failures[0] from group  # one line, as the agent's own failures are
            raise
        except BaseException as exc:
            reason = str(exc) or type(exc).__name__
            raise
        finally:
            log.info("daemon host stopped", reason=reason)
