"""Directories under the MPS root, and the per-resource lock that keeps two agents from serving one resource."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from mpsagent.errors import AgentLockedError, MpsAgentError
from mpsagent.plan import NodePlan, ResourcePlan

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


def _make_directory(path: Path, mode: int) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)
    except OSError as exc:
        raise MpsAgentError(f"cannot create {path} ({exc.strerror}); check --mps-root and the agent's rights") from exc


def prepare_directories(plan: NodePlan) -> None:
    _make_directory(plan.mps_root, ROOT_MODE)
    _make_directory(plan.shm_directory, SHM_MODE)
    for resource in plan.resources:
        _make_directory(resource.directory, RESOURCE_MODE)
        _make_directory(resource.pipe_directory, PIPE_MODE)
        _make_directory(resource.log_directory, LOG_MODE)


class ResourceLock:
    """An exclusive flock on `<resource dir>/agent.lock` (or another lock file of the resource), holding the
    owner's PID; released when closed. `role` says in the refusal what the holder does."""

    def __init__(
        self, resource: ResourcePlan, *, file_name: str = LOCK_FILE, role: str = "already serves", hint: str = ""
    ) -> None:
        self._resource = resource
        self._path = resource.directory / file_name
        self._role = role
        self._hint = hint or "stop it before starting this one"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AgentLockedError(
                f"another mpsagent (PID {holder}) {self._role} {self._resource.name} (lock {self._path}); {self._hint}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ResourceLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
