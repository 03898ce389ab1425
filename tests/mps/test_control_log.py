"""The daemon's control.log as the ceiling watch reads it: the lines of the real `nvidia-cuda-mps-control` (535,
driven here) and of driver 580 (measured on an H200, ../shared/hardware/mps-ceilings-h200.md, 2026-12-04) parsed
into ceiling commands and verdicts; the judging of each against the ledger's ceilings, with the agent's own
commands, a root tenant's and a refused user's interleaved at random. Domain code and one real daemon, no agent."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsagent.domain.shares import Ceilings
from mpsagent.mps.ceiling_watch import MAX_SESSIONS, CeilingChange, CeilingWatch, NotUnderstood, SentCommands
from mpsagent.mps.control_log import (
    CeilingKind,
    CeilingTarget,
    ControlLogReader,
    Outcome,
    UnknownLine,
    Verdict,
    ceiling_command,
)
from mpsagent_testing.mps.daemon import plain_daemon, require_real_control, session, sessions_closed
from mpsagent_testing.waiting import wait_for

WANTED = Ceilings(thread_percentage=25, memory_mib=(5461, 5461))
DAEMON = 453


def line(text: str, pid: int = DAEMON, source: str = "Control") -> str:
    return f"[2026-12-04 14:05:16.626 {source} {pid:>5}] {text}"


def verdicts(lines: list[str]) -> list[Verdict | UnknownLine]:
    reader = ControlLogReader()
    found = [v for text in lines for v in reader.feed(text)]
    return found + list(reader.settle())


# --- commands read as the daemon reads them -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "target", "figure", "readable"),
    [
        (
            "set_default_device_pinned_mem_limit 0 5461M",
            CeilingTarget(kind=CeilingKind.DEFAULT_MEMORY, ordinal=0),
            5461,
            True,
        ),
        (
            "set_default_device_pinned_mem_limit 1 5G",
            CeilingTarget(kind=CeilingKind.DEFAULT_MEMORY, ordinal=1),
            5120,
            True,
        ),
        (
            "set_default_device_pinned_mem_limit 0 2048m",
            CeilingTarget(kind=CeilingKind.DEFAULT_MEMORY, ordinal=0),
            2048,
            True,
        ),
        (
            "set_default_device_pinned_mem_limit 0 1024",
            CeilingTarget(kind=CeilingKind.DEFAULT_MEMORY, ordinal=0),
            1024,
            True,
        ),
        (
            "set_default_device_pinned_mem_limit 0 0",
            CeilingTarget(kind=CeilingKind.DEFAULT_MEMORY, ordinal=0),
            None,
            True,
        ),
        # The daemon reads these its own way (5000K is 5000 MiB, 1.5G is 1 MiB, abc is no limit): unreadable.
        (
            "set_default_device_pinned_mem_limit 0 5000K",
            CeilingTarget(kind=CeilingKind.DEFAULT_MEMORY, ordinal=0),
            None,
            False,
        ),
        (
            "set_default_device_pinned_mem_limit 0 abc",
            CeilingTarget(kind=CeilingKind.DEFAULT_MEMORY, ordinal=0),
            None,
            False,
        ),
        ("set_default_device_pinned_mem_limit 0", None, None, False),
        ("set_default_device_pinned_mem_limit x 10M", None, None, False),
        ("set_default_active_thread_percentage 25", CeilingTarget(kind=CeilingKind.DEFAULT_THREADS), 25.0, True),
        ("set_default_active_thread_percentage  25.5", CeilingTarget(kind=CeilingKind.DEFAULT_THREADS), 25.5, True),
        ("set_default_active_thread_percentage 50abc", CeilingTarget(kind=CeilingKind.DEFAULT_THREADS), None, False),
        (
            "set_active_thread_percentage 668 100",
            CeilingTarget(kind=CeilingKind.SERVER_THREADS, server=668),
            100.0,
            True,
        ),
        (
            "set_device_pinned_mem_limit 668 1 8G",
            CeilingTarget(kind=CeilingKind.SERVER_MEMORY, ordinal=1, server=668),
            8192,
            True,
        ),
    ],
)
def test_a_ceiling_command_is_read_as_the_daemon_reads_it(
    text: str, target: CeilingTarget | None, figure: float | None, readable: bool
) -> None:
    command = ceiling_command(text)
    assert command is not None
    assert (command.target, command.figure, command.readable) == (target, figure, readable)


@pytest.mark.parametrize("text", ["get_default_active_thread_percentage", "quit -t 5", "start_server -uid 0", ""])
def test_other_commands_are_no_ceiling_commands(text: str) -> None:
    assert ceiling_command(text) is None


# --- verdicts: the forms of the two drivers -------------------------------------------------------------------


def test_driver_580s_accepted_and_refused_commands_as_measured_on_an_h200() -> None:
    """The control.log excerpt of ../shared/hardware/mps-ceilings-h200.md (driver 580.159.04, 2026-12-04)."""
    log = [
        "[2026-12-04 14:05:16.626 Control   453] Accepting connection...",
        "[2026-12-04 14:05:16.626 Control   453] NEW UI",
        "[2026-12-04 14:05:16.626 Control   453] Cmd:set_default_device_pinned_mem_limit 0 20389M",
        "[2026-12-04 14:05:16.626 Control   453] set_default_device_pinned_mem_limit 0 20389M.",
        "[2026-12-04 14:05:16.626 Control   453] UI closed",
        "[2026-12-04 14:05:19.972 Control   453] NEW CLIENT 651 from user 0: Server is not ready, push client to "
        "pending list",
        "[2026-12-04 14:05:19.972 Control   668] Starting new server 668 for user 0",
        "[2026-12-04 14:05:20.234 Control   453] NEW SERVER 668: Ready",
        "[2026-12-04 14:05:20.884 Control   453] Cmd:shutdown_server 668",
        "[2026-12-04 14:05:20.968 Control   453] Server 668 exited with status 0",
        "[2026-12-04 14:05:21.888 Control   453] NEW UI",
        "[2026-12-04 14:05:21.888 Control   453] Cmd:set_default_device_pinned_mem_limit 0 5120M",
        "[2026-12-04 14:05:21.888 Control   453] set_default_device_pinned_mem_limit 0 5120M.",
        "[2026-12-04 14:05:21.888 Control   453] Insufficient privileges for UID 65534. Control deamon settings can "
        "only be modified by the user who started it or by the root user.",
        "[2026-12-04 14:05:21.888 Control   453] UI closed",
        "[2026-12-04 14:05:21.890 Control   453] NEW UI",
        "[2026-12-04 14:05:21.890 Control   453] Cmd:set_default_active_thread_percentage 77",
        "[2026-12-04 14:05:21.890 Control   453] Insufficient privileges for UID 65534. Control deamon settings can "
        "only be modified by the user who started it or by the root user.",
        "[2026-12-04 14:05:21.890 Control   453] UI closed",
    ]
    found = verdicts(log)
    assert [(v.command.text, v.outcome) for v in found if isinstance(v, Verdict)] == [
        ("set_default_device_pinned_mem_limit 0 20389M", Outcome.ACCEPTED),
        ("set_default_device_pinned_mem_limit 0 5120M", Outcome.REFUSED),
        ("set_default_active_thread_percentage 77", Outcome.REFUSED),
    ]
    assert all(isinstance(v, Verdict) and v.daemon == DAEMON for v in found)


def test_a_command_whose_answer_is_not_understood_is_unknown_and_its_line_reported() -> None:
    found = verdicts(
        [
            line("NEW UI"),
            line("Cmd:set_default_active_thread_percentage 30"),
            line("Threads are now 30"),
            line("UI closed"),
        ]
    )
    assert [type(v) for v in found] == [Verdict, UnknownLine]
    verdict, unknown = found
    assert isinstance(verdict, Verdict) and verdict.outcome is Outcome.UNKNOWN
    assert isinstance(unknown, UnknownLine) and unknown.line.endswith("Threads are now 30")
    assert unknown.after == "set_default_active_thread_percentage 30"


def test_a_session_held_open_after_a_set_is_accepted_once_the_log_is_quiet() -> None:
    reader = ControlLogReader()
    assert reader.feed(line("NEW UI")) == []
    assert reader.feed(line("Cmd:set_default_device_pinned_mem_limit 0 9000M")) == []
    assert reader.open
    (settled,) = reader.settle()
    assert settled.outcome is Outcome.ACCEPTED and not reader.open


def test_lines_of_other_processes_and_stray_text_answer_no_command() -> None:
    """A server's own lines (another PID) and text that is no daemon line (stderr) do not decide a command."""
    found = verdicts(
        [
            line("Cmd:set_default_active_thread_percentage 40"),
            line("Starting new server 700 for user 0", pid=700),
            "some stray text on stderr",
            line("Invalid percentage, expected between (0.0, 100.0]"),
        ]
    )
    assert [(v.command.text, v.outcome) for v in found if isinstance(v, Verdict)] == [
        ("set_default_active_thread_percentage 40", Outcome.REFUSED)
    ]


