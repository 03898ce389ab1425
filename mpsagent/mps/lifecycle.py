"""One daemon's life, the same for both of its owners: the agent's daemon supervisor (`daemon`) and the daemon
host's keeper (`keeper`). Started (and waited for until it answers) or adopted from its record, watched until it
fails, ended (killed and reaped, before another is started) or asked to quit. What each owner does around that (the
ceilings, the record's content, the health of the replicas) is its own.

It fails when it exits (noticed at once), or when it is hung: its control socket has greeted no connection for
RESTART_AFTER_S, for no reason the agent can see (`liveness.check`, every probe interval, without a front-end
session). A daemon held by a connection that sends nothing, stopped under a debugger, or one the agent cannot look
into is never restarted: that would end every client of the resource for one process's doing. Each check's
finding goes to the owner as it is made, so that a daemon that does not answer is known within the probe interval
and a second, and one that answers again at once (it is asked every RECHECK_S meanwhile)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import Process
from structlog.typing import FilteringBoundLogger

from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import ControlRunError, DaemonError
from mpsagent.domain.plan import ResourcePlan
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.launch import (
    CONTROL_LOG,
    end_daemon,
    launch_daemon,
    recorded_daemon,
    wait_answering,
    wait_daemon_exit,
)
from mpsagent.mps.liveness import HUNG_AFTER_MISSES, Check, State, check
from mpsagent.mps.state import DaemonState, StateFile

RESTART_BACKOFF_S = (0.5, 30.0)
"""The wait before starting a failed daemon again, growing to the most while starts fail."""
QUIT_GRACE_S = 1.0
"""How long past its quit timeout a quitting daemon gets before it is killed."""
RESTART_AFTER_S = 10.0
"""How long a hung daemon (it greets no connection, and is neither held, debugged nor out of the agent's sight) is
left before it is ended and another started, ending its clients: a daemon stopped for a moment comes back alone."""
RECHECK_S = 0.2
"""How often a daemon that does not answer is asked again (one greeting each time)."""


@dataclass(frozen=True, slots=True)
class DaemonFailure:
    """Why the daemon must be started again: it exited, or it is hung (then it still runs, and is killed)."""

    reason: str
    exited: bool


async def _nothing() -> None:
    await anyio.sleep_forever()


class DaemonLifecycle:
    """The running daemon of one resource, as its owner holds it: its PID, and its process when this process
    started it (an adopted daemon is known by its PID only)."""

    def __init__(
        self,
        resource: ResourcePlan,
        channel: ControlChannel,
        state_file: StateFile,
        log: FilteringBoundLogger,
        *,
        control_bin: str,
        probe_interval_s: float,
    ) -> None:
        self.resource = resource
        self.channel = channel
        self.state_file = state_file
        self.probe_interval_s = probe_interval_s
        self._control_bin = control_bin
        self._log = log
        self.process: Process | None = None
        self.pid: int | None = None
        self._unchecked = FailureEpisodes(
            log,
            failed="mps daemon liveness cannot be checked; the daemon is kept",
            again="mps daemon liveness checked again",
        )

    @property
    def own_child_runs(self) -> bool:
        """A daemon this process started still runs (kept through the owner's own failure to ask it)."""
        return self.process is not None and self.process.returncode is None

    async def adopt(self, *, restart: str) -> DaemonState | None:
        """The recorded state of the daemon that already answers, now this lifecycle's; None when none answers.
        Raises UnrecordedDaemonError when one answers with no live PID recorded (`restart`: what to start again once
        it is stopped)."""
        state = await recorded_daemon(self.resource, self.channel, self.state_file, restart=restart)
        if state is not None:
            self.process, self.pid = None, state.pid
        return state

    async def launch(self, *, multi_user: bool) -> tuple[int, int]:
        """Start a daemon (not yet waited for); its PID, and the offset of its log where its lines begin."""
        self.process, written = await launch_daemon(self.resource, self._control_bin, multi_user=multi_user)
        self.pid = self.process.pid
        return self.pid, written

    async def wait_answering(self) -> None:
        """Wait until the daemon this process started answers; raises DaemonError when it does not."""
        assert self.process is not None
        await wait_answering(self.process, self.resource, self.channel)

    async def wait_for_failure(
        self,
        *,
        beside: Callable[[], Coroutine[Any, Any, None]] = _nothing,
        on_check: Callable[[Check], None] = lambda found: None,
    ) -> DaemonFailure:
        """Return when the daemon exits or is hung; meanwhile `beside` runs (the owner's own rounds), and
        `on_check` after each liveness check with what it found. The owner's own failure to check (out of
        descriptors) says nothing about the daemon: it is reported, and the daemon kept."""
        failure: DaemonFailure | None = None
        async with anyio.create_task_group() as tg:

            async def exited() -> None:
                nonlocal failure
                failure = DaemonFailure(await self._exit_reason(), exited=True)
                tg.cancel_scope.cancel()

            async def hung() -> None:
                nonlocal failure
                failure = DaemonFailure(await self._hung_reason(on_check), exited=False)
                tg.cancel_scope.cancel()

            tg.start_soon(exited)
            tg.start_soon(hung)
            tg.start_soon(beside)
        assert failure is not None
        return failure

    async def _exit_reason(self) -> str:
        assert self.pid is not None
        code = await wait_daemon_exit(self.process, self.pid)
        if self.process is None:
            return "the adopted daemon exited"
        return f"it exited with status {code}; see {self.resource.log_directory / CONTROL_LOG}"

    async def _hung_reason(self, on_check: Callable[[Check], None]) -> str:
        assert self.pid is not None
        silent_since: float | None = None
        """Since when (monotonic) the daemon greets nothing, whatever the reason; None while it answers."""
        hung_since: float | None = None
        """Since when it is hung (it greets nothing, for no reason the agent can see)."""
        while True:
            await anyio.sleep(self.probe_interval_s if silent_since is None else RECHECK_S)
            try:
                found = await check(
                    self.resource.pipe_directory, self.pid, misses=HUNG_AFTER_MISSES if silent_since is None else 1
                )
            except ControlRunError as exc:
                self._unchecked.failed(str(exc))
                continue
            self._unchecked.works()
            if found.state is State.GONE:
                return found.reason
            on_check(found)
            now = anyio.current_time()
            silent_since = None if found.answers else (silent_since if silent_since is not None else now)
            hung_since = None if found.state is not State.HUNG else (hung_since if hung_since is not None else now)
            if hung_since is not None and now - hung_since >= RESTART_AFTER_S:
                return f"{found.reason}, for {RESTART_AFTER_S:g}s"

    async def end(self) -> None:
        """Kill a failed daemon (and reap it when it is this process's) before another is started."""
        await end_daemon(self.process, self.pid)
        self.process, self.pid = None, None

    async def quit(self, timeout_s: int) -> None:
        """Ask the daemon to quit (its clients get `timeout_s` to finish), end it when it has not by then, and
        remove its record."""
        if self.pid is not None:
            try:
                await self.channel.quit(timeout_s)
            except DaemonError as exc:
                self._log.warning("mps daemon did not take quit; it is ended", pid=self.pid, reason=str(exc))
            with anyio.move_on_after(timeout_s + QUIT_GRACE_S):
                if self.process is not None:
                    await self.process.wait()
                else:
                    await wait_daemon_exit(None, self.pid)
        await self.end()
        self.state_file.remove()
