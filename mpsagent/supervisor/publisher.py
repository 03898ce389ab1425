"""Publishing what the agent is doing: the status document, built from the agent's parts whenever what it reads
changed, written as the status file (`--status`), handed to the web endpoint (what `/metrics`, `/healthz` and
`/readyz` read, and the liveness heartbeat) and told to systemd (STATUS=, READY=1); and systemd's WATCHDOG=1."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from mpsagent import __version__
from mpsagent.base.devices import GpuUuid
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.host import os_reason
from mpsagent.base.logs import get_logger
from mpsagent.documents.status import GrantEntries, ResourceView, readiness_problems, status_document, summary
from mpsagent.documents.status_document import DraStatus, PodResourcesStatus, StatusDocument
from mpsagent.documents.status_file import STATUS_FILE, remove_status, write_status
from mpsagent.domain.stowaways import StowawayStatus
from mpsagent.gpu.limits_watch import ContainerLimit
from mpsagent.kubelet.podresources import PodResourcesReconciler
from mpsagent.node.systemd import SystemdNotifier

if TYPE_CHECKING:
    from mpsagent.web import WebEndpoint

log = get_logger(__name__)

STATUS_INTERVAL_S = 0.5


class StatePublisher:
    """Every STATUS_INTERVAL_S: the status document built again when its parts' fingerprint changed, the status file
    (when the document changed, or until a failed write succeeds), the web endpoint's snapshot and heartbeat,
    systemd's STATUS=, and READY=1 the first time nothing keeps the agent unready (`readiness_problems`: every
    resource registered with its daemon up, the DRA driver registered)."""

    def __init__(
        self,
        *,
        mps_root: Path,
        pod_resources_socket: Path,
        resources: Callable[[], Sequence[ResourceView]],
        reconciler: PodResourcesReconciler,
        unhealthy_gpus: Callable[[], dict[GpuUuid, str]],
        notifier: SystemdNotifier,
        web: WebEndpoint | None,
        dra: Callable[[], DraStatus | None] = lambda: None,
        container_limits: Callable[[], Sequence[ContainerLimit]] = tuple,
        stowaways: Callable[[], StowawayStatus | None] = lambda: None,
    ) -> None:
        """`dra`: the DRA driver's status (None without --dra on); `container_limits`: the driver's memory limit
        of each container the agent's hook limited (none where the driver's limits are not used); `stowaways`: what
        the stowaway watch found (None where it does not run)."""
        self._mps_root = mps_root
        self._pod_resources_socket = pod_resources_socket
        self._resources = resources
        self._reconciler = reconciler
        self._unhealthy_gpus = unhealthy_gpus
        self._notifier = notifier
        self._web = web
        self._dra = dra
        self._container_limits = container_limits
        self._stowaways = stowaways
        self._grant_entries = GrantEntries()
        self._unwritten = FailureEpisodes(
            log,
            failed="status file not written",
            again="status file written again",
            hint=f"retried every {STATUS_INTERVAL_S:g}s; --status shows the last state written",
        )

    def _document(
        self, views: Sequence[ResourceView], unhealthy_gpus: dict[GpuUuid, str], dra: DraStatus | None
    ) -> StatusDocument:
        return status_document(
            version=__version__,
            pid=os.getpid(),
            tasks=len(asyncio.all_tasks()),  # the agent runs on anyio's asyncio backend
            pod_resources=PodResourcesStatus(
                socket=str(self._pod_resources_socket),
                available=self._reconciler.available,
                answers=self._reconciler.successes,
                failures=self._reconciler.failures,
            ),
            unhealthy_gpus=unhealthy_gpus,
            resources=views,
            dra=dra,
            grant_entries=self._grant_entries,
            container_limits=self._container_limits(),
            stowaways=self._stowaways(),
        )

    def _fingerprint(
        self, views: Sequence[ResourceView], unhealthy_gpus: dict[GpuUuid, str], dra: DraStatus | None
    ) -> Hashable:
        """Cheap to take, and different whenever the document would be: most cycles build nothing."""
        return (
            dra,
            tuple(self._container_limits()),
            self._stowaways(),
            len(asyncio.all_tasks()),
            self._reconciler.available,
            self._reconciler.successes,
            self._reconciler.failures,
            tuple(sorted(unhealthy_gpus.items())),
            tuple((v.inventory.generation, v.allocator.ledger.version, v.daemon, v.registration) for v in views),
        )

    def _write_status(self, document: StatusDocument) -> bool:
        """True when written. A failure (a full or read-only file system, something else in the file's place) is
        logged when it begins and when it ends, never raised: the file is for operators, serving goes on."""
        try:
            write_status(self._mps_root, document)
        except OSError as exc:
            self._unwritten.failed(os_reason(exc), path=str(self._mps_root / STATUS_FILE))
            return False
        self._unwritten.works(path=str(self._mps_root / STATUS_FILE))
        return True

    def _remove_status(self) -> None:
        try:
            remove_status(self._mps_root)
        except OSError as exc:
            log.warning("status file not removed", path=str(self._mps_root / STATUS_FILE), reason=os_reason(exc))

    async def run(self) -> None:
        seen: Hashable = None
        document: StatusDocument | None = None
        unwritten = False
        announced_ready = False
        try:
            while True:
                views, unhealthy_gpus, dra = self._resources(), self._unhealthy_gpus(), self._dra()
                fingerprint = self._fingerprint(views, unhealthy_gpus, dra)
                if document is None or fingerprint != seen:
                    seen, document = fingerprint, self._document(views, unhealthy_gpus, dra)
                    unwritten = True
                    if not announced_ready and not readiness_problems(document):
                        self._notifier.notify("READY=1")
                        announced_ready = True
                    self._notifier.status(summary(document))
                if unwritten:
                    unwritten = not self._write_status(document)
                if self._web is not None:
                    self._web.publish(document)  # every cycle: it is also the liveness heartbeat
                await anyio.sleep(STATUS_INTERVAL_S)
        finally:
            self._remove_status()


async def feed_watchdog(notifier: SystemdNotifier, interval_s: float) -> None:
    while True:
        notifier.notify("WATCHDOG=1")
        await anyio.sleep(interval_s)
