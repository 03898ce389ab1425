"""The MPS control daemon's liveness, asked without a front-end session: whether its process lives, and whether its
control socket greets a connection. The daemon supervisor and the daemon host's keeper call a daemon hung from
this alone, and the control channel asks it to tell a busy daemon from a failed one.

The daemon speaks first: it accepts a connection on `<pipe>/control` and sends a hello before it reads anything
(libcuda connects, reads the hello and disconnects the same way to find a daemon). It greets while another
session is open, when it refuses every other session ("Cannot send command to MPS control daemon process"); a
stopped or hung daemon does not. Closing right after the hello never opens a session, so the check collides with
no one's commands, takes no lock and never waits behind queued RPC work. The daemon reads a new connection's
credentials with no timeout, blocking everything else meanwhile: the check closes the moment the hello arrives.
"""

from __future__ import annotations

import enum
import errno
import os
import socket
from pathlib import Path

import anyio
from structlog.typing import FilteringBoundLogger

from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import ControlRunError

CONTROL_SOCKETS = ("control", "control_privileged")
"""Every client's socket, then root's (drivers from 535 on): root's front-end uses the second, or the first where it
is missing, so the daemon is out of reach only when both refuse."""
GREETING_TIMEOUT_S = 5.0
"""A daemon that has not greeted a connection this long after it was made missed one (it greets in well under a
millisecond; the front-end's commands get as long)."""
HUNG_AFTER_MISSES = 2
"""Misses in a row, the second asked at once, before a daemon counts as hung."""
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


async def hung_reason(pipe_directory: Path, pid: int, *, timeout_s: float = GREETING_TIMEOUT_S) -> str | None:
    """None while the daemon lives (it greets, busy or not); otherwise why it counts as hung: its process is gone,
    or HUNG_AFTER_MISSES connections in a row were refused or not greeted. Raises ControlRunError when the agent
    cannot ask (that is no answer about the daemon)."""
    found = Liveness.ANSWERS
    for _ in range(HUNG_AFTER_MISSES):
        if process_gone(pid):
            return f"its process {pid} is gone"
        found = await greeting(pipe_directory, timeout_s)
        if found is Liveness.ANSWERS:
            return None
    if found is Liveness.SILENT:
        return (
            f"it did not greet a connection to its control socket in {pipe_directory} within {timeout_s:g}s, "
            f"{HUNG_AFTER_MISSES} times in a row"
        )
    return f"its control sockets in {pipe_directory} refused {HUNG_AFTER_MISSES} connections in a row"


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
