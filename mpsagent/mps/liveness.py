"""The MPS control daemon's liveness, asked without a front-end session: whether its process lives, whether its
control socket greets a connection, and when it does not, why (`check`). The daemon supervisor and the daemon host's
keeper judge the daemon from this alone, and the control channel asks it to tell a busy daemon from a failed one.

The daemon speaks first: it accepts a connection on `<pipe>/control` and sends a hello before it reads anything
(libcuda connects, reads the hello and disconnects the same way to find a daemon). It greets while another
session is open, when it refuses every other session ("Cannot send command to MPS control daemon process"); a
stopped or hung daemon does not. Closing right after the hello never opens a session, so the check collides with
no one's commands, takes no lock and never waits behind queued RPC work.

A daemon that greets no connection is not always hung: it reads each new connection's credentials with no timeout,
so any process with the pipe directory that connects and sends nothing (any tenant: `control` is mode 0666) holds
it for everyone, for as long as it likes. That daemon waits in a read on one of its accepted control connections
(`control_socket.activity`): it is **held**, and restarting it would end every client for one tenant's connection.
A daemon stopped under a debugger is left to it. Only a daemon that greets nothing for neither reason is hung.
"""

from __future__ import annotations

import enum
import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import anyio
from structlog.typing import FilteringBoundLogger

from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import ControlRunError, ControlSocketAccessError
from mpsagent.mps import control_socket
from mpsagent.mps.control_socket import CONTROL_SOCKETS, ControlConnection

GREETING_TIMEOUT_S = 0.5
"""A daemon that has not greeted a connection this long after it was made missed one: it greets in well under a
millisecond whenever it runs (so that a hung daemon is seen within the probe interval and a second)."""
HUNG_AFTER_MISSES = 2
"""Misses in a row, the second asked at once, before a daemon that is neither held nor stopped counts as hung."""
_CONNECT_RETRY_S = 0.05
BUSY_HINT = (
    "another control session is open on the daemon's pipe directory: an administrator at the nvidia-cuda-mps-control "
    "prompt, or a root process in a client container (`pgrep -a nvidia-cuda-mps-control` lists every front-end "
    "beside the daemon's `-f`); the daemon and its clients are fine and nothing is killed, but a cap switch "
    "(Allocate, PreStartContainer) fails UNAVAILABLE until that session closes"
)
_REFUSED = {
    errno.ECONNREFUSED,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.ENOTSOCK,
    errno.EPROTOTYPE,
    errno.ECONNRESET,
    errno.EACCES,  # root's socket, to an agent that is not root
    errno.EPERM,
}


class Liveness(enum.Enum):
    ANSWERS = "answers"
    """The daemon greeted a connection: it lives, whether or not another session keeps it busy."""
    SILENT = "silent"
    """A connection was made (or queued) but no greeting came within the timeout: stopped or hung."""
    REFUSED = "refused"
    """No socket, nobody listening on it, or a connection closed without a greeting."""


