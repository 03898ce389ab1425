"""Who holds the MPS control daemon's control socket, read from the kernel: the daemon's accepted connections on
`control` and `control_privileged`, each with its peer's PID and user, what the daemon waits on now, and ending one
connection without touching the daemon or anyone else. The hold watch (`hold_watch`) and the liveness check
(`liveness`) call it.

Every container of the resource mounts the pipe directory, and the daemon serves one connection at a time: it reads
a new connection's credentials with no timeout (a connection that sends nothing blocks it for everyone), and while a
control session is open it refuses every other one. So who holds it must be known from outside the daemon:

- `/proc/<daemon>/stat` and `/proc/<daemon>/syscall`: stopped, traced by a debugger, or waiting in a read on one of
  its descriptors (which one);
- `pidfd_getfd(2)`: a copy of one of the daemon's descriptors, whose address says which socket it was accepted on
  and whose `SO_PEERCRED` names the process that connected; `shutdown(2)` on the copy ends that connection for both
  ends (the daemon reads end-of-file and serves the next; the holder reads end-of-file), and nothing is signalled.

Both need ptrace access to the daemon (Linux 5.6+): root, with CAP_SYS_PTRACE where the daemon runs with
capabilities the agent lacks (the daemon host's container), and the daemon's PID namespace (hostPID).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from mpsagent.base.errors import ControlSocketAccessError

CONTROL_SOCKETS = ("control", "control_privileged")
"""Every client's socket, then root's (drivers from 535 on): root's front-end uses the second, or the first where it
is missing."""
_PIDFD_GETFD = 438
"""The system call's number, the same on every architecture (it came after they were unified)."""
_READ_CALLS = {
    "x86_64": frozenset({0, 19, 45, 47}),  # read, readv, recvfrom, recvmsg
    "aarch64": frozenset({63, 65, 207, 212}),
}
"""The system calls in which a daemon waits for a connection's bytes, by machine."""
_PEERCRED = struct.Struct("3i")
ACCESS_HINT = (
    "the agent needs ptrace access to the daemon to see who holds its control socket: run it as root with "
    "CAP_SYS_PTRACE (the Helm chart grants it) in the host's PID namespace (hostPID)"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonActivity:
    """What the daemon's process is doing now."""

    stopped: bool
    """Stopped by a signal (SIGSTOP, SIGTSTP): it runs again on SIGCONT."""
    traced: bool
    """Stopped under a debugger."""
    reading_fd: int | None
    """The descriptor it waits in a read on, None when it waits elsewhere (its poll: it serves everyone) or runs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ControlConnection:
    """One connection the daemon accepted on a control socket."""

    fd: int
    """The daemon's descriptor."""
    inode: int
    """The socket's inode: the same connection from one look to the next."""
    socket: str
    """`control` or `control_privileged`."""
    peer_pid: int | None
    """The process that connected (None: gone, or outside the agent's PID namespace)."""
    peer_uid: int | None


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    copy = int(libc.syscall(_PIDFD_GETFD, pidfd, fd, 0))
    if copy < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return copy


def _denied(pid: int, exc: OSError) -> ControlSocketAccessError:
    return ControlSocketAccessError(f"cannot look into the MPS control daemon {pid} ({exc.strerror}); {ACCESS_HINT}")


def activity(pid: int) -> DaemonActivity | None:
    """What the daemon does now; None when its process is gone. Raises ControlSocketAccessError without ptrace
    access to it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        call = Path(f"/proc/{pid}/syscall").read_text().split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError as exc:
        raise _denied(pid, exc) from exc
    state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
    reading = None
    if len(call) >= 2 and call[0].isdigit() and int(call[0]) in _READ_CALLS.get(platform.machine(), frozenset()):
        reading = int(call[1], 16)
    return DaemonActivity(stopped=state == "T", traced=state == "t", reading_fd=reading)


def _socket_inode(pid: int, fd: int) -> int | None:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except FileNotFoundError:
        return None
    if not (target.startswith("socket:[") and target.endswith("]")):
        return None
    return int(target[8:-1])


def connections(pid: int, pipe_directory: Path) -> tuple[ControlConnection, ...]:
    """The connections the daemon holds open on its control sockets in `pipe_directory` (not its listening
    sockets, nor any other). Empty when its process is gone; raises ControlSocketAccessError without ptrace access."""
    names = {str(pipe_directory / name).encode(): name for name in CONTROL_SOCKETS}
    found = []
    try:
        fds = [int(entry) for entry in os.listdir(f"/proc/{pid}/fd")]
        pidfd = os.pidfd_open(pid)
    except (FileNotFoundError, ProcessLookupError):
        return ()
    except PermissionError as exc:
        raise _denied(pid, exc) from exc
    try:
        for fd in sorted(fds):
            inode = _socket_inode(pid, fd)
            if inode is None:
                continue
            connection = _connection(pidfd, fd, inode, names)
            if connection is not None:
                found.append(connection)
    except PermissionError as exc:
        raise _denied(pid, exc) from exc
    finally:
        os.close(pidfd)
    return tuple(found)


def _connection(pidfd: int, fd: int, inode: int, names: dict[bytes, str]) -> ControlConnection | None:
    try:
        copy = socket.socket(fileno=_pidfd_getfd(pidfd, fd))
    except OSError as exc:
        if exc.errno in (errno.EBADF, errno.ESRCH):
            return None  # closed (or the daemon gone) since the directory was listed
        raise
    with copy:
        if copy.family != socket.AF_UNIX or copy.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return None
        address = copy.getsockname()
        name = names.get(address if isinstance(address, bytes) else str(address).encode())
        if name is None or os.fstat(copy.fileno()).st_ino != inode:
            return None
        peer_pid, peer_uid, _ = _PEERCRED.unpack(copy.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return ControlConnection(
        fd=fd, inode=inode, socket=name, peer_pid=peer_pid or None, peer_uid=peer_uid if peer_pid else None
    )


def end(pid: int, connection: ControlConnection) -> bool:
    """End the connection for both of its ends (shutdown on a copy of the daemon's descriptor); False when it had
    already ended (the descriptor is gone or now another socket). Raises ControlSocketAccessError without ptrace
    access."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        raise _denied(pid, exc) from exc
    try:
        copy = socket.socket(fileno=_pidfd_getfd(pidfd, connection.fd))
    except OSError as exc:
        if exc.errno in (errno.EBADF, errno.ESRCH):
            return False
        if exc.errno == errno.EPERM:
            raise _denied(pid, exc) from exc
        raise
    finally:
        os.close(pidfd)
    with copy:
        if os.fstat(copy.fileno()).st_ino != connection.inode:
            return False
        copy.shutdown(socket.SHUT_RDWR)
    return True
