"""The MPS daemon's status: the one typed snapshot of what the daemon supervisor knows about its daemon, and the
metric families read from it.

`DaemonSupervisor.status` builds it; the resource server hands it on, the status document embeds it as it is
(camelCase on the wire: `status.json`, `--status`) and `/metrics` reads it through `DAEMON_METRICS`. A new daemon
fact is a field here (with a default, for an older agent's file), its value in `DaemonSupervisor.status`, and a
row of `DAEMON_METRICS` if it is a metric.
"""

from __future__ import annotations

from typing import Literal, overload

import msgspec

from mpsagent.base.bounded import Count, Pid
from mpsagent.base.metric_rows import MetricRow, counter, each, gauge, one
from mpsagent.domain.shares import Ceilings

CeilingMode = Literal["full", "capped"]
"""Whether the daemon's ceilings are the whole hardware ("full") or any is lower ("capped"): the status file's
`capMode` and `daemon.json`'s `mode`, kept for older readers. Not a grant's kind (`grant_kind.GrantKind`), which says
whether one container holds every ID of its GPUs."""
CEILING_MODES: tuple[CeilingMode, ...] = ("full", "capped")


@overload
def ceiling_mode(held: Ceilings, full: Ceilings) -> CeilingMode: ...


@overload
def ceiling_mode(held: Ceilings | None, full: Ceilings) -> CeilingMode | None: ...


def ceiling_mode(held: Ceilings | None, full: Ceilings) -> CeilingMode | None:
    """`full` while the daemon holds the full hardware, `capped` while any ceiling is lower (None: it holds none
    known). The one rule for the status file's `capMode` and `daemon.json`'s `mode`."""
    if held is None:
        return None
    return "full" if held == full else "capped"


class CeilingsStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    thread_percentage: Count
    memory_mib: tuple[Count, ...] = msgspec.field(name="memoryMiB")

    @classmethod
    def of(cls, ceilings: Ceilings | None) -> CeilingsStatus | None:
        if ceilings is None:
            return None
        return cls(thread_percentage=ceilings.thread_percentage, memory_mib=ceilings.memory_mib)

    def ceilings(self) -> Ceilings:
        return Ceilings(thread_percentage=self.thread_percentage, memory_mib=self.memory_mib)


SeenBy = Literal["control_log", "read_back"]
"""How a ceiling changed behind the agent was seen: in the daemon's log as it happened, or by reading it back."""
SEEN_BY: tuple[SeenBy, ...] = ("control_log", "read_back")


