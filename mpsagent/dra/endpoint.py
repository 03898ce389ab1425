"""The DRA plugin's endpoint: the DRA node service on `<kubelet dir>/plugins/<driver>/dra.sock` and the
registration service on `<kubelet dir>/plugins_registry/<driver>-reg.sock`, where the kubelet's plugin watcher
finds it. One long-lived task serves both, serves a socket again when its file is removed (someone emptied the
directory: the kubelet would not find the plugin again), and removes both files when it ends."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import HostError
from mpsagent.base.logs import get_logger
from mpsagent.dra.health_service import HEALTH_SERVICES, DeviceHealthSource, DraHealthService
from mpsagent.dra.node_service import RECEIVE_LIMIT, ClaimHandler, DraNodeService
from mpsagent.dra.registry_service import NODE_SERVICE_VERSION, RegistrationService
from mpsagent.kubelet.served_socket import ServedSocket
from mpsagent.kubelet.wire import Servable

log = get_logger(__name__)

DRA_SOCKET_NAME = "dra.sock"
REGISTRATION_SOCKET_SUFFIX = "-reg.sock"
WATCH_INTERVAL_S = 2.0
"""How often the socket files are looked at."""
SERVE_AGAIN_BACKOFF_MAX_S = 30.0
"""The longest wait between tries to serve a removed socket again, while serving fails."""
_DRIVER_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


class DraEndpoint:
    """Owns the DRA plugin's two gRPC servers; `run` is their long-lived task."""

    def __init__(
        self,
        *,
        kubelet_dir: Path,
        driver: str,
        handler: ClaimHandler,
        health: DeviceHealthSource | None = None,
        watch_interval_s: float = WATCH_INTERVAL_S,
    ) -> None:
        """`kubelet_dir`: the kubelet's directory (`/var/lib/kubelet`), at the same path as the kubelet sees it (the
        registration tells the kubelet the DRA socket's absolute path); `driver`: the DRA driver's name, which
        names the sockets too; `health`: the devices' health, served beside the node service on the DRA socket
        (`v1.DRAResourceHealth` and `v1alpha1`, both listed in the registration) when given."""
        if not _DRIVER_NAME.fullmatch(driver) or len(driver) > 63:
            raise ValueError(f"{driver!r} is not a DRA driver name (a DNS subdomain of at most 63 characters)")
        if not kubelet_dir.is_absolute():
            raise ValueError(f"the kubelet directory must be an absolute path, not {kubelet_dir}")
        self.driver = driver
        self.dra_socket = kubelet_dir / "plugins" / driver / DRA_SOCKET_NAME
        self.registration_socket = kubelet_dir / "plugins_registry" / f"{driver}{REGISTRATION_SOCKET_SUFFIX}"
        self.node_service = DraNodeService(handler)
        self.health_service = DraHealthService(health) if health is not None else None
        self.registration = RegistrationService(
            driver=driver,
            endpoint=self.dra_socket,
            versions=(NODE_SERVICE_VERSION, *(HEALTH_SERVICES if health is not None else ())),
        )
        self._watch_interval_s = watch_interval_s
        self._log = log.bind(driver=driver)
        self._serving_again = FailureEpisodes(
            self._log, failed="removed socket not served again", again="removed socket served again", level="error"
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; reports started once both sockets are served (the DRA socket first: the kubelet
        may call it as soon as it has the registration); removes both socket files when it ends. Raises HostError
        when it cannot serve at the start."""
        services: list[Servable] = [self.node_service]
        if self.health_service is not None:
            services.append(self.health_service)
        dra = self._served(self.dra_socket, services, "DRA node service")
        registry = self._served(self.registration_socket, [self.registration], "DRA plugin registration")
        try:
            await dra.serve()
            await registry.serve()
            task_status.started()
            await self._keep_serving(dra, registry)
        finally:
            # The registration first: the kubelet forgets the plugin when its socket goes.
            await registry.close()
            await dra.close()
            self.registration.forget()
            self._log.info("DRA endpoint closed")

    @staticmethod
    def _served(path: Path, services: list[Servable], what: str) -> ServedSocket:
        return ServedSocket(
            path,
            services,
            what=what,
            receive_limit=RECEIVE_LIMIT,
            directory_hint="the DRA endpoint's kubelet directory names it",
            make_directory=True,
        )

    async def _keep_serving(self, *sockets: ServedSocket) -> None:
        """Serve a socket again when its file is removed; while that fails, try again with a growing wait."""
        retry = Backoff(self._watch_interval_s, max(self._watch_interval_s, SERVE_AGAIN_BACKOFF_MAX_S))
        failing = self._serving_again
        while True:
            await anyio.sleep(retry.delay)
            try:
                for socket in sockets:
                    if socket.gone:
                        if socket.path == self.registration_socket:
                            self.registration.forget()  # the kubelet forgot it; it registers it again, or not
                        if not failing.failing:
                            self._log.warning("socket file removed; serving it again", socket=str(socket.path))
                        await socket.serve()
            except HostError as exc:
                retry.grow()
                failing.failed(str(exc), retry_in_s=round(retry.delay, 1))
                continue
            failing.works()
            retry.reset()
