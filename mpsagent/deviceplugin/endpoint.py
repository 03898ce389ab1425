"""One resource's plugin endpoint: serve on a socket in the kubelet's directory, register, and do both again
whenever the kubelet restarts (it deletes every socket in its directory when it does)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import anyio
from anyio.abc import TaskStatus
from grpclib.exceptions import GRPCError, StreamTerminatedError

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.host import FileIdentity, file_identity, pid_alive
from mpsagent.base.logs import get_logger
from mpsagent.base.ticker import FAST_POLLS
from mpsagent.deviceplugin.register_call import register
from mpsagent.deviceplugin.servicer import DevicePluginServicer
from mpsagent.kubelet.registration_record import Registration, RegistrationRecord
from mpsagent.kubelet.served_socket import ServedSocket

log = get_logger(__name__)

WATCH_INTERVAL_S = FAST_POLLS.period_s
REGISTER_BACKOFF_INITIAL_S = 0.1
REGISTER_BACKOFF_MAX_S = 5.0


def socket_name(resource_name: str, pid: int) -> str:
    """Unique to this process, so that an old instance's exit never removes a new instance's socket."""
    return f"{_socket_prefix(resource_name)}{pid}.sock"


def _socket_prefix(resource_name: str) -> str:
    return f"mpsagent-{re.sub(r'[^A-Za-z0-9_.-]', '_', resource_name)}-"


def _remove_stale_sockets(directory: Path, resource_name: str) -> None:
    """Remove the sockets that agents of this resource which are gone left behind (a `kill -9` cleans up nothing, and
    the kubelet only empties its directory when it restarts): names of this resource's pattern only, sockets only
    (never a link), and only when their PID is gone."""
    own = re.compile(re.escape(_socket_prefix(resource_name)) + r"([0-9]+)\.sock")
    try:
        paths = list(directory.iterdir())
    except OSError:
        return  # serving there fails next, and says why
    for path in paths:
        match = own.fullmatch(path.name)
        if match is None or int(match[1]) == os.getpid() or pid_alive(int(match[1])):
            continue
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
                log.info("stale plugin socket removed", resource=resource_name, socket=str(path))
        except OSError as exc:
            log.warning("stale plugin socket not removed", resource=resource_name, socket=str(path), reason=str(exc))


class PluginEndpoint:
    """Owns the gRPC server of one resource and its registration; `run` is its long-lived task."""

    def __init__(
        self,
        *,
        resource_name: str,
        servicer: DevicePluginServicer,
        kubelet_socket: Path,
        pre_start_required: bool,
    ) -> None:
        self.resource_name = resource_name
        self._servicer = servicer
        self._kubelet_socket = kubelet_socket
        self._pre_start_required = pre_start_required
        self.socket_path = kubelet_socket.parent / socket_name(resource_name, os.getpid())
        self._socket = ServedSocket(
            self.socket_path,
            [servicer],
            what="device plugin",
            receive_limit=servicer.receive_limit,
            directory_hint="the device-plugins directory, where --kubelet-socket is",
        )
        self._registration = RegistrationRecord()
        self._log = log.bind(resource=resource_name)

    def registration(self) -> Registration:
        return self._registration.snapshot()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve and register until cancelled; reports started once the socket is first served."""
        _remove_stale_sockets(self.socket_path.parent, self.resource_name)
        started = False
        while True:
            if started:
                # The kubelet empties its directory when it starts, then creates its socket: a socket served
                # before that would be deleted under us.
                await self._wait_for_kubelet_socket()
            await self._socket.serve()
            try:
                if not started:
                    task_status.started()
                    started = True
                kubelet = await self._register_with_backoff()
                if kubelet is not None:
                    await self._wait_for_kubelet_restart(kubelet)
            finally:
                self._registration.forget()
                self._servicer.close()  # ends the kubelet's ListAndWatch streams, so that the server closes at once
                await self._socket.close()
                self._servicer.reopen()

    async def _wait_for_kubelet_socket(self) -> None:
        while True:
            if file_identity(self._kubelet_socket) is not None:
                return
            await anyio.sleep(WATCH_INTERVAL_S)

    async def _backoff(self, delay: float, kubelet: FileIdentity | None) -> None:
        """Sleep `delay`, but no longer than it takes a (new) kubelet socket to appear: a kubelet that is back
        must not wait for the end of a long backoff."""
        with anyio.move_on_after(delay):
            while True:
                await anyio.sleep(WATCH_INTERVAL_S)
                if file_identity(self._kubelet_socket) not in (None, kubelet):
                    return

    async def _register_with_backoff(self) -> FileIdentity | None:
        """Register, retrying with backoff; the kubelet socket's identity when registered, None when our own socket
        was deleted meanwhile (the kubelet restarted while we retried: serve again first)."""
        retry = Backoff(REGISTER_BACKOFF_INITIAL_S, REGISTER_BACKOFF_MAX_S)
        # The first failure is news; the retries that follow are not.
        failing = FailureEpisodes(
            self._log,
            failed="kubelet registration failed",
            level="warning",
            still="kubelet registration failed",
            again=None,
        )
        while True:
            if self._socket.gone:
                self._log.warning("plugin socket removed while registering; serving again")
                return None
            kubelet = file_identity(self._kubelet_socket)
            try:
                await register(
                    self._kubelet_socket,
                    endpoint=self.socket_path.name,
                    resource_name=self.resource_name,
                    pre_start_required=self._pre_start_required,
                )
            except (OSError, GRPCError, StreamTerminatedError, TimeoutError) as exc:
                self._registration.refused(str(exc) or type(exc).__name__)
                failing.failed(
                    str(exc) or type(exc).__name__,
                    kubelet_socket=str(self._kubelet_socket),
                    retry_in_s=round(retry.delay, 2),
                )
                await self._backoff(retry.delay, kubelet)
                retry.grow()
                continue
            self._registration.accepted()
            self._log.info("registered with kubelet", endpoint=self.socket_path.name)
            return kubelet

    async def _wait_for_kubelet_restart(self, kubelet: FileIdentity | None) -> None:
        """Return when our socket is gone or the kubelet's socket was re-created: the kubelet restarted. Looked at
        every WATCH_INTERVAL_S, in the agent's shared 0.2 s poll (one timer for every such poller, no task step)."""
        restarted = anyio.Event()
        seen: list[str] = []

        def look() -> None:
            if restarted.is_set():
                return
            if self._socket.gone:
                seen.append("plugin socket removed; kubelet restarted, registering again")
            elif file_identity(self._kubelet_socket) != kubelet:
                seen.append("kubelet socket re-created; registering again")
            else:
                return
            restarted.set()

        with FAST_POLLS.polling(look):
            await restarted.wait()
        self._log.warning(seen[0])
