"""The hold watch of one resource's daemon: who holds its control socket, and a holder in a pod ended once it has
blocked the daemon for the bound (`--control-hold-seconds`), at its connection and nowhere else: the daemon and
every other client are untouched. The daemon supervisor owns it, wakes it (a connection in the daemon's log, a
session refused, a liveness check that found the daemon held) and restores every ceiling once one is ended.

It looks (`control_socket`) only when woken and, while holders are open, every probe interval and when the next is
due; `holders` decides. A holder on the host (an administrator at the `nvidia-cuda-mps-control` prompt, a tool) is
never ended: it is reported once and waited for.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import anyio
from structlog.typing import FilteringBoundLogger

from mpsagent.base import procfs
from mpsagent.base.cgroups import PodContainer, pod_container
from mpsagent.base.clock import utc, utc_of_monotonic
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import ControlSocketAccessError
from mpsagent.base.values import DEFAULT_CONTROL_HOLD_S
from mpsagent.mps import control_socket
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.control_socket import ControlConnection
from mpsagent.mps.daemon_status import ControlHolderStatus, HoldEnded
from mpsagent.mps.holders import Holder, HoldTracker

ENDED_EVENT = "mps control socket held by a pod; its connection is ended"
WAITED_EVENT = "mps control socket held; waiting for it"
FREE_EVENT = "mps control socket free again"
ENDED_HINT = (
    "a process in that container kept the MPS control daemon from every other session (a control session left "
    "open, or a connection that sends nothing); only its connection was ended, the daemon and its clients were not "
    "touched; ask the pod's owner not to hold nvidia-cuda-mps-control open"
)
WAITED_HINT = (
    "the daemon serves no other control session (and cap switches fail) until it is let go; a process on the host "
    "is never ended by the agent: close that session (`pgrep -a nvidia-cuda-mps-control`)"
)

OnEnded = Callable[[HoldEnded], None]


def _status(holder: Holder, now: float) -> ControlHolderStatus:
    connection, container = holder.connection, holder.container
    return ControlHolderStatus(
        pid=connection.peer_pid,
        uid=connection.peer_uid,
        pod_uid=None if container is None else container.pod_uid,
        container_id=None if container is None else container.container_id,
        socket=connection.socket,
        silent=holder.silent,
        since=utc_of_monotonic(holder.since),
    )


class HoldWatch:
    def __init__(
        self,
        *,
        channel: ControlChannel,
        pipe_directory: Path,
        bound_s: float,
        probe_interval_s: float,
        log: FilteringBoundLogger,
        on_ended: OnEnded,
    ) -> None:
        """`bound_s`: how long a holder may block the daemon (0: holders are reported after the default's time,
        and never ended); `on_ended`: told of each connection ended, after it was."""
        self._channel = channel
        self._pipe = pipe_directory
        self._interval = probe_interval_s
        self._log = log
        self._on_ended = on_ended
        self._tracker = HoldTracker(bound_s or DEFAULT_CONTROL_HOLD_S, end_in_pods=bound_s > 0)
        self._daemon: int | None = None
        self._agent = os.getpid()
        self._wake = anyio.Event()
        self._waited: set[int] = set()
        """The holders reported as waited for (by socket inode), reported once each."""
        self.ended = 0
        self.last_ended: HoldEnded | None = None
        self._unseen = FailureEpisodes(
            log,
            failed="who holds the mps control socket cannot be seen",
            level="warning",
            again="who holds the mps control socket can be seen again",
        )

    def attach(self, daemon: int) -> None:
        """Watch this daemon (just started or adopted)."""
        self._daemon = daemon
        self.look_soon()

    def detach(self) -> None:
        self._daemon = None
        self._tracker.update((), reading_fd=None, now=time.monotonic())

    def look_soon(self) -> None:
        """Look at once: a connection was accepted, a session refused, or the daemon found held."""
        self._wake.set()

    def holders(self) -> tuple[ControlHolderStatus, ...]:
        """The holders seen for the bound or longer, and still open at the last look: the status's."""
        now = time.monotonic()
        return tuple(_status(holder, now) for holder in self._tracker.due(now))

    @property
    def unseen(self) -> str | None:
        """Why the agent cannot see who holds the socket (no ptrace access); None while it can."""
        return None if self._unseen.current is None else self._unseen.current[1]

    async def run(self) -> None:
        """Look whenever woken, and while holders are open; until cancelled."""
        while True:
            with anyio.move_on_after(self._next_look_in()):
                await self._wake.wait()
            self._wake = anyio.Event()
            await self._look()

    def _next_look_in(self) -> float:
        if self._daemon is None or not self._tracker.holders:
            return math.inf
        now = time.monotonic()
        due = self._tracker.next_due(now)
        return min(self._interval, (due - now) if due is not None else self._interval)

    async def _look(self) -> None:
        daemon = self._daemon
        if daemon is None:
            return
        try:
            seen = [(c, self._place(c)) for c in control_socket.connections(daemon, self._pipe) if self._foreign(c)]
            doing = control_socket.activity(daemon)
        except ControlSocketAccessError as exc:
            self._unseen.failed(str(exc), pid=daemon)
            return
        self._unseen.works(pid=daemon)
        now = time.monotonic()
        before = {holder.connection.inode: holder for holder in self._tracker.holders}
        self._tracker.update(seen, reading_fd=None if doing is None else doing.reading_fd, now=now)
        self._report_gone(before, now)
        due = self._tracker.due(now)
        if not due:
            return
        refusing = False if all(holder.silent for holder in due) else await self._channel.refusing()
        decision = self._tracker.decide(due, refusing=bool(refusing))
        for holder in decision.end:
            self._end(daemon, holder, now)
        for holder in decision.wait:
            self._report_waited(holder, now)

    def _foreign(self, connection: ControlConnection) -> bool:
        """A connection of neither the agent's (its front-ends, its checks) nor the daemon's own (its servers)."""
        peer = connection.peer_pid
        if peer is None:
            return True
        family = {peer, *procfs.ancestors(peer)}
        return self._agent not in family and self._daemon not in family

    def _place(self, connection: ControlConnection) -> PodContainer | None:
        text = None if connection.peer_pid is None else procfs.cgroup_text(connection.peer_pid)
        return None if text is None else pod_container(text)

    def _end(self, daemon: int, holder: Holder, now: float) -> None:
        try:
            ended = control_socket.end(daemon, holder.connection)
        except ControlSocketAccessError as exc:
            self._unseen.failed(str(exc), pid=daemon)
            return
        self._tracker.forget(holder)
        if not ended:
            return  # it had closed meanwhile
        event = HoldEnded(at=utc(time.time()), held_for_s=round(holder.held_for(now), 2), holder=_status(holder, now))
        self.ended += 1
        self.last_ended = event
        container = holder.container
        self._log.warning(
            ENDED_EVENT,
            holder=holder.describe(),
            holder_pid=holder.connection.peer_pid,
            pod_uid=None if container is None else container.pod_uid,
            container_id=None if container is None else container.container_id,
            held_for_s=event.held_for_s,
            hint=ENDED_HINT,
        )
        self._on_ended(event)

    def _report_waited(self, holder: Holder, now: float) -> None:
        if holder.connection.inode in self._waited:
            return
        self._waited.add(holder.connection.inode)
        self._log.warning(
            WAITED_EVENT,
            holder=holder.describe(),
            holder_pid=holder.connection.peer_pid,
            held_for_s=round(holder.held_for(now), 2),
            hint=WAITED_HINT,
        )

    def _report_gone(self, before: dict[int, Holder], now: float) -> None:
        still = {holder.connection.inode for holder in self._tracker.holders}
        for inode in [inode for inode in self._waited if inode not in still]:
            self._waited.discard(inode)
            holder = before.get(inode)
            held = None if holder is None else round(holder.held_for(now), 2)
            self._log.info(FREE_EVENT, held_for_s=held)
