"""The daemon keeper of one resource, for `mpsagent --daemon-host`: keeps its `nvidia-cuda-mps-control` running
outside the agent's container, so that the agent's crash, OOM kill, failed liveness probe or upgrade never takes
the daemon, and with it every CUDA client on the node.

The keeper starts the daemon (capped, as a new daemon is until the agent knows the live grants), records it in
`daemon.json` for the agent to adopt, forwards its log, and restarts it only when it must: when it exited, or
when it is hung (mps.liveness: its socket greets no connection, which a session kept open by someone else never
causes); each restart is logged with its reason. The agent (`--mps-daemon host`) drives the caps; the keeper never
changes them after the start, and opens no front-end session after it, so it never collides with the agent's.
"""

from __future__ import annotations

import contextlib

import anyio
from anyio.abc import Process, TaskStatus

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import ControlRunError, DaemonBusyError, DaemonError
from mpsagent.base.logs import get_logger
from mpsagent.base.values import DEFAULT_PROBE_INTERVAL_S
from mpsagent.domain.plan import ResourcePlan
from mpsagent.mps.commands import daemon_default_steps
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.daemon_log import DaemonLog
from mpsagent.mps.launch import (
    CONTROL_LOG,
    decide_multi_user,
    end_daemon,
    launch_daemon,
    recorded_daemon,
    wait_answering,
    wait_daemon_exit,
)
from mpsagent.mps.liveness import busy_episodes, hung_reason
from mpsagent.mps.state import StateFile, daemon_state

log = get_logger(__name__)

RESTART_BACKOFF_INITIAL_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
# On SIGTERM (the pod is being deleted): clients get this long to finish before the daemon ends them.
QUIT_TIMEOUT_S = 20


