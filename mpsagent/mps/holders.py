"""Who holds the MPS control daemon's control socket, since when, and which holders the agent ends: pure, the hold
watch's decisions (`hold_watch` looks into the daemon, ends connections and reports).

A **holder** is a connection the daemon accepted on a control socket from a process that is neither the daemon's
own (its MPS servers) nor the agent's (its front-ends and liveness checks). A client connects for a moment, to be
handed to a server; a front-end's session is open while it runs; a connection that sends nothing blocks the daemon
for everyone, since it reads each connection's credentials with no timeout. A holder **blocks** the daemon when the
daemon waits on it (silent), or refuses other sessions while it is open (a session held). One that has blocked it
for the bound is ended when its process is in a pod's container, and waited for (and reported) on the host: an
administrator's session is theirs to close.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from mpsagent.base.cgroups import PodContainer
from mpsagent.mps.control_socket import ControlConnection


@dataclass(frozen=True, kw_only=True, slots=True)
class Holder:
    """A connection to the daemon's control socket from another process, as the agent has seen it."""

    connection: ControlConnection
    container: PodContainer | None
    """The pod and container of its process (from its cgroup); None on the host (or gone)."""
    since: float
    """When it was first seen (monotonic)."""
    silent: bool
    """The daemon waits for its credentials: it blocks everyone by itself."""

    def held_for(self, now: float) -> float:
        return max(0.0, now - self.since)

    def describe(self) -> str:
        """The holder in words: its process, where it runs, the socket."""
        connection = self.connection
        process = "a process that is gone" if connection.peer_pid is None else f"PID {connection.peer_pid}"
        place = " on the host" if self.container is None else f" in {self.container.describe()}"
        what = "a connection that sends nothing" if self.silent else "a control session"
        return f"{what} on `{connection.socket}` from {process}{place}"


@dataclass(frozen=True, kw_only=True, slots=True)
class HoldDecision:
    """What to do about the holders that have blocked the daemon for the bound."""

    end: tuple[Holder, ...]
    """In a pod: their connections are ended."""
    wait: tuple[Holder, ...]
    """On the host, or ending is turned off: reported, and waited for."""


class HoldTracker:
    """The holders seen, each since it was first seen; a connection gone since is forgotten."""

    def __init__(self, bound_s: float, *, end_in_pods: bool) -> None:
        """`bound_s`: how long a holder may block the daemon; `end_in_pods`: whether one in a pod is then ended
        (otherwise it is only reported, as a host's is)."""
        self.bound_s = bound_s
        self._end_in_pods = end_in_pods
        self._holders: dict[int, Holder] = {}

    @property
    def holders(self) -> tuple[Holder, ...]:
        """Those seen at the last look, longest held first."""
        return tuple(sorted(self._holders.values(), key=lambda holder: holder.since))

    def update(
        self,
        seen: Iterable[tuple[ControlConnection, PodContainer | None]],
        *,
        reading_fd: int | None,
        now: float,
    ) -> tuple[Holder, ...]:
        """The holders now: the connections seen at this look (with where their process runs), `reading_fd` the
        descriptor the daemon waits in a read on. A connection keeps its first sighting; one not seen is gone."""
        holders: dict[int, Holder] = {}
        for connection, container in seen:
            known = self._holders.get(connection.inode)
            silent = connection.fd == reading_fd
            holders[connection.inode] = (
                replace(known, connection=connection, silent=silent)
                if known is not None
                else Holder(connection=connection, container=container, since=now, silent=silent)
            )
        self._holders = holders
        return self.holders

    def due(self, now: float) -> tuple[Holder, ...]:
        """The holders seen for the bound or longer."""
        return tuple(holder for holder in self.holders if holder.held_for(now) >= self.bound_s)

    def next_due(self, now: float) -> float | None:
        """When the next holder not yet due will be (monotonic); None when none is waiting to be."""
        pending = [
            holder.since + self.bound_s for holder in self._holders.values() if holder.since + self.bound_s > now
        ]
        return min(pending) if pending else None

    def decide(self, due: Iterable[Holder], *, refusing: bool) -> HoldDecision:
        """Which of the `due` holders block the daemon (silent ones always; the others while it refuses sessions,
        `refusing`), and of those, which are ended and which waited for."""
        blocking = [holder for holder in due if holder.silent or refusing]
        end = tuple(h for h in blocking if h.container is not None and self._end_in_pods)
        return HoldDecision(end=end, wait=tuple(h for h in blocking if h not in end))

    def forget(self, holder: Holder) -> None:
        """A holder whose connection was ended."""
        self._holders.pop(holder.connection.inode, None)