def test_the_real_daemons_log_reads_as_the_commands_sent(short_dir: Path) -> None:
    """Debian's 535 daemon, driven through its front-end: every line after a ceiling command is understood, the
    accepted commands are accepted, the refused ones refused."""
    require_real_control()
    sessions = [
        "set_default_active_thread_percentage 25\nset_default_device_pinned_mem_limit 0 5461M\n"
        "get_default_device_pinned_mem_limit 0\n",
        "set_default_device_pinned_mem_limit 1 0\nget_default_device_pinned_mem_limit 1\nget_server_list\n",
        "set_default_active_thread_percentage 101\nset_active_thread_percentage 4242 50\n",
        "set_device_pinned_mem_limit 4242 0 100M\nget_default_active_thread_percentage\n",
        "set_default_active_thread_percentage 30\n",
    ]
    with plain_daemon(short_dir) as (pipe, daemon):
        log = short_dir / "log" / "control.log"
        for text in sessions:
            assert session(pipe, text).returncode == 0, text
        last = sessions[-1].splitlines()[-1]
        wait_for(lambda: sessions_closed(log, last), what="every session in the log")
        found = verdicts(log.read_text().splitlines())
    assert [(v.daemon, v.command.text, v.outcome) for v in found if isinstance(v, Verdict)] == [
        (daemon.pid, "set_default_active_thread_percentage 25", Outcome.ACCEPTED),
        (daemon.pid, "set_default_device_pinned_mem_limit 0 5461M", Outcome.ACCEPTED),
        (daemon.pid, "set_default_device_pinned_mem_limit 1 0", Outcome.ACCEPTED),
        (daemon.pid, "set_default_active_thread_percentage 101", Outcome.REFUSED),
        (daemon.pid, "set_active_thread_percentage 4242 50", Outcome.REFUSED),
        (daemon.pid, "set_device_pinned_mem_limit 4242 0 100M", Outcome.REFUSED),
        (daemon.pid, "set_default_active_thread_percentage 30", Outcome.ACCEPTED),
    ]
    assert not [v for v in found if isinstance(v, UnknownLine)]