class DaemonKeeper:
    def __init__(
        self, *, resource: ResourcePlan, control_bin: str, probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S
    ) -> None:
        self._resource = resource
        self._control_bin = control_bin
        self._probe_interval = probe_interval_s
        self._channel = ControlChannel(control_bin, resource.pipe_directory)
        self._state_file = StateFile(resource.directory)
        self._multi_user = False
        self._process: Process | None = None
        self._pid: int | None = None
        self.restarts = 0
        self._log = log.bind(resource=resource.name)
        self._daemon_log = DaemonLog(resource.log_directory / CONTROL_LOG, self._log)
        self._busy = busy_episodes(self._log)

    @property
    def pid(self) -> int | None:
        return self._pid

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep the daemon running until cancelled; reports started once the first daemon answers. On
        cancellation (the daemon host is stopped) the daemon is asked to quit (its clients get QUIT_TIMEOUT_S to
        finish); any other end leaves it running, for the next `run` to adopt."""
        self._multi_user = await decide_multi_user(self._resource, self._control_bin, self._log)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._daemon_log.run)
                if not await self._adopt():
                    await self._start_with_backoff()
                task_status.started()
                while True:
                    reason = await self._wait_for_failure()
                    self.restarts += 1
                    self._log.error("mps daemon restarting", reason=reason, pid=self._pid, restarts=self.restarts)
                    await self._end_daemon()
                    await self._start_with_backoff()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._quit()
            raise

    async def _adopt(self) -> bool:
        """A daemon that already answers with a live recorded PID (left by an earlier keeper or agent) is kept."""
        state = await recorded_daemon(self._resource, self._channel, self._state_file, restart="the daemon host")
        if state is None:
            return False
        self._pid = state.pid
        self._daemon_log.attach(state.pid)
        self._log.info("mps daemon adopted", pid=state.pid)
        return True

    async def _start_with_backoff(self) -> None:
        retry = Backoff(RESTART_BACKOFF_INITIAL_S, RESTART_BACKOFF_MAX_S)
        while True:
            try:
                await self._start()
            except DaemonBusyError as exc:
                # Another session keeps the daemon from its first caps: it lives, and is asked again.
                self._busy.failed(str(exc), pid=self._pid, retry_in_s=retry.delay)
                await retry.wait(maximum=self._probe_interval)
                continue
            except DaemonError as exc:
                self._log.error("mps daemon start failed", reason=str(exc), retry_in_s=retry.delay)
                if isinstance(exc, ControlRunError) and self._process is not None:
                    # The keeper could not ask it (EMFILE, ENOMEM): not the daemon's failure; start it again only
                    # if it is gone by the next try.
                    await retry.wait()
                    if self._process.returncode is None:
                        continue
                await self._end_daemon()
                await retry.wait()
                continue
            return

    async def _start(self) -> None:
        if self._process is None or self._process.returncode is not None:
            self._process, written = await launch_daemon(self._resource, self._control_bin, multi_user=self._multi_user)
            self._daemon_log.attach(self._process.pid, since=written)
        self._pid = self._process.pid
        await wait_answering(self._process, self._resource, self._channel)
        # Capped until the agent knows the live grants: a client container restarted before the agent is back
        # must not run uncapped (the agent lifts the caps when its ledger allows).
        ceilings = self._resource.shares.unreconciled_ceilings()
        await self._channel.apply(daemon_default_steps(ceilings))
        self._busy.works(pid=self._pid)
        # Recorded only now: the agent adopts a daemon once its PID is recorded, and must not race these caps.
        earlier = self._state_file.read()
        self._state_file.write(
            daemon_state(
                pid=self._pid,
                visible_devices=self._resource.visible_devices,
                ceilings=ceilings,
                shares=self._resource.shares,
                multi_user=self._multi_user,
                original_compute_modes=earlier.original_compute_modes if earlier else {},
            )
        )
        self._log.info("mps daemon started", pid=self._pid, ceilings=ceilings.describe(), multi_user=self._multi_user)

    async def _wait_for_failure(self) -> str:
        """Why the daemon must be restarted: it exited (noticed at once), or it is hung."""
        reason = ""
        async with anyio.create_task_group() as tg:

            async def exited() -> None:
                nonlocal reason
                reason = await self._wait_exit()
                tg.cancel_scope.cancel()

            async def hung() -> None:
                nonlocal reason
                reason = await self._watch_liveness()
                tg.cancel_scope.cancel()

            tg.start_soon(exited)
            tg.start_soon(hung)
        return reason

    async def _watch_liveness(self) -> str:
        """Why the daemon counts as hung, once it does: checked every probe interval (mps.liveness), without a
        front-end session. The keeper's own failure to check (out of descriptors) says nothing about the daemon."""
        assert self._pid is not None
        unchecked = FailureEpisodes(
            self._log,
            failed="mps daemon liveness cannot be checked; the daemon is kept",
            again="mps daemon liveness checked again",
        )
        while True:
            await anyio.sleep(self._probe_interval)
            try:
                reason = await hung_reason(self._resource.pipe_directory, self._pid)
            except ControlRunError as exc:
                unchecked.failed(str(exc))
                continue
            unchecked.works()
            if reason is not None:
                return reason
            self._state_file.retry()

    async def _wait_exit(self) -> str:
        assert self._pid is not None
        code = await wait_daemon_exit(self._process, self._pid)
        if self._process is None:
            return "the adopted daemon exited"
        return f"it exited with status {code}; see {self._resource.log_directory / CONTROL_LOG}"

    async def _end_daemon(self) -> None:
        """A failed daemon is killed (and reaped when it is ours) before another is started."""
        await end_daemon(self._process, self._pid)
        self._process = None
        self._pid = None

    async def _quit(self) -> None:
        if self._pid is None:
            return
        self._log.warning("mps daemon quitting: its clients end with it", pid=self._pid, clients_get_s=QUIT_TIMEOUT_S)
        with contextlib.suppress(DaemonError):
            await self._channel.quit(QUIT_TIMEOUT_S)
        with anyio.move_on_after(QUIT_TIMEOUT_S + 2):
            if self._process is not None:
                await self._process.wait()
            else:
                await self._wait_exit()
        await self._end_daemon()
        self._state_file.remove()
        self._log.info("mps daemon quit")
