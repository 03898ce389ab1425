"""The kubelet's pod-resources API (v1 `List`) as the ledger's source of truth, and the task that reconciles.

Reconciliation runs at start-up, then periodically and at FOLLOW_UP_S after each Allocate, never faster than
MIN_SPACING_S (the kubelet allows 100 requests/s with a burst of 10 on this socket; we stay far below). When the
API is absent or refuses, the first failure is logged, retries back off, and everything else keeps serving.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus
from grpclib.client import Channel
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from mpsagent._proto import v1 as podresources
from mpsagent.base.backoff import Backoff
from mpsagent.base.devices import ContainerRef
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.logs import get_logger
from mpsagent.domain.allocation import ResourceAllocator, describe_ids
from mpsagent.domain.reconcile import ListedDevices, ReconcileResult, listed_grants

log = get_logger(__name__)

LIST_TIMEOUT_S = 5.0
MIN_SPACING_S = 0.2
PERIOD_MAX_S = 10.0
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
FOLLOW_UP_S = (0.2, 0.5, 1.0, 2.0, 4.0)
"""When to look again after an Allocate (seconds after it), until every grant has been listed. The kubelet records
a container's devices only once its Allocate has returned (within milliseconds), so a lookup at once cannot show
them and the first follow-up, at the shortest spacing, usually does; the later ones, each about twice as far, cover
a kubelet busy admitting other pods. At most 5 lookups per Allocate, fewer when Allocates come closer together than
the spacing (they share them). A grant still unlisted after 4 s is most likely of a pod that failed admission after
its Allocate: the periodic lookup and the grace period settle it."""

PERIOD_OF_GRACE = 0.4
"""The periodic lookup's spacing, as a part of the grace period."""

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
        # A gone container is seen gone within a period (and the lookup's own time), and released by the lookup due
        # at the end of its grace period (`_release_due`): within 1.5 grace periods of leaving the listing, with a
        # tenth of one to spare for lookups that a busy node delays.
        self._period_s = min(PERIOD_MAX_S, max(MIN_SPACING_S, PERIOD_OF_GRACE * grace_s))
        self._release_due: float | None = None
        """The clock time at which the first unlisted grant's grace period ends; None while no grant is unlisted."""
        self._clock = clock
        self._wanted = anyio.Event()
        self._waiting_until = math.inf
        """The clock time of the lookup `run` waits for; infinity while it does not wait."""
        self._follow_ups: list[float] = []
        """Clock times of the lookups due after Allocates, sorted; none closer together than MIN_SPACING_S."""
        self._unavailable = FailureEpisodes(
            log,
            failed="kubelet pod-resources unavailable; grants are not reconciled until it answers",
            level="warning",
            again="kubelet pod-resources available again",
        )
        self.successes = 0

    @property
    def failures(self) -> int:
        return self._unavailable.failures

    @property
    def available(self) -> bool:
        return self.successes > 0 and not self._unavailable.failing

    def add_target(self, target: ReconcileTarget) -> None:
        """A resource to reconcile from now on (each resource's server is built with this reconciler's `request`,
        so the reconciler comes first and its targets after)."""
        self._targets.append(target)

    def request(self) -> None:
        """An Allocate was answered: look at FOLLOW_UP_S after it, until every grant has been listed."""
        now = self._clock()
        for delay in FOLLOW_UP_S:
            due = now + delay
            near = bisect.bisect_left(self._follow_ups, due - MIN_SPACING_S)
            if near == len(self._follow_ups) or self._follow_ups[near] > due + MIN_SPACING_S:
                bisect.insort(self._follow_ups, due)
        # Waking `run` costs more than the rest of this: only when its next lookup comes sooner now (a burst of
        # Allocates keeps the first one's first follow-up). While the API fails, the backoff alone sets the next
        # lookup: a wake would only find that out again, once per Allocate.
        if not self._unavailable.failing and self._follow_ups[0] < self._waiting_until:
            self._wanted.set()

    def _next_lookup(self, rested: float, retry: Backoff) -> float:
        """The clock time of the next lookup, for a loop that rests since `rested`."""
        if self._unavailable.failing:
            return rested + retry.delay
        due: list[float] = [rested + self._period_s, *self._follow_ups[:1]]
        if self._release_due is not None:
            due.append(max(self._release_due, rested))
        return min(due)

    def _settle_follow_ups(self) -> None:
        """After a lookup: the follow-ups it made are done, and none is needed while every grant has been listed."""
        now = self._clock()
        if self._unavailable.failing or any(target.allocator.ledger.never_listed() for target in self._targets):
            del self._follow_ups[: bisect.bisect_right(self._follow_ups, now)]
        else:
            self._follow_ups.clear()

    async def reconcile_once(self) -> bool:
        """One `List` and reconciliation of every resource; False (logged) when the API failed."""
        try:
            listing = await list_devices(self._socket)
        except PodResourcesFailure as exc:
            self._unavailable.failed(str(exc) or type(exc).__name__, socket=str(self._socket))
            return False
        self._unavailable.works(socket=str(self._socket))
        self.successes += 1
        now = self._clock()
        self._release_due = None
        for target in self._targets:
            resource = target.allocator.resource.name
            result = target.allocator.reconcile(
                listed_grants(listing.get(resource, [])), now=now, grace_s=self._grace_s
            )
            _log_result(resource, result)
            if result.next_release_at is not None:
                self._release_due = min(result.next_release_at, self._release_due or math.inf)
            # The first answer also settles the mode a daemon took while the grants were unknown.
            if result.ledger_changed or self.successes == 1:
                await target.on_ledger_changed()
        return True

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        retry = Backoff(BACKOFF_INITIAL_S, BACKOFF_MAX_S)
        while True:
            rested = self._clock()
            while (wait := (due := self._next_lookup(rested, retry)) - self._clock()) > 0:
                self._waiting_until = due
                with anyio.move_on_after(wait):
                    await self._wanted.wait()  # an Allocate whose first follow-up comes sooner
                self._waiting_until = math.inf
                self._wanted = anyio.Event()
            if await self.reconcile_once():
                retry.reset()
            else:
                retry.grow()
            self._settle_follow_ups()
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
    for grant in result.unplaced:
        log.warning(
            "grant adopted with device IDs this resource does not advertise; it counts as the smallest share",
            resource=resource,
            grant=grant.grant_id,
            container=str(grant.owner),
            ids=describe_ids(grant.replica_ids),
            hint="a grant of an earlier configuration (other replicas, memory unit or GPUs): it keeps the smallest "
            "share's ceilings until its pod ends; restart such pods to give them their share",
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
