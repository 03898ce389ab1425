"""`mpsagent --daemon-host`: runs only the MPS control daemons of the configured resources, one keeper each, for
an agent started with `--mps-daemon host` in another container (or DaemonSet), so that the daemons and their CUDA
clients outlive the agent's container. One task group owns the keepers; SIGTERM, SIGINT or SIGHUP (the pod is
being deleted) quits the daemons."""

from __future__ import annotations

import signal
from contextlib import ExitStack

import anyio

from mpsagent.config import Settings
from mpsagent.logs import get_logger
from mpsagent.mps.keeper import DaemonKeeper
from mpsagent.mps.paths import DAEMON_OWNER_LOCK_FILE, ResourceLock, prepare_directories
from mpsagent.plan import NodePlan

log = get_logger("mpsagent.daemon_host")


async def _watch_signals(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("stopping", reason=signal.Signals(signum).name)
            scope.cancel()
            return


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
        keepers = [DaemonKeeper(resource=r, control_bin=settings.mps_control_bin) for r in plan.resources]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_signals, tg.cancel_scope)
                for keeper in keepers:
                    await tg.start(keeper.run)
                log.info(
                    "daemon host running",
                    resources=[r.name for r in plan.resources],
                    pids=[keeper.pid for keeper in keepers],
                )
        except BaseException as exc:
            reason = str(exc) or type(exc).__name__
            raise
        finally:
            log.info("daemon host stopped", reason=reason)
