"""The kubelet's pod-resources API (v1 `List`) as the ledger's source of truth, and the task that reconciles.

Reconciliation runs at start-up, then periodically and soon after each Allocate, never faster than
MIN_SPACING_S (the kubelet allows 100 requests/s with a burst of 10 on this socket; we stay far below). When the
API is absent or refuses, the first failure is logged, retries back off, and everything else keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus
from grpclib.client import Channel
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from mpsagent._proto import v1 as podresources
from mpsagent.allocation import ResourceAllocator
from mpsagent.devices import ContainerRef
from mpsagent.logs import get_logger
from mpsagent.reconcile import ListedDevices, ReconcileResult, holdings

log = get_logger(__name__)

LIST_TIMEOUT_S = 5.0
MIN_SPACING_S = 0.2
PERIOD_MAX_S = 10.0
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0

PodResourcesFailure = (OSError, TimeoutError, GRPCError, StreamTerminatedError, ProtocolError)


async def list_devices(socket: Path, timeout_s: float = LIST_TIMEOUT_S) -> dict[str, list[ListedDevices]]:
    """Every container's device IDs from the kubelet's `List`, by resource name; raises a PodResourcesFailure."""
    channel = Channel(path=str(socket))
    try:
        response = await podresources.PodResourcesListerStub(channel).list(timeout=timeout_s)
    finally:
        channel.close()
    by_resource: dict[str, list[ListedDevices]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = ContainerRef(namespace=pod.namespace, pod=pod.name, container=container.name)
            for devices in container.devices:
                by_resource.setdefault(devices.resource_name, []).append(
                    ListedDevices(container=ref, device_ids=tuple(devices.device_ids))
                )
    return by_resource


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconcileTarget:
    """One resource to reconcile, and what to do once its ledger changed (hold the daemon's cap mode)."""

    allocator: ResourceAllocator
    on_ledger_changed: Callable[[], Awaitable[None]]


class PodResourcesReconciler:
    """Owns reconciliation for every resource of the agent; `run` is its long-lived task."""

    def __init__(
        self,
        *,
        socket: Path,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._socket = socket
        self._targets: list[ReconcileTarget] = []
        self._grace_s = grace_s
        # Twice per grace period, so that a gone container is released within 1.5 grace periods.
        self._period_s = min(PERIOD_MAX_S, max(MIN_SPACING_S, grace_s / 2))
        self._clock = clock
        self._wanted = anyio.Event()
        self._failing = False
        self.successes = 0
        self.failures = 0

    @property
    def available(self) -> bool:
        return self.successes > 0 and not self._failing

    def add_target(self, target: ReconcileTarget) -> None:
        """A resource to reconcile from now on (each resource's server is built with this reconciler's `request`,
        so the reconciler comes first and its targets after)."""
        self._targets.append(target)

    def request(self) -> None:
        """Ask for a reconciliation soon (after an Allocate)."""
        self._wanted.set()

    async def reconcile_once(self) -> bool:
        """One `List` and reconciliation of every resource; False (logged) when the API failed."""
        try:
            listing = await list_devices(self._socket)
        except PodResourcesFailure as exc:
            self.failures += 1
            if not self._failing:
                log.warning(
                    "kubelet pod-resources unavailable; grants are not reconciled until it answers",
                    socket=str(self._socket),
                    reason=str(exc) or type(exc).__name__,
                )
            self._failing = True
            return False
        if self._failing:
            log.info("kubelet pod-resources available again", socket=str(self._socket))
        self._failing = False
        self.successes += 1
        now = self._clock()
        for target in self._targets:
            resource = target.allocator.resource.name
            result = target.allocator.reconcile(holdings(listing.get(resource, [])), now=now, grace_s=self._grace_s)
            _log_result(resource, result)
            # The first answer also settles the mode a daemon took while the grants were unknown.
            if result.ledger_changed or self.successes == 1:
                await target.on_ledger_changed()
        return True

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        backoff = BACKOFF_INITIAL_S
        while True:
            wait = self._period_s if not self._failing else backoff
            with anyio.move_on_after(wait):
                await self._wanted.wait()
            self._wanted = anyio.Event()
            backoff = BACKOFF_INITIAL_S if await self.reconcile_once() else min(backoff * 2, BACKOFF_MAX_S)
            await anyio.sleep(MIN_SPACING_S)


def _log_result(resource: str, result: ReconcileResult) -> None:
    for grant in result.identified:
        log.info("grant identified", resource=resource, grant=grant.grant_id, container=str(grant.owner))
    for grant in result.replaced:
        log.warning(
            "grant replaced: the kubelet lists its replicas in other containers",
            resource=resource,
            grant=grant.grant_id,
        )
    for grant in result.adopted:
        log.info(
            "grant adopted from the kubelet",
            resource=resource,
            grant=grant.grant_id,
            kind=grant.kind.value,
            replicas=len(grant.replica_ids),
            container=str(grant.owner),
        )
    for grant in result.released:
        log.info(
            "grant released: its container is gone",
            resource=resource,
            grant=grant.grant_id,
            kind=grant.kind.value,
            replicas=len(grant.replica_ids),
            container=str(grant.owner) if grant.owner else None,
        )
