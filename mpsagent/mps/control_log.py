"""The MPS control daemon's `control.log` read as what it records: each control session's ceiling commands
(`set_*`), and whether the daemon accepted each one.

Pure: `daemon_log` reads the file and feeds its lines here, `ceiling_watch` judges what was accepted. The format is
pinned by tests against the real `nvidia-cuda-mps-control` (Debian's 535 build) and the driver-580 lines measured on
an H200 (../shared/hardware/mps-ceilings-h200.md, 2026-12-04); `scripts/hardware_check.py` checks a lent GPU's driver
writes the same. Every line is `[<date> <time> <source> <pid>] <text>`; a control session is `NEW UI` ... `UI closed`
with each command logged as typed (`Cmd:<command>`), then what the daemon answered:

- 535: `set_default_active_thread_percentage 25` is answered with the value (`25.0`), a memory limit with nothing; an
  out-of-range percentage with `Invalid percentage, expected between (0.0, 100.0]`; a server that is not running
  with `Server <pid> not found`.
- 580 echoes a command it read (`set_default_device_pinned_mem_limit 0 20389M.`) and, when the sender is neither
  root nor the daemon's owner, refuses it on the next line: `Insufficient privileges for UID <uid>. ...`.

So a ceiling command's verdict is known once the next line of its daemon that is no echo arrives (a refusal, or
anything else: it was accepted), or once the log has gone quiet after it (`settle`: a session held open after a
`set_` command). A line in that place that is none of these is not understood: its command's verdict is UNKNOWN
(the caller falls back to reading the daemon's values back) and the line is reported.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

LINE = re.compile(
    r"\[(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) +(?P<source>[A-Za-z]+) +(?P<pid>\d+)\] ?(?P<text>.*)"
)
COMMAND_PREFIX = "Cmd:"
GIB_MIB = 1024
_PERCENTAGE = re.compile(r"\d+(\.\d+)?")
_MEMORY = re.compile(r"(\d+)([MmGg]?)")
_NUMBER = re.compile(r"\d+")
_REFUSALS = (
    re.compile(r"Insufficient privileges\b.*"),  # driver 580: not root, not the daemon's owner
    re.compile(r"Invalid\b.*"),  # a percentage out of range, a value the daemon does not take
    re.compile(r"Server \d+ not found"),  # a server that is not (or no longer) running
)
_ECHO_VALUE = re.compile(r"\d+(\.\d+)?")
# What a control daemon logs of its own between a command and the next (clients, servers, connections): a line that
# says nothing about the command, which was accepted since no refusal came first.
_EVENTS = re.compile(
    r"(NEW UI|UI closed|Accepting connection\.\.\.|User did not send valid credentials|NEW CLIENT\b.*|NEW SERVER\b.*"
    r"|Starting new server\b.*|Server \d+ exited\b.*|Client \d+\b.*|Starting control daemon\b.*|To connect CUDA\b.*)"
)


_CONNECTION_OPENED = ("Accepting connection...", "NEW UI")


def opens_connection(line: str) -> bool:
    """Whether a log line says the daemon accepted a connection or opened a control session (someone may hold
    its control socket from now on)."""
    parsed = LINE.fullmatch(line.rstrip("\r\n"))
    return parsed is not None and parsed.group("text").strip() in _CONNECTION_OPENED


class CeilingKind(enum.Enum):
    DEFAULT_THREADS = "set_default_active_thread_percentage"
    DEFAULT_MEMORY = "set_default_device_pinned_mem_limit"
    SERVER_THREADS = "set_active_thread_percentage"
    SERVER_MEMORY = "set_device_pinned_mem_limit"

    @property
    def memory(self) -> bool:
        return self in (CeilingKind.DEFAULT_MEMORY, CeilingKind.SERVER_MEMORY)

    @property
    def arguments(self) -> int:
        """How many arguments the command takes: the server's PID, the ordinal, the value."""
        return {"DEFAULT_THREADS": 1, "DEFAULT_MEMORY": 2, "SERVER_THREADS": 2, "SERVER_MEMORY": 3}[self.name]


_KINDS = {kind.value: kind for kind in CeilingKind}


@dataclass(frozen=True, kw_only=True, slots=True)
class CeilingTarget:
    """One value the daemon holds: a default (server None) or a running server's, of one ordinal for memory."""

    kind: CeilingKind
    ordinal: int | None = None
    server: int | None = None

    def describe(self) -> str:
        whose = "the default" if self.server is None else f"server {self.server}'s"
        if self.kind.memory:
            return f"{whose} pinned memory limit of ordinal {self.ordinal}"
        return f"{whose} active thread percentage"


