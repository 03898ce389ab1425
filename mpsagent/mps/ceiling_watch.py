"""Judging the ceiling commands the daemon's log shows (`control_log`): which the agent sent itself, and which
changed a ceiling away from what the ledger wants. Pure; the daemon supervisor feeds it and restores what it finds.

Telling the agent's commands from a tenant's, without a race: the control channel notes each `set_*` command it
sends (`SentCommands`) before its session opens, and a command the log shows that the agent sent and has not yet
seen there is the agent's. A tenant who sends the very same command in the same instant gets it counted as the
agent's, and the agent's own copy then sets what the daemon already holds: a command that changes nothing (the
value the daemon holds, as the log has shown it, or the value the ledger wants) is never a change. A note the log
never shows (the session failed before the daemon read it) is dropped once the log has been read to its end after
that session closed, so a tenant cannot later pass for the agent with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from mpsagent.domain.shares import Ceilings
from mpsagent.mps.control_log import CeilingCommand, CeilingTarget, Outcome, Verdict, ceiling_command


@dataclass(kw_only=True, slots=True)
class _Session:
    commands: Counter[str]
    closed_at: float | None = None


MAX_SESSIONS = 256
"""Sessions noted at most: while the log cannot be read nothing is forgotten by reading it, so the oldest closed
ones go (the log cannot show them to anyone then either)."""


class SentCommands:
    """The agent's own ceiling commands that the daemon's log has not shown yet, by control session."""

    def __init__(self) -> None:
        self._sessions: dict[int, _Session] = {}
        self._next = 0

    def opened(self, commands: Iterable[str]) -> int | None:
        """Note a session's ceiling commands before it opens; its key for `closed` (None: it sends none)."""
        ceiling = [command for command in commands if ceiling_command(command) is not None]
        if not ceiling:
            return None
        self._next += 1
        self._sessions[self._next] = _Session(commands=Counter(ceiling))
        closed = [key for key, session in self._sessions.items() if session.closed_at is not None]
        for key in closed[: max(0, len(self._sessions) - MAX_SESSIONS)]:
            del self._sessions[key]
        return self._next

    def closed(self, session: int | None, at: float) -> None:
        """The session's front-end has exited (`at`, monotonic): the daemon has logged whatever it read of it."""
        if session is not None and session in self._sessions:
            self._sessions[session].closed_at = at

    def claim(self, text: str) -> bool:
        """Whether the agent sent `text` and the log had not shown it yet (then it is taken: shown once)."""
        for session in self._sessions.values():
            if session.commands[text] > 0:
                session.commands[text] -= 1
                return True
        return False

    def forget_closed_before(self, moment: float) -> None:
        """Drop what sessions closed before `moment` sent and the log never showed: the caller has read the log to
        its end since `moment`, so the daemon never read those commands."""
        for key in [k for k, s in self._sessions.items() if s.closed_at is not None and s.closed_at < moment]:
            del self._sessions[key]
        for key in [k for k, s in self._sessions.items() if s.closed_at is not None and not +s.commands]:
            del self._sessions[key]

    def __len__(self) -> int:
        return sum(sum((+s.commands).values()) for s in self._sessions.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class CeilingChange:
    """A ceiling command the agent did not send that the daemon accepted, and that moved a ceiling away from what
    the ledger wants: to be restored."""

    command: CeilingCommand
    wanted: int | None
    """The figure the ledger wants for its target (MiB or per cent); None when the command names no target."""

    @property
    def ordinal(self) -> int | None:
        target = self.command.target
        return None if target is None else target.ordinal

    def describe_wanted(self) -> str | None:
        """The figure the ledger wants, in words (None: the command names no value the agent holds)."""
        target = self.command.target
        if self.wanted is None or target is None:
            return None
        return f"{self.wanted} MiB" if target.kind.memory else f"{self.wanted:g} %"

    def describe(self) -> str:
        target = self.command.target
        where = "a value the agent cannot place" if target is None else target.describe()
        wanted = self.describe_wanted()
        return f"`{self.command.text}` set {where} to {self.command.shown()}" + (
            f"; the ledger wants {wanted}" if wanted else ""
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class NotUnderstood:
    """A ceiling command whose answer the log shows in a form the agent does not know: what it did is not known,
    and only reading the daemon's values back can tell."""

    verdict: Verdict


Figure = float | int | None
"""A ceiling's figure: MiB (None: no limit) or per cent."""


@dataclass(kw_only=True, slots=True)
class CeilingWatch:
    """Judges each verdict of the watched daemon's log against the ledger's wish."""

    sent: SentCommands = field(default_factory=SentCommands)
    _daemon: int | None = None
    _held: dict[CeilingTarget, Figure] = field(default_factory=dict)
    """What the log has shown the daemon set each target to, since the watch began on this daemon."""

    def watch(self, daemon: int | None) -> None:
        """Judge the log of this daemon (its PID) from now on; None: of none (the daemon is down or not adopted)."""
        if daemon != self._daemon:
            self._held.clear()
        self._daemon = daemon

    def judge(self, verdict: Verdict, wanted: Ceilings) -> CeilingChange | NotUnderstood | None:
        """A change to restore, a verdict only the read-back can settle, or None (another daemon's, refused, the
        agent's own, or a command that changes nothing)."""
        if verdict.daemon != self._daemon or verdict.outcome is Outcome.REFUSED:
            return None
        command = verdict.command
        own = self.sent.claim(command.text)
        if verdict.outcome is Outcome.UNKNOWN:
            return None if own else NotUnderstood(verdict=verdict)
        target = command.target
        if target is None:
            return None if own else CeilingChange(command=command, wanted=None)
        seen = target in self._held
        before = self._held.pop(target, None)
        if command.readable:
            self._held[target] = command.figure
        if own or not _holds(target, wanted):
            return None  # the agent's; or an ordinal the daemon has no GPU of the resource for: no client uses it
        want = _wanted(target, wanted)
        if command.readable and (command.figure == want or (seen and command.figure == before)):
            return None
        return CeilingChange(command=command, wanted=want)


def _holds(target: CeilingTarget, wanted: Ceilings) -> bool:
    """Whether the target is one of the ceilings the agent holds."""
    return not target.kind.memory or (target.ordinal is not None and target.ordinal < len(wanted.memory_mib))


def _wanted(target: CeilingTarget, wanted: Ceilings) -> int:
    if not target.kind.memory:
        return wanted.thread_percentage
    assert target.ordinal is not None
    return wanted.memory_mib[target.ordinal]
