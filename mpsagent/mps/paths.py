"""Directories under the MPS root, made safe before the agent uses them, and the per-resource lock that keeps two
agents from serving one resource.

The agent writes under the root as root: a directory another user can write, or a link planted where a directory
should be, would let that user choose where the agent writes and what its daemon serves. So:

- every directory down to the root belongs to root or to the agent's user, and so does every link followed on the
  way; the root is writable by no one else; a directory above it may be writable by others only when it is sticky
  (as /tmp is: others cannot rename or remove what is not theirs there);
- every directory below the root is the agent's own: created by it, or a real directory (never a link) of its
  user; the agent sets each one's mode, parents included, through a descriptor (never through a link), whatever
  the umask.

Anything else is refused, naming the path, its owner and its mode: the agent does not start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from mpsagent.base.errors import AgentLockedError, FileRefusedError, HostError
from mpsagent.base.host import PidLock, file_kind
from mpsagent.domain.plan import NodePlan, ResourcePlan

LOCK_FILE = "agent.lock"
# Held by whoever starts the resource's daemons: the agent (--mps-daemon agent) or the daemon host. Two owners
# would each restart "their" daemon over the other's.
DAEMON_OWNER_LOCK_FILE = "daemon-owner.lock"
# What MPS clients in containers need: to connect to the daemon's sockets in the pipe directory (listing it and
# traversing to it, not writing it), and to create shared-memory files in shm without deleting each other's
# (sticky, like /dev/shm). Logs and state are the agent's and the daemon's alone.
ROOT_MODE = 0o755
RESOURCE_MODE = 0o755
PIPE_MODE = 0o755
SHM_MODE = 0o1777
LOG_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
MAX_LINKS = 40  # as the kernel's own limit on links followed in one path
_OPEN_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_TRUSTED = "the agent only uses directories owned by root or by itself and not writable by others"


def _trusted_owner(status: os.stat_result) -> bool:
    return status.st_uid in (0, os.geteuid())


def _owner_and_mode(status: os.stat_result) -> str:
    return f"is owned by uid {status.st_uid} and has mode {stat.S_IMODE(status.st_mode):04o}"


def _check_above_root(path: Path, status: os.stat_result) -> None:
    if not stat.S_ISDIR(status.st_mode):
        raise HostError(f"{path} above the MPS root is {file_kind(status.st_mode)}, not a directory")
    open_to_others = status.st_mode & _OPEN_BY_OTHERS and not status.st_mode & stat.S_ISVTX
    if not _trusted_owner(status) or open_to_others:
        raise HostError(
            f"the directory {path} above the MPS root {_owner_and_mode(status)}: {_TRUSTED} (unless sticky, as "
            "/tmp); fix it or choose another --mps-root"
        )


def _check_root(path: Path, status: os.stat_result) -> None:
    if not stat.S_ISDIR(status.st_mode):
        raise HostError(f"the MPS root {path} is {file_kind(status.st_mode)}, not a directory")
    if not _trusted_owner(status) or status.st_mode & _OPEN_BY_OTHERS:
        raise HostError(
            f"the MPS root {path} {_owner_and_mode(status)}: {_TRUSTED}; fix it (chown root; chmod 755) or "
            "choose another --mps-root"
        )


def _walk_to_root(root: Path) -> tuple[Path, list[str]]:
    """The deepest existing directory on the way to the absolute `root` (links resolved), each directory and link
    on the way checked; and the names below it still to be created (none when the root exists)."""
    current = Path("/")
    _check_above_root(current, os.stat(current))
    pending = list(root.parts[1:])
    links = 0
    while pending:
        name = pending.pop(0)
        if name in (".", ".."):
            current = current.parent if name == ".." else current
            continue
        candidate = current / name
        try:
            status = os.lstat(candidate)
        except FileNotFoundError:
            return current, [name, *pending]
        if stat.S_ISLNK(status.st_mode):
            links += 1
            if not _trusted_owner(status):
                raise HostError(
                    f"the link {candidate} on the way to the MPS root is owned by uid {status.st_uid}: the agent "
                    "only follows links owned by root or by itself; choose another --mps-root"
                )
            if links > MAX_LINKS:
                raise HostError(f"more than {MAX_LINKS} links on the way to the MPS root {root}")
            target = Path(os.readlink(candidate))
            current = Path("/") if target.is_absolute() else current
            pending = [*target.parts[1 if target.is_absolute() else 0 :], *pending]
            continue
        (_check_root if not pending else _check_above_root)(candidate, status)
        current = candidate
    return current, []


def _open_directory(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        kind = file_kind(os.lstat(path).st_mode)
    if kind == "a symbolic link":
        raise HostError(
            f"{path} is a symbolic link, not a directory: the agent does not follow links under the MPS root; remove it"
        )
    raise HostError(f"{path} is {kind}, not a directory; remove it")


def _own_directory(path: Path, mode: int) -> None:
    """Create `path` (its parent is already checked) or take it as it is when it is the agent's, and give it
    exactly `mode`."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)  # nobody else's until its mode is set
    fd = _open_directory(path)
    try:
        status = os.fstat(fd)
        if status.st_uid != os.geteuid():
            raise HostError(f"{path} is owned by uid {status.st_uid}, not by the agent (uid {os.geteuid()}); remove it")
        if stat.S_IMODE(status.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _prepare_root(root: Path) -> Path:
    """Check or create the root and the directories above it; the root's real path."""
    current, missing = _walk_to_root(root)
    for name in missing:
        current /= name
        _own_directory(current, ROOT_MODE)  # the root, and every parent the agent creates for it
    if not missing and os.stat(current).st_uid == os.geteuid():
        _own_directory(current, ROOT_MODE)  # (a root of root's, when the agent runs as another user, stays as is)
    return current


def _below(root: Path, relative: Path, mode: int) -> None:
    """`root / relative` with `mode`; the directories between (a resource's) with RESOURCE_MODE."""
    path = root
    for part in relative.parent.parts:
        path /= part
        _own_directory(path, RESOURCE_MODE)
    _own_directory(root / relative, mode)


def prepare_directories(plan: NodePlan) -> None:
    """Raises HostError naming the path."""
    try:
        root = _prepare_root(plan.mps_root)
        _below(root, plan.shm_directory.relative_to(plan.mps_root), SHM_MODE)
        for resource in plan.resources:
            _below(root, resource.pipe_directory.relative_to(plan.mps_root), PIPE_MODE)
            _below(root, resource.log_directory.relative_to(plan.mps_root), LOG_MODE)
    except OSError as exc:
        path = exc.filename or plan.mps_root
        raise HostError(f"cannot create {path} ({exc.strerror}); check --mps-root and the agent's rights") from exc


class ResourceLock:
    """An exclusive lock on `<resource dir>/agent.lock` (or another lock file of the resource), holding the
    owner's PID; released when closed. `role` says in the refusal what the holder does."""

    def __init__(
        self, resource: ResourcePlan, *, file_name: str = LOCK_FILE, role: str = "already serves", hint: str = ""
    ) -> None:
        self._resource = resource
        self._lock = PidLock(resource.directory / file_name, what="the agent lock")
        self._role = role
        self._hint = hint or "stop it before starting this one"

    def acquire(self) -> None:
        """Raises AgentLockedError when another agent holds it, HostError when the file cannot be used."""
        path = self._lock.path
        try:
            holder = self._lock.acquire()
        except FileRefusedError as exc:
            raise HostError(f"{exc}; remove it") from exc
        except OSError as exc:
            raise HostError(
                f"cannot use the agent lock {path} ({exc.strerror}); check the file system of --mps-root"
            ) from exc
        if holder is not None:
            raise AgentLockedError(
                f"another mpsagent (PID {holder}) {self._role} {self._resource.name} (lock {path}); {self._hint}"
            )

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> ResourceLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
