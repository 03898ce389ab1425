"""The node guard: one agent per resource name and per GPU on a node, whatever each agent's `--mps-root`.

Its locks sit in a directory of the kubelet's device-plugin directory, the one place every agent of a node shares
(the DaemonSet mounts it; an agent under systemd runs on the host). A restarting kubelet deletes the files of that
directory but never a directory, so the locks survive kubelet restarts. app.run_agent takes the guard before it
touches anything else; the plugin endpoint relies on it when it removes the sockets of agents that are gone.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from mpsagent.base.errors import AgentLockedError, FileRefusedError, HostError
from mpsagent.base.host import PidLock, file_kind, ownership_problem
from mpsagent.domain.plan import ResourcePlan

LOCK_DIRECTORY = "mpsagent-locks"
LOCK_DIRECTORY_MODE = 0o700


def _file_name(kind: str, name: str) -> str:
    return f"{kind}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.lock"


def _lock_directory(kubelet_directory: Path) -> Path:
    """`<kubelet dir>/mpsagent-locks`, created owner-only; refused unless it is a directory of this user (a link or
    another user's directory would let someone else decide which lock files the agent opens)."""
    directory = kubelet_directory / LOCK_DIRECTORY
    try:
        directory.mkdir(mode=LOCK_DIRECTORY_MODE, exist_ok=True)
        found = directory.lstat()
    except OSError as exc:
        raise HostError(
            f"cannot create the lock directory {directory} ({exc.strerror}); the kubelet's device-plugin directory "
            "must be writable by the agent (check --kubelet-socket)"
        ) from exc
    if stat.S_ISDIR(found.st_mode):
        problem = ownership_problem(found)
    else:
        problem = f"is {file_kind(found.st_mode)}, not a directory"
    if problem is not None:
        raise HostError(f"the lock directory {directory} {problem}; remove it and start the agent again")
    return directory


class NodeGuard:
    """Exclusive locks on each resource name and each GPU of the plan, held while the agent runs."""

    def __init__(self, kubelet_directory: Path, resources: Sequence[ResourcePlan]) -> None:
        self._kubelet_directory = kubelet_directory
        self._resources = resources
        self._held = ExitStack()

    def acquire(self) -> None:
        """Take every lock or none; raises AgentLockedError naming the agent that holds one."""
        directory = _lock_directory(self._kubelet_directory)
        with ExitStack() as taking:
            for resource in self._resources:
                self._take(taking, directory / _file_name("resource", resource.name), f"serves {resource.name}", "")
                for gpu in resource.gpus:
                    self._take(
                        taking,
                        directory / _file_name("gpu", gpu.uuid),
                        f"shares GPU {gpu.uuid}",
                        f", or select other GPUs with {resource.config_path}.devices",
                    )
            self._held = taking.pop_all()

    @staticmethod
    def _take(taking: ExitStack, path: Path, what: str, alternative: str) -> None:
        lock = PidLock(path, what="the node lock")
        try:
            holder = lock.acquire()
        except FileRefusedError as exc:
            raise HostError(f"{exc}; remove it and start again") from exc
        except OSError as exc:
            raise HostError(f"cannot take the lock {path} ({exc.strerror}); remove it and start again") from exc
        if holder is not None:
            raise AgentLockedError(
                f"another mpsagent (PID {holder}) already {what} on this node (lock {path}); "
                f"stop it before starting this one{alternative}"
            )
        taking.callback(lock.release)

    def release(self) -> None:
        self._held.close()

    def __enter__(self) -> NodeGuard:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