@dataclass(frozen=True, kw_only=True, slots=True)
class CeilingCommand:
    """A `set_*` ceiling command as the log records it. `target` is None when its arguments name no value the daemon
    could hold (malformed); `figure` is MiB for memory (None: 0, no limit at all), per cent for threads, when
    `readable`; an unreadable figure is one the daemon parses its own way (`5000K`, `1.5G`, `abc` is no limit)."""

    text: str
    target: CeilingTarget | None
    figure: float | int | None
    readable: bool

    def shown(self) -> str:
        """The figure in words."""
        if not self.readable or self.target is None:
            return "a figure the agent cannot read"
        if self.target.kind.memory:
            return "no limit" if self.figure is None else f"{self.figure} MiB"
        return f"{self.figure:g} %"


def ceiling_command(text: str) -> CeilingCommand | None:
    """The ceiling command `text` is (None: another command: a `get_`, `quit`, ...), read as the daemon reads it."""
    words = text.split()
    kind = _KINDS.get(words[0]) if words else None
    if kind is None:
        return None
    arguments = words[1:]
    if len(arguments) != kind.arguments or not all(_NUMBER.fullmatch(word) for word in arguments[:-1]):
        return CeilingCommand(text=text, target=None, figure=None, readable=False)
    places = [int(word) for word in arguments[:-1]]
    server = places.pop(0) if kind in (CeilingKind.SERVER_THREADS, CeilingKind.SERVER_MEMORY) else None
    target = CeilingTarget(kind=kind, ordinal=places[0] if places else None, server=server)
    value = arguments[-1]
    if kind.memory:
        memory = _MEMORY.fullmatch(value)
        if memory is None:
            return CeilingCommand(text=text, target=target, figure=None, readable=False)
        mib = int(memory.group(1)) * (GIB_MIB if memory.group(2) in ("G", "g") else 1)
        return CeilingCommand(text=text, target=target, figure=mib or None, readable=True)
    if not _PERCENTAGE.fullmatch(value):
        return CeilingCommand(text=text, target=target, figure=None, readable=False)
    return CeilingCommand(text=text, target=target, figure=float(value), readable=True)


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    UNKNOWN = "unknown"
    """The line after it is not understood: whether the daemon took it is not known."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """A ceiling command one daemon logged, and what it did with it."""

    daemon: int
    command: CeilingCommand
    outcome: Outcome
    answer: str | None = None
    """The line that decided it: the refusal, or the line not understood."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UnknownLine:
    """A line where a command's answer belongs that is none the agent knows: the log format may have changed."""

    line: str
    after: str
    """The command it followed."""


@dataclass(kw_only=True, slots=True)
class _Pending:
    daemon: int
    command: CeilingCommand


def _echo(text: str, command: CeilingCommand) -> bool:
    """Whether `text` only repeats what the daemon read (535: the new percentage; 580: the command and a full stop)."""
    return bool(_ECHO_VALUE.fullmatch(text)) or text.removesuffix(".").split() == command.text.split()


class ControlLogReader:
    """Turns the log's lines, in order, into the verdicts on ceiling commands; one command at a time is open (the
    daemon serves one control session at a time), per daemon PID."""

    def __init__(self) -> None:
        self._pending: dict[int, _Pending] = {}

    def feed(self, line: str) -> list[Verdict | UnknownLine]:
        """What this line decides: the open command's verdict, and an unknown line."""
        parsed = LINE.fullmatch(line.rstrip("\r\n"))
        if parsed is None:
            return []  # not a daemon's line (a front-end's or a tool's stderr): it answers no command
        daemon, text = int(parsed.group("pid")), parsed.group("text").strip()
        out: list[Verdict | UnknownLine] = []
        pending = self._pending.get(daemon)
        if pending is not None:
            if any(refusal.fullmatch(text) for refusal in _REFUSALS):
                del self._pending[daemon]
                return [Verdict(daemon=daemon, command=pending.command, outcome=Outcome.REFUSED, answer=text)]
            if _echo(text, pending.command):
                return []
            del self._pending[daemon]
            if text.startswith(COMMAND_PREFIX) or _EVENTS.fullmatch(text):
                out.append(Verdict(daemon=daemon, command=pending.command, outcome=Outcome.ACCEPTED))
            else:
                out.append(Verdict(daemon=daemon, command=pending.command, outcome=Outcome.UNKNOWN, answer=text))
                out.append(UnknownLine(line=line.strip(), after=pending.command.text))
                return out
        if text.startswith(COMMAND_PREFIX):
            command = ceiling_command(text.removeprefix(COMMAND_PREFIX).strip())
            if command is not None:
                self._pending[daemon] = _Pending(daemon=daemon, command=command)
        return out

    def settle(self) -> list[Verdict]:
        """The log went quiet: each open command got every answer the daemon writes with it (no refusal), so it was
        accepted (a session held open after a `set_` command)."""
        settled = [
            Verdict(daemon=pending.daemon, command=pending.command, outcome=Outcome.ACCEPTED)
            for pending in self._pending.values()
        ]
        self._pending.clear()
        return settled

    @property
    def open(self) -> bool:
        """Whether a command waits for its verdict."""
        return bool(self._pending)