# --- judging ------------------------------------------------------------------------------------------------


def judged(watch: CeilingWatch, lines: list[str], wanted: Ceilings = WANTED) -> list[CeilingChange | NotUnderstood]:
    return [j for v in verdicts(lines) if isinstance(v, Verdict) if (j := watch.judge(v, wanted)) is not None]


def watching() -> CeilingWatch:
    watch = CeilingWatch()
    watch.watch(DAEMON)
    return watch


@pytest.mark.parametrize(
    ("command", "described"),
    [
        (
            "set_default_device_pinned_mem_limit 0 5120M",
            "`set_default_device_pinned_mem_limit 0 5120M` set the default pinned memory limit of ordinal 0 to "
            "5120 MiB; the ledger wants 5461 MiB",
        ),
        (
            "set_default_device_pinned_mem_limit 0 6143M",
            "`set_default_device_pinned_mem_limit 0 6143M` set the default pinned memory limit of ordinal 0 to "
            "6143 MiB; the ledger wants 5461 MiB",
        ),
        (
            "set_default_device_pinned_mem_limit 1 0",
            "`set_default_device_pinned_mem_limit 1 0` set the default pinned memory limit of ordinal 1 to no "
            "limit; the ledger wants 5461 MiB",
        ),
        (
            "set_active_thread_percentage 668 100",
            "`set_active_thread_percentage 668 100` set server 668's active thread percentage to 100 %; the ledger "
            "wants 25 %",
        ),
        (
            "set_default_device_pinned_mem_limit 0 abc",
            "`set_default_device_pinned_mem_limit 0 abc` set the default pinned memory limit of ordinal 0 to a "
            "figure the agent cannot read; the ledger wants 5461 MiB",
        ),
    ],
)
def test_a_tenants_change_of_any_size_is_a_change_that_names_the_figures(command: str, described: str) -> None:
    (change,) = judged(watching(), [line("NEW UI"), line(f"Cmd:{command}"), line("UI closed")])
    assert isinstance(change, CeilingChange)
    assert change.describe() == described


def test_what_the_ledger_wants_or_what_the_daemon_holds_already_is_no_change() -> None:
    watch = watching()
    same = [line(f"Cmd:set_default_device_pinned_mem_limit 0 {mib}") for mib in ("5461M", "5461")]
    assert judged(watch, same) == []
    lifted = [line("Cmd:set_default_active_thread_percentage 100"), line("100.0")]
    assert len(judged(watch, lifted)) == 1
    assert judged(watch, lifted) == []  # again: the daemon holds 100 already (the first is being restored)


