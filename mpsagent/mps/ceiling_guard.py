"""The ceiling guard of one resource's daemon: sees every ceiling changed behind the agent, by either instrument,
and counts it; the daemon supervisor owns it and restores what it finds.

- The daemon's log, as it happens: `daemon_log` follows the file, `control_log` reads each ceiling command and the
  daemon's verdict, `ceiling_watch` judges it against the ledger's wish. A change wakes the supervisor's round to
  set every ceiling again; a line not understood, or the file cut back (rotated, truncated: a line written in the
  instant before may be in neither file), wakes a read-back round.
- The read-back, the backstop: the supervisor's rounds read the values back; a difference the log has not already
  explained (it is read first) is counted here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from mpsagent.base.clock import utc
from mpsagent.domain.shares import Ceilings, GpuSlots
from mpsagent.mps.ceiling_watch import CeilingChange, CeilingWatch, NotUnderstood, SentCommands
from mpsagent.mps.commands import CapDifference
from mpsagent.mps.control_log import ControlLogReader, UnknownLine, Verdict, opens_connection
from mpsagent.mps.daemon_log import Chunk, DaemonLog
from mpsagent.mps.daemon_status import CapTamperEvent, ControlLogStatus, SeenBy

TAMPER_EVENT = "mps daemon ceiling changed behind the agent; restoring it"
CONTROL_LOG: SeenBy = "control_log"
READ_BACK: SeenBy = "read_back"

Wake = Callable[[], None]
"""Called when a round should run at once: a change was seen (`take_explained`), or a line not understood."""
Notify = Callable[[], None]


class CeilingGuard:
    def __init__(
        self,
        *,
        log_path: Path,
        gpus: Sequence[GpuSlots],
        log: FilteringBoundLogger,
        forward: bool,
        rotate_bytes: int | None,
        wanted: Callable[[], Ceilings],
        wake: Wake,
        on_connection: Notify = lambda: None,
    ) -> None:
        """`forward`: whether the daemon's log lines go into the agent's log too; `rotate_bytes`: whether (past what
        size) the agent rotates the file, as its daemon's owner; `wanted`: the ceilings the ledger wants now;
        `on_connection`: told when the log shows the daemon accepting a connection or opening a session (the hold
        watch looks who holds its socket)."""
        self._gpus = gpus
        self._log = log
        self._wanted = wanted
        self._wake = wake
        self._on_connection = on_connection
        self._watch = CeilingWatch()
        self._reader = ControlLogReader()
        self._daemon_log = DaemonLog(log_path, log, forward=forward, rotate_bytes=rotate_bytes, reader=self._read)
        self._explained = False
        """A change seen in the log that no round has taken yet: the round sets every ceiling again, and what a
        round reads back of it is not counted again."""
        self.count = 0
        self.in_log = 0
        self.last: tuple[float, str, SeenBy] | None = None
        self.unknown_lines = 0
        self.first_unknown_line: str | None = None

    @property
    def sent(self) -> SentCommands:
        """Where the control channel notes the agent's own ceiling commands."""
        return self._watch.sent

    @property
    def watched(self) -> bool:
        """Whether the daemon's log is followed and understood: every ceiling change is then seen in it."""
        return self._daemon_log.following().followed and self.first_unknown_line is None

    async def run(self) -> None:
        """Follow the daemon's log until cancelled."""
        await self._daemon_log.run()

    def attach(self, daemon: int, *, since: int | None) -> None:
        """Follow and judge the log of the daemon just started or adopted (from offset `since`, else its end)."""
        self._daemon_log.attach(daemon, since=since)
        self._watch.watch(daemon)

    def detach(self) -> None:
        """The daemon is down: nothing of its log is judged until the next one is attached."""
        self._watch.watch(None)

    def take_explained(self) -> bool:
        """Whether a change seen in the log waits for a round to restore it (and no longer, once asked)."""
        explained, self._explained = self._explained, False
        return explained

    def read_back(self, ceilings: Ceilings, differences: Sequence[CapDifference]) -> None:
        """A round read these values back other than the ceilings: counted, unless the log saw them first (it is
        read now, so that a command written before the read-back is judged by it, with its exact figures)."""
        self._daemon_log.poll()
        if self.take_explained() and self.watched:
            return
        for difference in differences:
            self._log.warning(
                TAMPER_EVENT,
                seen_by=READ_BACK,
                value=difference.step.read_back,
                expected=difference.step.expected,
                found=difference.found,
                server=difference.step.server,
                ceilings=ceilings.describe(),
            )
        self.count += len(differences)
        self.last = (time.time(), "; ".join(d.describe() for d in differences), READ_BACK)

    def last_event(self) -> CapTamperEvent | None:
        if self.last is None:
            return None
        return CapTamperEvent(at=utc(self.last[0]), found=self.last[1], seen_by=self.last[2])

    def status(self) -> ControlLogStatus:
        following = self._daemon_log.following()
        return ControlLogStatus(
            file=following.file,
            watched=self.watched,
            problem=following.problem,
            problem_at=None if following.problem_at is None else utc(following.problem_at),
            moves=following.events,
            unknown_lines=self.unknown_lines,
            first_unknown_line=self.first_unknown_line,
        )

    # --- the log ----------------------------------------------------------------------------------------------

    def _read(self, chunk: Chunk) -> None:
        if any(opens_connection(line) for line in chunk.lines):
            self._on_connection()
        if chunk.cut:
            self._wake()  # a command written in the instant before the cut may be in neither file: read back
        for line in chunk.lines:
            for found in self._reader.feed(line):
                if isinstance(found, UnknownLine):
                    self._not_understood(found)
                else:
                    self._judge(found)
        if chunk.at_end and not chunk.lines:
            for verdict in self._reader.settle():
                self._judge(verdict)
        if chunk.at_end and not self._reader.open:
            self._watch.sent.forget_closed_before(chunk.began)

    def _judge(self, verdict: Verdict) -> None:
        found = self._watch.judge(verdict, self._wanted())
        if isinstance(found, CeilingChange):
            self._report(found)
            self._explained = True
            self._wake()
        elif isinstance(found, NotUnderstood):
            self._wake()

    def _report(self, change: CeilingChange) -> None:
        target, ordinal = change.command.target, change.ordinal
        self._log.warning(
            TAMPER_EVENT,
            seen_by=CONTROL_LOG,
            command=change.command.text,
            gpu=self._gpus[ordinal].uuid if ordinal is not None and ordinal < len(self._gpus) else None,
            ordinal=ordinal,
            server=None if target is None else target.server,
            found=change.command.shown(),
            wanted=change.describe_wanted(),
        )
        self.count += 1
        self.in_log += 1
        self.last = (time.time(), change.describe(), CONTROL_LOG)

    def _not_understood(self, unknown: UnknownLine) -> None:
        self.unknown_lines += 1
        if self.first_unknown_line is None:
            self.first_unknown_line = unknown.line
            self._log.warning(
                "mps daemon log line not understood; ceiling changes are checked by reading them back",
                line=unknown.line,
                after=unknown.after,
                hint="the daemon's log format differs from the one the agent knows (driver 535 and 580): report it "
                "with the driver version; the caps are still read back every round, in whole GiB",
            )
