"""The daemon keeper of one resource, for `mpsagent --daemon-host`: keeps its `nvidia-cuda-mps-control` running
outside the agent's container, so that the agent's crash, OOM kill, failed liveness probe or upgrade never takes
the daemon, and with it every CUDA client on the node.

The keeper starts the daemon (capped, as a new daemon is until the agent knows the live grants), records it in
`daemon.json` for the agent to adopt, forwards and rotates its log (the agent, which follows it too, reads the lines
a rotation took before it read them from the copy), and restarts it only when it must: when it exited, or when it
has been hung for `lifecycle.RESTART_AFTER_S` (mps.liveness: its socket greets no connection, for no reason the
keeper can see: a session kept open by someone else, a connection that sends nothing or a debugger never cause a
restart); each restart is logged with its reason. The agent (`--mps-daemon host`) drives the caps; the keeper never
changes them after the start, and opens no front-end session after it, so it never collides with the agent's.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus

from mpsagent.base.backoff import Backoff
from mpsagent.base.errors import ControlRunError, DaemonBusyError, DaemonError
from mpsagent.base.logs import get_logger
from mpsagent.base.values import DEFAULT_PROBE_INTERVAL_S
from mpsagent.domain.plan import ResourcePlan
from mpsagent.mps.commands import daemon_default_steps
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.daemon_log import ROTATE_BYTES, DaemonLog
from mpsagent.mps.launch import CONTROL_LOG, decide_multi_user
from mpsagent.mps.lifecycle import RESTART_BACKOFF_S, DaemonLifecycle
from mpsagent.mps.liveness import Check, busy_episodes
from mpsagent.mps.state import StateFile, daemon_state

log = get_logger(__name__)

# On SIGTERM (the pod is being deleted): clients get this long to finish before the daemon ends them.
QUIT_TIMEOUT_S = 20


class DaemonKeeper:
    def __init__(
        self,
        *,
        resource: ResourcePlan,
        control_bin: str,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        log_rotate_bytes: int = ROTATE_BYTES,
    ) -> None:
        """`log_rotate_bytes`: the size past which the daemon's log is rotated."""
        self._resource = resource
        self._control_bin = control_bin
        self._probe_interval = probe_interval_s
        self._log = log.bind(resource=resource.name)
        self._daemon = DaemonLifecycle(
            resource,
            ControlChannel(control_bin, resource.pipe_directory),
            StateFile(resource.directory),
            self._log,
            control_bin=control_bin,
            probe_interval_s=probe_interval_s,
        )
        self._multi_user = False
        self.restarts = 0
        self._daemon_log = DaemonLog(resource.log_directory / CONTROL_LOG, self._log, rotate_bytes=log_rotate_bytes)
        self._busy = busy_episodes(self._log)

    @property
    def pid(self) -> int | None:
        return self._daemon.pid

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep the daemon running until cancelled; reports started once the first daemon answers. On
        cancellation (the daemon host is stopped) the daemon is asked to quit (its clients get QUIT_TIMEOUT_S to
        finish); any other end leaves it running, for the next `run` to adopt."""
        self._multi_user = await decide_multi_user(self._resource, self._control_bin, self._log)
        daemon = self._daemon
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._daemon_log.run)
                if not await self._adopt():
                    await self._start_with_backoff()
                task_status.started()
                while True:
                    failure = await daemon.wait_for_failure(on_check=self._checked)
                    self.restarts += 1
                    self._log.error(
                        "mps daemon restarting", reason=failure.reason, pid=daemon.pid, restarts=self.restarts
                    )
                    await daemon.end()
                    await self._start_with_backoff()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._quit()
            raise

    def _checked(self, found: Check) -> None:
        """The owner of the record rewrites a damaged one while the daemon answers."""
        if found.answers:
            self._daemon.state_file.retry()

    async def _adopt(self) -> bool:
        """A daemon that already answers with a live recorded PID (left by an earlier keeper or agent) is kept."""
        state = await self._daemon.adopt(restart="the daemon host")
        if state is None:
            return False
        self._daemon_log.attach(state.pid)
        self._log.info("mps daemon adopted", pid=state.pid)
        return True

    async def _start_with_backoff(self) -> None:
        retry = Backoff(*RESTART_BACKOFF_S)
        daemon = self._daemon
        while True:
            try:
                await self._start()
            except DaemonBusyError as exc:
                # Another session keeps the daemon from its first caps: it lives, and is asked again.
                self._busy.failed(str(exc), pid=daemon.pid, retry_in_s=retry.delay)
                await retry.wait(maximum=self._probe_interval)
                continue
            except DaemonError as exc:
                self._log.error("mps daemon start failed", reason=str(exc), retry_in_s=retry.delay)
                if isinstance(exc, ControlRunError) and daemon.process is not None:
                    # The keeper could not ask it (EMFILE, ENOMEM): not the daemon's failure; start it again only
                    # if it is gone by the next try.
                    await retry.wait()
                    if daemon.own_child_runs:
                        continue
                await daemon.end()
                await retry.wait()
                continue
            return

    async def _start(self) -> None:
        daemon = self._daemon
        if not daemon.own_child_runs:
            pid, written = await daemon.launch(multi_user=self._multi_user)
            self._daemon_log.attach(pid, since=written)
        await daemon.wait_answering()
        # Capped until the agent knows the live grants: a client container restarted before the agent is back
        # must not run uncapped (the agent lifts the caps when its ledger allows).
        ceilings = self._resource.shares.unreconciled_ceilings()
        await daemon.channel.apply(daemon_default_steps(ceilings))
        self._busy.works(pid=daemon.pid)
        # Recorded only now: the agent adopts a daemon once its PID is recorded, and must not race these caps.
        earlier = daemon.state_file.read()
        assert daemon.pid is not None
        daemon.state_file.write(
            daemon_state(
                pid=daemon.pid,
                visible_devices=self._resource.visible_devices,
                ceilings=ceilings,
                shares=self._resource.shares,
                multi_user=self._multi_user,
                original_compute_modes=earlier.original_compute_modes if earlier else {},
            )
        )
        self._log.info("mps daemon started", pid=daemon.pid, ceilings=ceilings.describe(), multi_user=self._multi_user)

    async def _quit(self) -> None:
        pid = self._daemon.pid
        if pid is None:
            return
        self._log.warning("mps daemon quitting: its clients end with it", pid=pid, clients_get_s=QUIT_TIMEOUT_S)
        await self._daemon.quit(QUIT_TIMEOUT_S)
        self._log.info("mps daemon quit")
