"""The driver's side of the kubelet's plugin registry (`pluginregistration.Registration`, v1), served by the
endpoint: the kubelet finds the registration socket in its `plugins_registry` directory, asks it what the plugin is
(GetInfo), and says whether it took it (NotifyRegistrationStatus). It registers the plugin again whenever the socket
is created again."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mpsagent._proto import pluginregistration as pb
from mpsagent.base.errors import shown
from mpsagent.base.logs import get_logger
from mpsagent.kubelet.registration_record import Registration, RegistrationRecord

log = get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
NODE_SERVICE_VERSION = "v1.DRAPlugin"
"""`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`, as the kubelet reads the supported versions."""
MAX_ERROR_CHARS = 1000


class RegistrationService(pb.RegistrationBase):
    """The Registration servicer (grpclib's IServable, through the generated base): tells the kubelet the driver's
    name and its DRA service's socket, and keeps what the kubelet answered."""

    def __init__(self, *, driver: str, endpoint: Path, versions: Sequence[str] = (NODE_SERVICE_VERSION,)) -> None:
        """`endpoint`: the DRA service's socket, an absolute path as the kubelet sees it; `versions`: the services
        it serves."""
        if not endpoint.is_absolute():
            raise ValueError(f"the DRA endpoint must be an absolute path, not {endpoint}")
        self.driver = driver
        self.endpoint = endpoint
        self.versions = tuple(versions)
        self._record = RegistrationRecord()
        self._log = log.bind(driver=driver)

    def statistics(self) -> Registration:
        """What the kubelet answered: registered now (accepted, and the registration socket not created again
        since), and why it last refused the plugin."""
        return self._record.snapshot()

    def forget(self) -> None:
        """The registration socket was created again: the kubelet registers the plugin anew (or not)."""
        self._record.forget()

    async def get_info(self, message: pb.InfoRequest) -> pb.PluginInfo:
        self._log.debug("kubelet asked for the plugin's info")
        return pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=str(self.endpoint),
            supported_versions=list(self.versions),
        )

    async def notify_registration_status(self, message: pb.RegistrationStatus) -> pb.RegistrationStatusResponse:
        if message.plugin_registered:
            self._record.accepted()
            self._log.info("registered with kubelet", endpoint=str(self.endpoint))
        else:
            reason = shown(message.error or "no reason given", MAX_ERROR_CHARS)
            self._record.refused(reason)
            self._log.error("kubelet refused the plugin", reason=reason, endpoint=str(self.endpoint))
        return pb.RegistrationStatusResponse()
