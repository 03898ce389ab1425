"""The daemon supervisor of one resource: starts or adopts its `nvidia-cuda-mps-control`, holds the ceilings the
ledger's live grants need (see mpsagent.domain.shares), watches it, restarts it with backoff, and forwards and
rotates its log.

The daemon runs in its own session with its output in `<resource>/log/control.log`, so an agent restart or crash
never takes it (or its CUDA clients) down; the next agent adopts it. With `--mps-daemon host` the daemon host
(`mps.keeper`) starts and restarts the daemon instead, and this supervisor only adopts and drives it: it never
starts, kills or quits one.

Someone with the control socket (every client container has it) can change the ceilings. The supervisor follows
the daemon's own log of every control command (`daemon_log`, judged by `ceiling_watch`) and restores a ceiling
changed behind the agent, by any amount, within a second; every liveness round also reads the daemon's values back:
the backstop for what the log cannot show, in whole GiB (`get_*` prints them so). Someone with the control socket
can also hold it (a session left open, a connection that sends nothing): the hold watch (`hold_watch`) ends such a
connection from a pod once it has held the daemon for `--control-hold-seconds`, and every ceiling is then set again.

A daemon that greets no connection makes the resource's replicas Unhealthy (and its DRA devices tainted) from the
check that finds it, within the probe interval and a second, until it answers again; it is restarted only when it
stays hung (`lifecycle.RESTART_AFTER_S`), never when a connection holds it. A round the agent cannot even run
(it cannot start the front-end: EMFILE, ENOMEM, a missing binary) says nothing about the daemon: it is reported and
retried with backoff, and the daemon is kept, never killed for the agent's own failure.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import anyio
from anyio.abc import TaskStatus
from structlog.typing import FilteringBoundLogger

from mpsagent.base.backoff import Backoff
from mpsagent.base.clock import utc
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import (
    ControlRunError,
    DaemonBusyError,
    DaemonCommandError,
    DaemonError,
    UnrecordedDaemonError,
)
from mpsagent.base.logs import get_logger
from mpsagent.base.values import DEFAULT_CONTROL_HOLD_S, DEFAULT_PROBE_INTERVAL_S, MpsDaemonOwner, MpsOnExit
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import ResourcePlan
from mpsagent.domain.shares import Ceilings
from mpsagent.gpu.port import GpuSource
from mpsagent.mps.ceiling_guard import CeilingGuard
from mpsagent.mps.commands import (
    CapDifference,
    cap_differences,
    daemon_default_steps,
    running_server_commands,
    running_server_steps,
)
from mpsagent.mps.compute_mode import ComputeModes
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.daemon_log import ROTATE_BYTES
from mpsagent.mps.daemon_status import (
    CeilingsStatus,
    DaemonBusy,
    DaemonStatus,
    DaemonUnresponsive,
    FrontEndFailure,
    HoldEnded,
    RecordDamage,
    ceiling_mode,
)
from mpsagent.mps.hold_watch import HoldWatch, OnEnded
from mpsagent.mps.launch import CONTROL_LOG, decide_multi_user
from mpsagent.mps.lifecycle import RESTART_BACKOFF_S, DaemonLifecycle
from mpsagent.mps.liveness import Check, State, busy_episodes
from mpsagent.mps.state import StateFile, daemon_state, recorded_ceilings

log = get_logger(__name__)

HOST_WAIT_MAX_S = 5.0
FRONT_END_BACKOFF_MAX_S = 30.0
FRONT_END_HINT = (
    "the agent could not start a process: raise its open-file limit (LimitNOFILE in the systemd unit, the "
    "container runtime's nofile ulimit), check its memory limit and --mps-control-bin; the daemon and its clients "
    "are not affected, but cap switches fail until it can"
)
QUIT_TIMEOUT_S = 5
HEALTH_SOURCE = "mps daemon"


def front_end_episodes(log: FilteringBoundLogger) -> FailureEpisodes:
    """The episodes in which the agent cannot run the control front-end (its own failure, not the daemon's), each
    reported once: an error as it begins, retries at debug level, and an info line with how long it lasted."""
    return FailureEpisodes(
        log,
        failed="mps control front-end cannot run; the daemon is kept",
        still="mps control front-end still cannot run",
        again="mps control front-end runs again",
        hint=FRONT_END_HINT,
        lasted_key="failed_for_s",
    )


class DaemonSupervisor:
    """The daemon of one resource, started or adopted and kept holding the ceilings. Until `want_ceilings` says what
    the live grants need, a daemon starts at the ceilings for unknown grants (ShareModel.unreconciled_ceilings), and
    an adopted one keeps its own."""

    def __init__(
        self,
        *,
        resource: ResourcePlan,
        inventory: Inventory,
        gpu_source: GpuSource,
        control_bin: str,
        on_exit: MpsOnExit,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        owner: MpsDaemonOwner = MpsDaemonOwner.AGENT,
        control_hold_s: float = DEFAULT_CONTROL_HOLD_S,
        on_hold_ended: OnEnded = lambda ended: None,
        log_rotate_bytes: int = ROTATE_BYTES,
    ) -> None:
        """`control_hold_s`: how long a process in a pod may hold the control socket (0: never ended);
        `on_hold_ended`: told of each connection the hold watch ended (the pod's event, where the API server is
        reachable); `log_rotate_bytes`: the size past which the daemon's log is rotated, when the agent owns the
        daemon (else the daemon host rotates it)."""
        self._resource = resource
        self._inventory = inventory
        self._control_bin = control_bin
        self._on_exit = on_exit
        self._probe_interval = probe_interval_s
        self._owns_daemon = owner is MpsDaemonOwner.AGENT
        self._wanted = resource.shares.unreconciled_ceilings()
        self._ceilings_known = False
        self._held: Ceilings | None = None
        self._up = False
        self._multi_user = False
        """Whether a daemon this agent starts gets `-M` (decided once, from the config and the binary)."""
        self._running_multi_user: bool | None = None
        """Whether the running daemon has `-M`; None: an adopted daemon whose agent did not record it."""
        self._ceilings_lock = anyio.Lock()
        self.restarts = 0
        self.restart_attempts = 0
        """Daemons started after a failure, each attempt counted (a daemon that keeps failing keeps counting)."""
        self._wake = anyio.Event()
        self._restore_all = False
        """A round must set every ceiling again, whatever it reads back (a held session was ended)."""
        self._unresponsive: tuple[float, str] | None = None
        """Since when (wall clock) and why the daemon greets no connection; None while it answers."""
        self._silently_held = False
        """The last liveness check found the daemon held by a connection that sends nothing: the rounds wait."""
        self._log = log.bind(resource=resource.name)
        self._on_hold_ended = on_hold_ended
        self._guard, self._holds, self._daemon = self._control(control_hold_s, log_rotate_bytes)
        self._compute_modes = ComputeModes(gpu_source, [gpu.uuid for gpu in resource.gpus], self._log)
        self._busy = busy_episodes(self._log)
        self._front_end = front_end_episodes(self._log)

    def _control(self, control_hold_s: float, log_rotate_bytes: int) -> tuple[CeilingGuard, HoldWatch, DaemonLifecycle]:
        """The daemon's lifecycle over one control channel, and the two watches of its control socket wired to
        that channel and to each other: the ceiling guard (the channel tells it what the agent sent; it wakes the
        hold watch when the daemon's log shows a new connection) and the hold watch (woken too by a session the
        channel was refused)."""
        resource = self._resource
        guard = CeilingGuard(
            log_path=resource.log_directory / CONTROL_LOG,
            gpus=resource.shares.gpus,
            log=self._log,
            forward=self._owns_daemon,
            rotate_bytes=log_rotate_bytes if self._owns_daemon else None,
            wanted=lambda: self._wanted,
            wake=self._wake_round,
            on_connection=lambda: holds.look_soon(),  # noqa: PLW0108 (the watch is built below)
        )
        channel = ControlChannel(
            self._control_bin,
            resource.pipe_directory,
            sent=guard.sent,
            on_refused=lambda: holds.look_soon(),  # noqa: PLW0108 (the watch is built below, over this channel)
        )
        holds = HoldWatch(
            channel=channel,
            pipe_directory=resource.pipe_directory,
            bound_s=control_hold_s,
            probe_interval_s=self._probe_interval,
            log=self._log,
            on_ended=self._hold_ended,
        )
        daemon = DaemonLifecycle(
            resource,
            channel,
            StateFile(resource.directory),
            self._log,
            control_bin=self._control_bin,
            probe_interval_s=self._probe_interval,
        )
        return guard, holds, daemon

    @property
    def ceilings(self) -> Ceilings | None:
        """The ceilings the daemon is known to hold; None while they are being set, or after a change failed."""
        return self._held

    def status(self) -> DaemonStatus:
        """What is known about the daemon now: the snapshot the status document embeds and the metrics read."""
        failure, busy = self._front_end.current, self._busy.current
        damage = self._daemon.state_file.damage
        return DaemonStatus(
            pid=self._daemon.pid,
            up=self._up,
            cap_mode=ceiling_mode(self._held, self._resource.shares.full_hardware()),
            ceilings=CeilingsStatus.of(self._held),
            restarts=self.restarts,
            restart_attempts=self.restart_attempts,
            multi_user=self._running_multi_user,
            cap_tamper=self._guard.count,
            cap_tamper_in_log=self._guard.in_log,
            last_cap_tamper=self._guard.last_event(),
            control_log=self._guard.status(),
            front_end_failure=None if failure is None else FrontEndFailure(at=utc(failure[0]), reason=failure[1]),
            record_damage=None
            if damage is None
            else RecordDamage(at=utc(damage[0]), path=str(self._daemon.state_file.path), problem=damage[1]),
            busy=None if busy is None else DaemonBusy(at=utc(busy[0]), reason=busy[1]),
            busy_episodes=self._busy.episodes,
            unresponsive=None
            if self._unresponsive is None
            else DaemonUnresponsive(at=utc(self._unresponsive[0]), reason=self._unresponsive[1]),
            control_holders=self._holds.holders(),
            control_holds_ended=self._holds.ended,
            last_control_hold_ended=self._holds.last_ended,
            control_holders_unseen=self._holds.unseen,
        )

    # --- ceilings -------------------------------------------------------------------------------------------

    def want_ceilings(self, ceilings: Ceilings) -> None:
        """The ceilings the live grants need, known before the daemon runs: it starts (or keeps an adopted daemon)
        at these instead of the safe ones for unknown grants. Applies nothing itself."""
        self._wanted = ceilings
        self._ceilings_known = True

    async def set_ceilings(self, ceilings: Ceilings, *, verify: bool = False) -> None:
        """Make the daemon hold `ceilings` (defaults and running servers); raises DaemonError when it cannot.

        `verify`: read the daemon's real values even when it is believed to hold them, and restore (and report)
        any that changed behind the agent; a PreStartContainer must not trust cached ceilings.
        """
        self._wanted = ceilings
        self._ceilings_known = True
        if self._held == ceilings and not verify:
            return
        if self._daemon.pid is None:
            raise DaemonError(f"the MPS daemon of {self._resource.name} is not running")
        if self._unresponsive is not None:
            since, reason = self._unresponsive
            raise DaemonError(f"the MPS daemon of {self._resource.name} does not answer ({reason}; since {utc(since)})")
        await self._hold(verify=verify)

    async def _hold(self, *, verify: bool = False, restore: bool = False) -> None:
        """Bring the daemon to the latest wanted ceilings; concurrent callers queue, the last wish wins. A daemon
        that another session keeps busy raises DaemonBusyError (reported once per episode). `restore`: set every
        ceiling again, whatever the read-back shows (a change within a GiB reads back the same)."""
        async with self._ceilings_lock:
            if restore:
                self._held = None
            try:
                await self._hold_wanted(verify=verify)
            except DaemonBusyError as exc:
                self._busy.failed(str(exc), pid=self._daemon.pid)
                raise

    async def _hold_wanted(self, *, verify: bool) -> None:
        ceilings, known = self._wanted, self._held
        if known == ceilings:
            if not verify:
                return
            differences = await self._differences(ceilings)
            self._busy.works(pid=self._daemon.pid)
            if not differences:
                return
            self._guard.read_back(ceilings, differences)
            known = None
        self._held = None
        steps = daemon_default_steps(ceilings)
        try:
            servers = await self._daemon.channel.apply_with_servers(steps)
        except DaemonBusyError:
            self._held = known  # refused before anything was sent: the daemon holds what it held
            raise
        self._busy.works(pid=self._daemon.pid)
        if servers:
            await self._daemon.channel.send_all(
                [command for server in servers for command in running_server_commands(ceilings, server)]
            )
        self._held = ceilings
        self._save_state()
        self._log.info("mps daemon caps set", ceilings=ceilings.describe(), pid=self._daemon.pid)

    async def _hold_through_busy(self) -> None:
        """`_hold`, asked again with backoff while another session keeps the daemon busy: a busy daemon is neither
        killed nor given up on."""
        retry = Backoff(RESTART_BACKOFF_S[0], self._probe_interval)
        while True:
            try:
                await self._hold()
            except DaemonBusyError:
                await retry.wait()
                continue
            return

    async def _differences(self, ceilings: Ceilings) -> tuple[CapDifference, ...]:
        """The daemon's defaults and running servers' values that differ from the ceilings: one front-end session,
        and one more when servers run."""
        defaults = daemon_default_steps(ceilings)
        default_values, servers = await self._daemon.channel.read_with_servers([step.read_back for step in defaults])
        per_server = [running_server_steps(ceilings, server) for server in servers]
        server_values = (
            await self._daemon.channel.read([step.read_back for steps in per_server for step in steps])
            if servers
            else []
        )
        return cap_differences(defaults, default_values, per_server, server_values)

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the daemon until cancelled; reports started once the daemon holds its defaults."""
        await self._compute_modes.take(self._recorded_compute_modes)
        if self._owns_daemon:
            self._multi_user = await decide_multi_user(self._resource, self._control_bin, self._log)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._guard.run)
                tg.start_soon(self._holds.run)
                if self._owns_daemon:
                    await self._bring_up(first=True)
                    task_status.started()
                else:
                    # Waiting for the daemon host is normal at start: serve, with the replicas unhealthy until then.
                    # (The daemon host forwards the daemon's log.)
                    self._inventory.set_resource_problem(HEALTH_SOURCE, True, "its MPS daemon is not up yet")
                    task_status.started()
                    await self._adopt_from_host()
                while True:
                    failure = await self._daemon.wait_for_failure(beside=self._watch_rounds, on_check=self._checked)
                    if failure.exited:
                        self._log.error("mps daemon exited", pid=self._daemon.pid, reason=failure.reason)
                    else:
                        self._log.error("mps daemon hung; it is ended", pid=self._daemon.pid, reason=failure.reason)
                    self._unresponsive = None
                    self._guard.detach()
                    self._holds.detach()
                    self._inventory.set_resource_problem(HEALTH_SOURCE, True, "its MPS daemon is down")
                    self._held = None
                    self._up = False
                    self._log.error("mps daemon down; replicas unhealthy", pid=self._daemon.pid)
                    self.restarts += 1
                    if self._owns_daemon:
                        await self._daemon.end()
                        await self._bring_up(first=False)
                    else:
                        self._daemon.pid = None
                        await self._adopt_from_host()
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop()

    async def _bring_up(self, *, first: bool) -> None:
        retry = Backoff(*RESTART_BACKOFF_S)
        while True:
            try:
                if first and await self._adopt():
                    pass
                elif self._daemon.own_child_runs:
                    await self._wait_answering()  # ours, kept through the agent's own failure to ask it
                else:
                    if not first:
                        self.restart_attempts += 1
                    await self._start()
                await self._hold_through_busy()
            except DaemonError as exc:
                if first and self._daemon.process is not None:
                    await self._daemon.end()
                if first:
                    raise  # a daemon that cannot start, or hold its defaults, at start-up is a loud failure
                self._log.error("mps daemon start failed", reason=str(exc), retry_in_s=retry.delay)
                if not isinstance(exc, ControlRunError):
                    await self._daemon.end()
                await retry.wait()
                continue
            self._up = True
            self._inventory.set_resource_problem(HEALTH_SOURCE, False)
            self._log.info("mps daemon healthy", pid=self._daemon.pid, ceilings=self._wanted.describe())
            return

    async def _adopt_from_host(self) -> None:
        """Wait until the daemon host's daemon answers, adopt it and make it hold the wanted ceilings."""
        retry = Backoff(RESTART_BACKOFF_S[0], HOST_WAIT_MAX_S)
        waiting = FailureEpisodes(
            self._log,
            failed="waiting for the mps daemon host",
            level="warning",
            again=None,
            hint="the daemon host (mpsagent --daemon-host, the mpsagent-mps-daemon DaemonSet) starts it",
        )
        while True:
            try:
                if await self._adopt():
                    await self._hold_through_busy()
                    self._up = True
                    self._inventory.set_resource_problem(HEALTH_SOURCE, False)
                    self._log.info("mps daemon healthy", pid=self._daemon.pid, ceilings=self._wanted.describe())
                    return
                reason = f"no MPS daemon with a live PID answers on {self._resource.pipe_directory}"
            except DaemonError as exc:
                reason = str(exc)
            waiting.failed(reason)
            await retry.wait()

    async def _adopt(self) -> bool:
        try:
            state = await self._daemon.adopt(restart="the agent")
        except UnrecordedDaemonError:
            if self._owns_daemon:
                raise
            return False  # the daemon host records a daemon once it holds its first caps
        if state is None:
            return False
        if state.visible_devices != self._resource.visible_devices:
            self._log.warning(
                "adopted mps daemon serves other GPUs than configured; restart it to change them",
                daemon_gpus=state.visible_devices,
            )
        self._follow_log(since=None)
        self._running_multi_user = state.multi_user
        self._compute_modes.adopt(state.original_compute_modes)
        held = recorded_ceilings(state, self._resource.shares)
        self._log.info(
            "mps daemon adopted", pid=state.pid, ceilings=held.describe() if held else None, multi_user=state.multi_user
        )
        if self._owns_daemon and state.multi_user is not None and state.multi_user is not self._multi_user:
            self._log.warning(
                "adopted mps daemon keeps its user mode, which differs from the configuration",
                daemon_multi_user=state.multi_user,
                configured_multi_user=self._multi_user,
                hint="a daemon the agent starts follows the configuration; to switch now, stop the agent with "
                "--mps-on-exit quit (this quits the daemon and ends its clients) and start it again",
            )
        if not self._ceilings_known and held is not None:
            # Its clients were admitted under these ceilings: kept until the live grants are known.
            self._wanted = held
            self._log.info("ceilings kept until the live grants are known", ceilings=held.describe())
        return True

    async def _start(self) -> None:
        _, written = await self._daemon.launch(multi_user=self._multi_user)
        self._follow_log(since=written)
        self._running_multi_user = self._multi_user
        self._save_state()
        await self._wait_answering()

    def _follow_log(self, *, since: int | None) -> None:
        """Follow the log of the daemon just started or adopted (from `since`, else its end), and judge it; watch
        who holds its control socket."""
        assert self._daemon.pid is not None
        self._guard.attach(self._daemon.pid, since=since)
        self._holds.attach(self._daemon.pid)

    def _checked(self, found: Check) -> None:
        """A liveness check's finding: a daemon that greets no connection makes the replicas Unhealthy at once (and
        the claims' devices tainted), until a check finds it answering; one held by a connection is the hold
        watch's."""
        self._silently_held = found.state is State.HELD
        if self._silently_held:
            self._holds.look_soon()
        if found.answers:
            if self._unresponsive is not None:
                since, _ = self._unresponsive
                self._unresponsive = None
                self._up = True
                self._inventory.set_resource_problem(HEALTH_SOURCE, False)
                self._log.info(
                    "mps daemon answers again", pid=self._daemon.pid, silent_for_s=round(time.time() - since, 1)
                )
            return
        if self._unresponsive is None:
            self._unresponsive = (time.time(), found.reason)
            self._up = False
            self._inventory.set_resource_problem(HEALTH_SOURCE, True, f"its MPS daemon does not answer: {found.reason}")
            self._log.error(
                "mps daemon does not answer",
                pid=self._daemon.pid,
                reason=found.reason,
                restarted=found.state is State.HUNG,
            )

    def _hold_ended(self, ended: HoldEnded) -> None:
        """A held connection was ended: every ceiling is set again at once (the holder may have changed any), and
        the owner is told."""
        self._restore_all = True
        self._wake_round()
        self._on_hold_ended(ended)

    async def _wait_answering(self) -> None:
        await self._daemon.wait_answering()
        self._log.info("mps daemon started", pid=self._daemon.pid, multi_user=self._multi_user)

    def _wake_round(self) -> None:
        """Run the next round now (the event is replaced after each wake: the round's own)."""
        self._wake.set()

    async def _watch_rounds(self) -> None:
        """A round every probe interval, and at once when the daemon's log shows a ceiling changed behind the agent
        (or a line not understood): the daemon's caps read back (set again after a change), what changed restored.
        When the agent cannot run the front-end, the rounds back off (up to FRONT_END_BACKOFF_MAX_S). Whether the
        daemon lives is the liveness watch's to say, never a round's."""
        rounds = Backoff(self._probe_interval, max(FRONT_END_BACKOFF_MAX_S, self._probe_interval))
        while True:
            with anyio.move_on_after(rounds.delay):
                await self._wake.wait()
            self._wake = anyio.Event()
            if self._silently_held:
                continue  # its session would wait on the holder: the hold watch ends it, or the liveness check sees
            restore_all, self._restore_all = self._restore_all, False
            try:
                await self._hold(verify=True, restore=self._guard.take_explained() or restore_all)
            except ControlRunError as exc:
                rounds.grow()
                self._front_end.failed(str(exc), pid=self._daemon.pid, retry_in_s=rounds.delay)
                continue
            except DaemonBusyError:
                pass  # reported by _hold: the next round asks again
            except DaemonCommandError as exc:
                self._log.error("mps daemon caps not verified", pid=self._daemon.pid, reason=str(exc))
            self._front_end.works()
            self._daemon.state_file.retry()
            rounds.reset()

    async def _stop(self) -> None:
        if not self._owns_daemon:
            if self._daemon.pid is not None:
                self._log.info("mps daemon left to the daemon host", pid=self._daemon.pid)
            return
        if self._on_exit is MpsOnExit.KEEP:
            if self._daemon.pid is not None:
                self._log.info("mps daemon left running", pid=self._daemon.pid)
            return
        await self._daemon.quit(QUIT_TIMEOUT_S)
        await self._compute_modes.restore()
        self._log.info("mps daemon quit")

    # --- state and log ---------------------------------------------------------------------------------------

    def _recorded_compute_modes(self) -> Mapping[str, int] | None:
        state = self._daemon.state_file.read()
        return state.original_compute_modes if state else None

    def _save_state(self) -> None:
        if self._daemon.pid is None:
            return
        self._daemon.state_file.write(
            daemon_state(
                pid=self._daemon.pid,
                visible_devices=self._resource.visible_devices,
                ceilings=self._held or self._wanted,
                shares=self._resource.shares,
                multi_user=self._running_multi_user,
                original_compute_modes=self._compute_modes.original,
            ),
        )