def test_another_daemons_lines_and_ordinals_outside_the_resource_are_not_judged() -> None:
    watch = watching()
    assert (
        judged(watch, [line("Cmd:set_default_active_thread_percentage 100", pid=999), line("UI closed", pid=999)]) == []
    )
    assert judged(watch, [line("Cmd:set_default_device_pinned_mem_limit 7 100M"), line("UI closed")]) == []
    watch.watch(None)  # the daemon is down: nothing is judged
    assert judged(watch, [line("Cmd:set_default_active_thread_percentage 100"), line("UI closed")]) == []


def test_an_answer_not_understood_asks_for_the_read_back() -> None:
    (found,) = judged(watching(), [line("Cmd:set_default_active_thread_percentage 30"), line("Threads: 30")])
    assert isinstance(found, NotUnderstood)


def test_the_agents_own_commands_are_its_own_until_the_log_showed_them_once() -> None:
    watch = watching()
    session = watch.sent.opened(["set_default_active_thread_percentage 50", "get_default_active_thread_percentage"])
    watch.sent.closed(session, at=1.0)
    own = [line("Cmd:set_default_active_thread_percentage 50"), line("50.0")]
    assert judged(watch, own) == []
    assert len(watch.sent) == 0
    assert len(judged(watch, [line("Cmd:set_default_active_thread_percentage 60")])) == 1


def test_a_command_the_log_never_showed_is_forgotten_once_read_to_the_end_after_its_session() -> None:
    """A session that failed before the daemon read it: its note must not let a tenant pass for the agent later."""
    sent = SentCommands()
    session = sent.opened(["set_default_active_thread_percentage 100"])
    sent.forget_closed_before(5.0)
    assert len(sent) == 1  # still open: kept
    sent.closed(session, at=6.0)
    sent.forget_closed_before(5.0)
    assert len(sent) == 1  # closed after that read began: kept
    sent.forget_closed_before(7.0)
    assert len(sent) == 0
    assert sent.claim("set_default_active_thread_percentage 100") is False


def test_what_the_agent_sent_is_bounded_while_the_log_cannot_be_read() -> None:
    """A log the agent cannot follow forgets nothing by being read: the oldest closed sessions go instead."""
    sent = SentCommands()
    for percentage in range(1, 1001):
        session = sent.opened([f"set_default_active_thread_percentage {percentage % 100 + 1}"])
        sent.closed(session, at=float(percentage))
    assert len(sent) == MAX_SESSIONS


# --- agent, root tenant and refused user, interleaved -----------------------------------------------------------

THREADS = CeilingTarget(kind=CeilingKind.DEFAULT_THREADS)
MEMORY0 = CeilingTarget(kind=CeilingKind.DEFAULT_MEMORY, ordinal=0)
CEILINGS = [
    Ceilings(thread_percentage=25, memory_mib=(5461,)),
    Ceilings(thread_percentage=50, memory_mib=(10922,)),
    Ceilings(thread_percentage=100, memory_mib=(16384,)),
]


def agent_commands(ceilings: Ceilings) -> list[str]:
    return [
        f"set_default_active_thread_percentage {ceilings.thread_percentage}",
        f"set_default_device_pinned_mem_limit 0 {ceilings.memory_mib[0]}M",
    ]