def process_gone(pid: int) -> bool:
    """Whether the process has exited: no such PID, or a zombie that nobody has reaped yet (where /proc shows it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: it exists
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc here, or gone meanwhile (the next check sees it)
        return False
    return stat[stat.rfind(")") + 2 :].startswith(("Z", "X"))


async def greeting(pipe_directory: Path, timeout_s: float = GREETING_TIMEOUT_S) -> Liveness:
    """Connect to the daemon's control socket and wait for its hello, closing at once either way; on a refusal, to
    root's socket, as the front-end falls back. Raises ControlRunError when the agent cannot even make a socket
    (out of descriptors): that is no answer about the daemon."""
    found = Liveness.REFUSED
    with anyio.move_on_after(timeout_s):
        for name in CONTROL_SOCKETS:
            found = await _greeting_on(pipe_directory / name)
            if found is not Liveness.REFUSED:
                break
        return found
    return Liveness.SILENT


async def _greeting_on(path: Path) -> Liveness:
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    except OSError as exc:
        raise ControlRunError(
            f"cannot open a socket to ask the MPS control daemon ({exc.strerror}); the agent is short of file "
            "descriptors or memory: raise its open-file limit (LimitNOFILE) or memory"
        ) from exc
    with sock:
        sock.setblocking(False)
        while True:
            try:
                sock.connect(str(path))
                break
            except BlockingIOError:  # its backlog is full: it accepts nothing, or not yet
                await anyio.sleep(_CONNECT_RETRY_S)
            except OSError as exc:
                if exc.errno in _REFUSED:
                    return Liveness.REFUSED
                raise ControlRunError(f"cannot connect to {path} ({exc.strerror})") from exc
        await anyio.wait_readable(sock)
        try:
            hello = sock.recv(64)
        except OSError:
            return Liveness.REFUSED
        return Liveness.ANSWERS if hello else Liveness.REFUSED


class State(enum.Enum):
    ANSWERS = "answers"
    """It greeted a connection: it lives, whether or not another session keeps it busy."""
    HELD = "held"
    """It greets nothing because it waits for the credentials of a connection to its control socket that sends
    nothing: held by that connection's process, not hung; never restarted for it (`hold_watch` ends it)."""
    DEBUGGED = "debugged"
    """Stopped under a debugger: whoever attached it lets it go; never restarted for it."""
    UNTOLD = "untold"
    """It greets nothing, and the agent cannot look into its process to tell held from hung: never restarted,
    since that would end every client for what may be one tenant's connection."""
    HUNG = "hung"
    """It greets nothing: stopped by a signal, its sockets gone, or for no reason the agent can see."""
    GONE = "gone"
    """Its process exited."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """What one liveness check found, and in words why a daemon that greets nothing does not."""

    state: State
    reason: str = ""
    holder: ControlConnection | None = None
    """For HELD: the connection the daemon waits on."""

    @property
    def answers(self) -> bool:
        """Whether it serves connections: it greets, or only one silent connection keeps it (held)."""
        return self.state in (State.ANSWERS, State.HELD)


_ANSWERS = Check(state=State.ANSWERS)


def _unexplained(pipe_directory: Path, pid: int) -> Check | None:
    """Why a daemon that greeted no connection does not: stopped, debugged, held; None when its process shows no
    reason (it is hung), UNTOLD when the agent cannot look."""
    try:
        doing = control_socket.activity(pid)
        if doing is None:
            return Check(state=State.GONE, reason=f"its process {pid} is gone")
        if doing.traced:
            return Check(state=State.DEBUGGED, reason=f"its process {pid} is stopped under a debugger")
        if doing.stopped:
            return Check(state=State.HUNG, reason=f"its process {pid} is stopped (SIGSTOP)")
        if doing.reading_fd is None:
            return None
        held = [c for c in control_socket.connections(pid, pipe_directory) if c.fd == doing.reading_fd]
    except ControlSocketAccessError as exc:
        return Check(state=State.UNTOLD, reason=f"it greets no connection, and {exc}")
    if not held:
        return None
    return Check(
        state=State.HELD,
        reason=f"it waits for the first bytes of a connection to its `{held[0].socket}` socket that sends nothing",
        holder=held[0],
    )


async def check(
    pipe_directory: Path, pid: int, *, timeout_s: float = GREETING_TIMEOUT_S, misses: int = HUNG_AFTER_MISSES
) -> Check:
    """Whether the daemon greets a connection (`misses` tries in a row, each within `timeout_s`), and when it does
    not, why: held by a silent connection, stopped, debugged, gone, or hung. Raises ControlRunError when the agent
    cannot ask (that is no answer about the daemon)."""
    found = Liveness.ANSWERS
    for _ in range(misses):
        if process_gone(pid):
            return Check(state=State.GONE, reason=f"its process {pid} is gone")
        found = await greeting(pipe_directory, timeout_s)
        if found is Liveness.ANSWERS:
            return _ANSWERS
        explained = _unexplained(pipe_directory, pid)
        if explained is not None:
            return explained
    if found is Liveness.SILENT:
        reason = (
            f"it did not greet a connection to its control socket in {pipe_directory} within {timeout_s:g}s, "
            f"{misses} times in a row"
        )
    else:
        reason = f"its control sockets in {pipe_directory} refused {misses} connections in a row"
    return Check(state=State.HUNG, reason=reason)


def busy_episodes(log: FilteringBoundLogger) -> FailureEpisodes:
    """The daemon's busy episodes (another session kept the agent's out for the whole bounded wait), each reported
    once: a warning as it begins, retries at debug level, and an info line once the daemon answers again."""
    return FailureEpisodes(
        log,
        failed="control daemon busy",
        level="warning",
        still="control daemon still busy",
        again="control daemon answers again",
        hint=BUSY_HINT,
        lasted_key="busy_for_s",
    )