class CapTamperEvent(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    at: str
    found: str
    seen_by: SeenBy = "read_back"


class ControlLogStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The daemon's log as the ceiling watch reads it: while `watched`, every ceiling change is seen as it
    happens; otherwise only the read-back guards the ceilings, in whole GiB."""

    file: str
    """The file followed (or tried): the log's path, or the daemon's own output through /proc."""
    watched: bool
    """Followed, and every line where a command's answer belongs understood."""
    problem: str | None = None
    """Why it is not followed, or what last happened to it (truncated, rotated, deleted)."""
    problem_at: str | None = None
    moves: Count = 0
    """Truncations, renames and deletions followed."""
    unknown_lines: Count = 0
    first_unknown_line: str | None = None


class FrontEndFailure(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    at: str
    reason: str


class RecordDamage(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What is wrong with the daemon's record (`daemon.json`), since when: the daemon cannot be adopted from it."""

    at: str
    path: str
    problem: str


class DaemonBusy(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Another control session keeps the daemon busy, since when: it lives (nothing is killed), and a cap switch
    waits for it, boundedly, then fails."""

    at: str
    reason: str


class DaemonUnresponsive(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The daemon greets no connection, since when and why: its replicas are Unhealthy and its devices tainted
    until it answers again (a daemon held by a connection, or debugged, is not restarted for it)."""

    at: str
    reason: str


class ControlHolderStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A process that holds the daemon's control socket: a control session open, or a connection that sends
    nothing (`silent`), since `since`; its pod and container when it runs in one."""

    pid: Pid | None = None
    uid: Count | None = None
    pod_uid: str | None = None
    container_id: str | None = None
    socket: str
    silent: bool
    since: str


class HoldEnded(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A holder in a pod whose connection the agent ended, once it had held the socket for the bound."""

    at: str
    held_for_s: float
    holder: ControlHolderStatus


class DaemonStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The daemon's facts; the field order is status.json's key order."""

    pid: Pid | None = None
    up: bool
    cap_mode: CeilingMode | None = None
    ceilings: CeilingsStatus | None = None
    """What the daemon is known to hold; None while they are being set, or after a change failed."""
    restarts: Count = 0
    restart_attempts: Count = 0
    multi_user: bool | None = None
    """None: not known (a daemon adopted from an older agent)."""
    cap_tamper: Count = 0
    cap_tamper_in_log: Count = 0
    """Of `cap_tamper`, the changes seen in the daemon's log as they happened; the rest were read back."""
    last_cap_tamper: CapTamperEvent | None = None
    control_log: ControlLogStatus | None = None
    front_end_failure: FrontEndFailure | None = None
    record_damage: RecordDamage | None = None
    busy: DaemonBusy | None = None
    busy_episodes: Count = 0
    unresponsive: DaemonUnresponsive | None = None
    control_holders: tuple[ControlHolderStatus, ...] = ()
    """The processes that have held the control socket for the bound or longer, still open at the last look."""
    control_holds_ended: Count = 0
    last_control_hold_ended: HoldEnded | None = None
    control_holders_unseen: str | None = None
    """Why the agent cannot see who holds the control socket (no ptrace access into the daemon); None while it can."""


def _tamper_seen_by(daemon: DaemonStatus, seen_by: str) -> int:
    in_log = daemon.cap_tamper_in_log
    return in_log if seen_by == "control_log" else daemon.cap_tamper - in_log


DAEMON_METRICS: tuple[MetricRow[DaemonStatus], ...] = (
    gauge("mpsagent_daemon_up", "1 when the MPS control daemon answers", one(lambda d: d.up)),
    counter(
        "mpsagent_daemon_restarts",
        "MPS control daemon failures seen (exited or hung); each ended the daemon's clients",
        one(lambda d: d.restarts),
    ),
    counter(
        "mpsagent_daemon_restart_attempts",
        "Attempts to start a new MPS control daemon after a failure (a daemon that stays down keeps counting)",
        one(lambda d: d.restart_attempts),
    ),
    gauge(
        "mpsagent_daemon_cap_mode",
        "1 for the cap mode the daemon holds",
        each(CEILING_MODES, lambda d, mode: d.cap_mode == mode),
        labels=("mode",),
    ),
    gauge(
        "mpsagent_daemon_multi_user",
        "1 when the daemon runs one MPS server for every user (-M), 0 when one per user",
        one(lambda d: d.multi_user),
    ),
    counter(
        "mpsagent_cap_tamper",
        "Daemon ceilings found changed behind the agent (and restored), by how they were seen: in the daemon's "
        "control log as they happened, or by reading them back",
        each(SEEN_BY, _tamper_seen_by),
        labels=("seen_by",),
    ),
    gauge(
        "mpsagent_daemon_log_watched",
        "1 while the agent follows the daemon's control log and understands it (every ceiling change seen as it "
        "happens); 0 while only the read-back guards the ceilings",
        one(lambda d: None if d.control_log is None else d.control_log.watched),
    ),
    counter(
        "mpsagent_daemon_log_unknown_lines",
        "Lines of the daemon's control log, where a command's answer belongs, in a form the agent does not know",
        one(lambda d: None if d.control_log is None else d.control_log.unknown_lines),
    ),
    gauge(
        "mpsagent_daemon_busy",
        "1 while another control session keeps the MPS control daemon busy (it lives; cap switches fail)",
        one(lambda d: d.busy is not None),
    ),
    counter(
        "mpsagent_daemon_busy_episodes",
        "Times another control session kept the MPS control daemon busy beyond the agent's bounded wait",
        one(lambda d: d.busy_episodes),
    ),
    gauge(
        "mpsagent_daemon_unresponsive",
        "1 while the MPS control daemon greets no connection (stopped, hung): its replicas Unhealthy, its devices "
        "tainted",
        one(lambda d: d.unresponsive is not None),
    ),
    gauge(
        "mpsagent_daemon_control_holders",
        "Processes holding the MPS control daemon's control socket for the bound or longer (a session open, or a "
        "connection that sends nothing): every other control session waits",
        one(lambda d: len(d.control_holders)),
    ),
    counter(
        "mpsagent_daemon_control_holds_ended",
        "Control-socket connections of processes in pods that the agent ended after they held it for the bound",
        one(lambda d: d.control_holds_ended),
    ),
    gauge(
        "mpsagent_daemon_thread_ceiling_percent",
        "The thread percentage the MPS daemon allows any client of the resource",
        one(lambda d: None if d.ceilings is None else d.ceilings.thread_percentage),
    ),
)
"""The daemon's families; each sample also gets the resource's label (`status_document.RESOURCE_METRICS`)."""