@dataclass(kw_only=True)
class Simulation:
    """The daemon's log as a list of lines written; the agent's watch reading it in chunks; the truth of what the
    daemon holds, and of which tenant commands changed a ceiling away from the ledger's wish."""

    driver: int
    watch: CeilingWatch = field(default_factory=watching)
    reader: ControlLogReader = field(default_factory=ControlLogReader)
    written: list[str] = field(default_factory=list)
    read: int = 0
    clock: float = 0.0
    wanted: Ceilings = CEILINGS[0]
    holds: dict[CeilingTarget, float | int | None] = field(default_factory=dict)
    expected: int = 0
    changes: list[CeilingChange] = field(default_factory=list)

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def command_lines(self, command: str, *, refused: bool) -> list[str]:
        lines = [line(f"Cmd:{command}")]
        if self.driver == 580:
            lines.append(line(f"{command}."))
        elif command.startswith("set_default_active_thread_percentage"):
            lines.append(line(f"{float(command.rsplit(maxsplit=1)[-1]):.1f}"))
        if refused:
            lines.append(line("Insufficient privileges for UID 65534. Control deamon settings can only be modified"))
        return lines

    def session(self, commands: list[str], *, refused: bool = False) -> list[str]:
        return (
            [line("NEW UI")]
            + [t for c in commands for t in self.command_lines(c, refused=refused)]
            + [line("UI closed")]
        )

    def daemon_takes(self, command: str) -> None:
        parsed = ceiling_command(command)
        assert parsed is not None and parsed.target is not None
        self.holds[parsed.target] = parsed.figure

    def agent(self, *, tenant_same_instant: bool = False) -> None:
        """The agent sets the wanted ceilings; a root tenant may send the agent's first command in the same
        instant."""
        commands = agent_commands(self.wanted)
        noted = self.watch.sent.opened([*commands, "get_default_active_thread_percentage"])
        if tenant_same_instant:
            self.written += self.session(commands[:1])
            self.daemon_takes(commands[0])
        self.written += self.session([*commands, "get_default_active_thread_percentage"])
        for command in commands:
            self.daemon_takes(command)
        self.watch.sent.closed(noted, self.tick())

    def tenant(self, command: str, *, refused: bool) -> None:
        parsed = ceiling_command(command)
        assert parsed is not None and parsed.target is not None
        if not refused:
            target = parsed.target
            want = self.wanted.thread_percentage if target == THREADS else self.wanted.memory_mib[0]
            if parsed.figure != want and parsed.figure != self.holds.get(target, "unseen"):
                self.expected += 1
            self.daemon_takes(command)
        self.written += self.session([command], refused=refused)

    def read_to(self, end: int) -> None:
        """One poll that reads the log up to line `end` (or finds nothing new, and settles)."""
        began = self.tick()
        chunk, self.read = self.written[self.read : end], end
        verdicts_found: list[Verdict] = []
        for text in chunk:
            verdicts_found += [v for v in self.reader.feed(text) if isinstance(v, Verdict)]
        at_end = self.read == len(self.written)
        if at_end and not chunk:
            verdicts_found += self.reader.settle()
        for verdict in verdicts_found:
            found = self.watch.judge(verdict, self.wanted)
            assert not isinstance(found, NotUnderstood)
            if found is not None:
                self.changes.append(found)
        if at_end and not self.reader.open:
            self.watch.sent.forget_closed_before(began)

    def drain(self, data: st.DataObject) -> None:
        """Read what was written, in polls that end anywhere, then one that finds nothing (quiet)."""
        while self.read < len(self.written):
            self.read_to(data.draw(st.integers(self.read + 1, len(self.written))))
        self.read_to(len(self.written))

    def restore(self) -> None:
        """What the supervisor does when the watch finds a change: sets the wanted ceilings again."""
        self.agent()


_tenant_commands = st.one_of(
    st.sampled_from([25, 50, 100, 10, 33]).map(lambda p: f"set_default_active_thread_percentage {p}"),
    st.sampled_from([5461, 5120, 6143, 10922, 16384, 0]).map(lambda m: f"set_default_device_pinned_mem_limit 0 {m}M"),
)
_steps = st.one_of(
    st.tuples(st.just("wish"), st.sampled_from(range(len(CEILINGS))), st.just(False)),
    st.tuples(st.just("agent"), st.just(""), st.booleans()),
    st.tuples(st.just("tenant"), _tenant_commands, st.just(False)),
    st.tuples(st.just("refused"), _tenant_commands, st.just(True)),
    st.tuples(st.just("read"), st.just(""), st.just(False)),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_steps, max_size=25), driver=st.sampled_from([535, 580]), data=st.data())
def test_only_a_tenants_accepted_change_is_counted_whoever_writes_when(
    steps: list[tuple[str, object, bool]], driver: int, data: st.DataObject
) -> None:
    """The agent's own commands (also when the log is read after the ledger has moved on, and when a root tenant
    sends one of them in the same instant) and a refused user's are never counted; each command of a root tenant
    that the daemon accepted and that moved a ceiling away from both the ledger's wish and what the daemon held is
    counted once. The ledger's wish may move ahead of the commands that carry it out (`wish`, then `agent`); a
    tenant's command is read before the wish moves again (the log is read every 0.2 s)."""
    sim = Simulation(driver=driver)
    for kind, value, flag in steps:
        if kind == "wish":
            assert isinstance(value, int)
            sim.wanted = CEILINGS[value]
        elif kind == "agent":
            sim.agent(tenant_same_instant=flag)
        elif kind in ("tenant", "refused"):
            assert isinstance(value, str)
            before = len(sim.changes)
            sim.tenant(value, refused=flag)
            sim.drain(data)
            if len(sim.changes) > before:
                sim.restore()
        else:
            sim.drain(data)
    sim.drain(data)
    assert len(sim.changes) == sim.expected
