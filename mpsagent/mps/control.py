"""The control-command channel: `nvidia-cuda-mps-control` front-end sessions, serialized, each with a timeout.
Commands are checked before they are written, so nothing can inject another command line.

A session may carry several commands: the front-end prints the replies in order when its stdin ends. A `get_`
command prints one line, or nothing for a limit that is not set (0: no ceiling) or a server that is not ready;
a batch of `get_` commands whose line count does not match is asked again command by command, to know which
printed nothing. A batch of `set_` commands is only checked for failures. A cap switch on 8 GPUs is then 2
sessions, not 18, and a liveness round that finds everything as it should be is one.

While any session is open (one of another process: an administrator at the prompt, a root process in a client
container, the daemon host's), the daemon refuses every other one: it closes it unanswered, and the front-end
prints "Cannot send command to MPS control daemon process", or nothing at all. Every session but `quit` therefore
ends with a command that always prints a line, so that an unanswered session shows. A refusal from a daemon that
still greets a connection (mps.liveness) is busy, not failed: the session is asked again, with backoff, until
BUSY_WAIT_S after the episode's first refusal, then DaemonBusyError.

Failing to run the front-end at all (ControlRunError) is the agent's failure; a front-end that runs but gets no
answer or a refusal (DaemonCommandError) is the daemon's; a busy daemon (DaemonBusyError) is nobody's."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from mpsagent.base.backoff import Backoff
from mpsagent.base.errors import ControlRunError, DaemonBusyError, DaemonCommandError, DaemonError
from mpsagent.mps.ceiling_watch import SentCommands
from mpsagent.mps.commands import ControlStep
from mpsagent.mps.liveness import Liveness, greeting

COMMAND_TIMEOUT_S = 5.0
_SAFE_COMMAND = re.compile(r"[a-z_]+( [A-Za-z0-9.=,-]+)*")
# What the front-end prints when it cannot reach a daemon, or the daemon refuses the command.
_FAILURE_MARKERS = ("Cannot find MPS control daemon", "Cannot send command", "Unknown command", "Invalid", "failed")
# What `get_server_list` prints: PIDs, one a line (or several on one line); no cap value looks like this.
_SERVER_LIST_LINE = re.compile(r"\d+( \d+)*")
# What a `get_` about a server that has just exited prints: the server is gone, its values with it.
_SERVER_GONE = re.compile(r"Server \d+ not found")
MULTI_USER_OPTION = "--multiuser-server"
HELP_TIMEOUT_S = 5.0
# What the front-end prints, about three times in four, when the daemon closed its session unanswered: another
# session is open, or it died. The fourth time it prints nothing at all, with exit status 0.
_BUSY_MARKER = "Cannot send command"
# Ends every session but `quit`: it always prints a line, so a session that printed nothing went unanswered.
_ANSWER_CHECK = "get_default_active_thread_percentage"
BUSY_WAIT_S = 3.0
"""How long after a busy episode's first refusal (no session answered since) a session is asked again; a session
begun later in the episode is asked once. An RPC that needs the daemon waits at most this long for it."""
_BUSY_RETRY_INITIAL_S = 0.02
_BUSY_RETRY_MAX_S = 0.5
_BUSY_GREETING_TIMEOUT_S = 1.0


def check_command(command: str) -> str:
    if not _SAFE_COMMAND.fullmatch(command) or len(command) > 512:
        raise DaemonCommandError(f"refusing to send malformed MPS control command {command[:80]!r}")
    return command


def _cannot_run(control_bin: str, exc: OSError) -> ControlRunError:
    if isinstance(exc, FileNotFoundError | PermissionError):
        advice = "install nvidia-cuda-mps or set --mps-control-bin"
    else:  # EMFILE, ENFILE, ENOMEM, EAGAIN: the agent is short of something, the binary is fine
        advice = "the agent is short of file descriptors or memory: raise its open-file limit (LimitNOFILE) or memory"
    return ControlRunError(f"cannot run {control_bin} ({exc.strerror}); {advice}")


class ControlChannel:
    """Talks to the control daemon listening on one pipe directory."""

    def __init__(
        self,
        control_bin: str,
        pipe_directory: Path,
        timeout_s: float = COMMAND_TIMEOUT_S,
        *,
        sent: SentCommands | None = None,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        """`sent`: where each session's ceiling commands are noted before it opens, so that the daemon's log can
        tell them from a tenant's (the daemon supervisor's ceiling watch); `on_refused`: told of each session the
        daemon refuses because another is open (the hold watch looks for who holds it)."""
        self._bin = control_bin
        self._sent = sent
        self._pipe = pipe_directory
        self._env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_directory)}
        self._timeout = timeout_s
        self._on_refused = on_refused
        # The daemon refuses a session while another is open: the agent's own take turns.
        self._lock = anyio.Lock()
        self._busy_since: float | None = None
        """When (monotonic) the daemon first refused a session as busy, none answered since; None: not busy."""

    async def send(self, command: str) -> str:
        """Send one command; returns the daemon's reply (stripped), raises DaemonCommandError on any failure."""
        return await self.send_all([command])

    async def send_all(self, commands: Sequence[str]) -> str:
        """Send commands in one session; returns all replies (stripped). Raises DaemonCommandError on any failure,
        DaemonBusyError when another session kept the daemon busy for the whole wait (nothing was sent)."""
        what = f"`{commands[0]}`" + (f" and {len(commands) - 1} more" if len(commands) > 1 else "")
        reply = await self._send([*commands, _ANSWER_CHECK], what, checked=True)
        return reply.rpartition("\n")[0].rstrip()  # without the check's own line

    async def quit(self, timeout_s: int) -> None:
        """Ask the daemon to quit, giving its clients `timeout_s` to finish; raises DaemonError when it cannot be
        asked. (No answer check: a quitting daemon answers no more.)"""
        await self._send([f"quit -t {timeout_s}"], "`quit`", checked=False)

    async def _send(self, commands: Sequence[str], what: str, *, checked: bool) -> str:
        for command in commands:
            check_command(command)
        async with self._lock:
            noted = None if self._sent is None else self._sent.opened(commands)
            try:
                returncode, reply = await self._answered_session(commands, what, checked=checked)
            finally:
                if self._sent is not None:
                    self._sent.closed(noted, time.monotonic())
        if returncode != 0 or any(marker in reply for marker in _FAILURE_MARKERS):
            raise DaemonCommandError(f"{what} failed: {reply or f'exit status {returncode}'}")
        return reply

    async def _answered_session(self, commands: Sequence[str], what: str, *, checked: bool) -> tuple[int, str]:
        """A session the daemon did not refuse; one refused while the daemon greets (another session is open) is
        asked again, with backoff, until BUSY_WAIT_S after the busy episode's first refusal. `checked`: the last
        command always prints, so a session that printed nothing was refused too."""
        retry = Backoff(_BUSY_RETRY_INITIAL_S, _BUSY_RETRY_MAX_S)
        while True:
            returncode, reply = await self._session(commands, what)
            if _BUSY_MARKER not in reply and (reply or not checked):
                self._busy_since = None
                return returncode, reply
            if await greeting(self._pipe, _BUSY_GREETING_TIMEOUT_S) is not Liveness.ANSWERS:
                raise DaemonCommandError(
                    f"{what} got no answer: {reply or 'the daemon closed the session unanswered'}, and it greets no "
                    f"connection to {self._pipe}"
                )
            now = time.monotonic()
            self._busy_since = now if self._busy_since is None else self._busy_since
            self._on_refused()
            waited = now - self._busy_since
            if waited >= BUSY_WAIT_S:
                raise DaemonBusyError(
                    f"{what} not sent: the MPS control daemon on {self._pipe} is busy, refusing every session for "
                    f"{waited:.1f}s because another control session is open (an administrator at the "
                    "nvidia-cuda-mps-control prompt, or a root process with the pipe directory); close that session"
                )
            await anyio.sleep(min(retry.delay, BUSY_WAIT_S - waited))
            retry.grow()

    async def _session(self, commands: Sequence[str], what: str) -> tuple[int, str]:
        """One front-end session, bounded; its exit status and what it printed (stripped)."""
        try:
            with anyio.fail_after(self._timeout):
                returncode, output = await self._exchange(commands)
        except TimeoutError:
            raise DaemonCommandError(f"{what} got no answer within {self._timeout:g}s") from None
        except OSError as exc:
            raise _cannot_run(self._bin, exc) from exc
        return returncode, output.decode(errors="replace").strip()

    async def _exchange(self, commands: Sequence[str]) -> tuple[int, bytes]:
        """One front-end session: the commands on stdin, then EOF; the replies are whatever it prints until it
        exits (on a pipe it holds them until EOF)."""
        async with await anyio.open_process(
            [self._bin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env
        ) as process:
            assert process.stdin is not None and process.stdout is not None
            # A front-end that finds no daemon exits before reading: its closed stdin is an answer, not an error.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await process.stdin.send("".join(f"{command}\n" for command in commands).encode())
            await process.stdin.aclose()
            output = b"".join([chunk async for chunk in process.stdout])
            return await process.wait(), output

    async def read(self, read_backs: Sequence[str]) -> list[str | None]:
        """Each `get_` command's reply, None where it printed nothing (or its server is gone)."""
        return await self._values(read_backs, (await self.send_all(read_backs)).splitlines())

    async def read_with_servers(self, read_backs: Sequence[str]) -> tuple[list[str | None], list[int]]:
        """The replies to `read_backs` and the running servers' PIDs, in one session."""
        lines = (await self.send_all(["get_server_list", *read_backs])).splitlines()
        listed = 0
        while listed < len(lines) and _SERVER_LIST_LINE.fullmatch(lines[listed].strip()):
            listed += 1
        servers = [int(token) for line in lines[:listed] for token in line.split()]
        return await self._values(read_backs, lines[listed:]), servers

    async def _values(self, read_backs: Sequence[str], lines: list[str]) -> list[str | None]:
        if len(lines) != len(read_backs):
            # Something printed nothing: only asking one by one tells which (and is only needed when it happens).
            lines = [await self.send(command) for command in read_backs]
        return [None if not line.strip() or _SERVER_GONE.fullmatch(line.strip()) else line.strip() for line in lines]

    async def apply(self, steps: Sequence[ControlStep]) -> None:
        """Send the `set_` commands, then read each back: the daemon must hold exactly what was asked for."""
        await self.send_all([step.command for step in steps])
        await self.check_held(steps)

    async def check_held(self, steps: Sequence[ControlStep]) -> None:
        """Read each step's value back; raises DaemonCommandError naming the first that is not what it set."""
        _compare(steps, await self.read([step.read_back for step in steps]))

    async def check_held_with_servers(self, steps: Sequence[ControlStep]) -> list[int]:
        """`check_held`, and the running servers' PIDs, in one session."""
        values, servers = await self.read_with_servers([step.read_back for step in steps])
        _compare(steps, values)
        return servers

    async def apply_with_servers(self, steps: Sequence[ControlStep]) -> list[int]:
        """`apply` and the running servers' PIDs, in one session (one front-end process on a prepare's path instead
        of two): the `set_` commands, their read-backs, then `get_server_list`. A `set_` may or may not print its
        value (driver builds differ), so the replies are read from the end: the trailing PID lines are the servers,
        the lines before them the read-backs. Where that does not add up (or a value differs), a session of its own
        reads them back before anything is called wrong. Raises DaemonBusyError when nothing was sent."""
        read_backs = [step.read_back for step in steps]
        lines = (await self.send_all([*(step.command for step in steps), *read_backs, "get_server_list"])).splitlines()
        listed = len(lines)
        while listed > 0 and _SERVER_LIST_LINE.fullmatch(lines[listed - 1].strip()):
            listed -= 1
        values = [line.strip() for line in lines[listed - len(read_backs) : listed]]
        if listed >= len(read_backs) and values == [step.expected for step in steps]:
            return [int(token) for line in lines[listed:] for token in line.split()]
        return await self.check_held_with_servers(steps)

    async def refusing(self) -> bool | None:
        """Whether the daemon refuses sessions now because another one is open: True when it refused the agent's
        last session and none was answered since; otherwise one session asks, not again. None when that cannot be
        told: the agent's own session is in flight (its outcome will tell), or the daemon did not answer at all."""
        if self._busy_since is not None:
            return True
        if self._lock.locked():
            return None
        async with self._lock:
            try:
                _, reply = await self._session([_ANSWER_CHECK], "the refusal check")
            except DaemonError:
                return None
        if reply and _BUSY_MARKER not in reply:
            return False
        return await greeting(self._pipe, _BUSY_GREETING_TIMEOUT_S) is Liveness.ANSWERS

    async def probe(self, attempts: int = 2) -> bool:
        """True when the daemon answers a round trip, or refuses it only because another session is open (it lives);
        a failed probe is retried before the daemon is called dead. Raises ControlRunError when the agent cannot
        run the front-end: that is no answer about the daemon."""
        for _ in range(attempts):
            try:
                await self.send("get_default_active_thread_percentage")
            except DaemonBusyError:
                return True
            except DaemonCommandError:  # not ControlRunError: that is no answer about the daemon
                continue
            return True
        return False


def _compare(steps: Sequence[ControlStep], values: Sequence[str | None]) -> None:
    for step, held in zip(steps, values, strict=True):
        if held != step.expected:
            raise DaemonCommandError(
                f"`{step.command}` did not hold: `{step.read_back}` reads "
                f"{'nothing' if held is None else repr(held)}, expected {step.expected!r}"
            )


def offers_multi_user(control_bin: str) -> bool | None:
    """Whether the control binary's `-h` lists `--multiuser-server` (one MPS server for every user); None when it
    cannot be run, or does not answer."""
    try:
        result = subprocess.run(
            [control_bin, "-h"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=HELP_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return MULTI_USER_OPTION in (result.stdout + result.stderr).decode(errors="replace")
