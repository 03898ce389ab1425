"""The GPU health monitor: NVML critical-Xid events and periodic probes, turned into replica health.

NVML's calls block, so they run in worker threads: the event wait in slices of WAIT_SLICE_MS, so that
cancellation (shutdown) is never held up for long. A failure marks every replica of that GPU, in every resource
that advertises it, Unhealthy; nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio
from anyio.abc import TaskStatus

from mpsagent.base.backoff import Backoff
from mpsagent.base.devices import GpuUuid
from mpsagent.base.errors import GpuHealthError
from mpsagent.base.logs import get_logger
from mpsagent.base.values import XidPolicy
from mpsagent.domain.health import GpuHealthTracker
from mpsagent.domain.inventory import Inventory
from mpsagent.gpu.port import GpuEventWatch, GpuHealthSource, XidEvent

log = get_logger(__name__)

HEALTH_SOURCE = "nvml"
WAIT_SLICE_MS = 500
PROBE_INTERVAL_MAX_S = 5.0
PROBE_INTERVAL_MIN_S = 0.1
REOPEN_BACKOFF_INITIAL_S = 1.0
REOPEN_BACKOFF_MAX_S = 30.0


def probe_interval(recovery_s: float) -> float:
    """Probe often enough that a recovery is seen within a quarter of the quiet period after it is due."""
    return min(PROBE_INTERVAL_MAX_S, max(PROBE_INTERVAL_MIN_S, recovery_s / 4))


class GpuHealthMonitor:
    def __init__(
        self,
        *,
        source: GpuHealthSource,
        inventories: Sequence[Inventory],
        uuids: Sequence[GpuUuid],
        policy: XidPolicy,
        recovery_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._inventories = inventories
        self._policy = policy
        self._tracker = GpuHealthTracker(uuids, recovery_s)
        self._probe_interval_s = probe_interval(recovery_s)
        self._clock = clock

    def unhealthy(self) -> dict[GpuUuid, str]:
        return self._tracker.unhealthy()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if not self._policy.watching:
            log.info("gpu health checks disabled", reason="DP_DISABLE_HEALTHCHECKS")
            task_status.started()
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_events)
            tg.start_soon(self._probe)
            task_status.started()

    # --- failures and recoveries ---------------------------------------------------------------------------

    def _fail(self, uuid: GpuUuid, reason: str) -> None:
        if self._tracker.fail(uuid, reason, self._clock()):
            log.error("gpu unhealthy; its replicas are withdrawn", gpu=uuid, reason=reason)
            self._mark(uuid, True)

    def _fail_all(self, reason: str) -> None:
        for uuid in self._tracker.uuids:
            self._fail(uuid, reason)

    def _mark(self, uuid: GpuUuid, unhealthy: bool) -> None:
        reason = self._tracker.reason(uuid) or ""
        for inventory in self._inventories:
            if inventory.has_gpu(uuid):
                inventory.set_gpu_problem(uuid, HEALTH_SOURCE, unhealthy, reason)

    # --- events ---------------------------------------------------------------------------------------------

    async def _watch_events(self) -> None:
        retry = Backoff(REOPEN_BACKOFF_INITIAL_S, REOPEN_BACKOFF_MAX_S)
        while True:
            opened_at = self._clock()
            try:
                watch = await anyio.to_thread.run_sync(self._source.watch_events, self._tracker.uuids)
            except GpuHealthError as exc:
                self._fail_all(str(exc))
            else:
                log.info("gpu events watched", gpus=len(self._tracker.uuids) - len(watch.registration_problems))
                for uuid, problem in watch.registration_problems.items():
                    log.warning("gpu events not watched; only its loss is", gpu=uuid, reason=problem)
                try:
                    await self._handle_events(watch)
                except GpuHealthError as exc:
                    # As the NVIDIA device plugin: when the wait fails, no GPU can be trusted.
                    self._fail_all(str(exc))
                finally:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(watch.close)
            if self._clock() - opened_at > REOPEN_BACKOFF_MAX_S:
                retry.reset()  # a watch that worked for a while starts the backoff afresh
            await retry.wait()

    async def _handle_events(self, watch: GpuEventWatch) -> None:
        while True:
            event = await anyio.to_thread.run_sync(watch.wait, WAIT_SLICE_MS)
            if event is not None:
                self._handle(event)

    def _handle(self, event: XidEvent) -> None:
        if not self._policy.is_critical(event.xid):
            log.info("gpu xid ignored", gpu=event.uuid, xid=event.xid, reason="application error or disabled")
            return
        reason = f"critical Xid {event.xid}"
        if event.uuid is None:
            self._fail_all(f"{reason} from a GPU NVML could not name")
        elif event.uuid in self._tracker.uuids:
            self._fail(event.uuid, reason)
        else:
            log.info("gpu xid for a GPU not advertised", gpu=event.uuid, xid=event.xid)

    # --- probes ---------------------------------------------------------------------------------------------

    async def _probe(self) -> None:
        while True:
            await anyio.sleep(self._probe_interval_s)
            for uuid in self._tracker.uuids:
                problem = await anyio.to_thread.run_sync(self._source.probe, uuid)
                if problem is not None:
                    self._fail(uuid, problem)
                elif self._tracker.answered(uuid, self._clock()):
                    log.info("gpu healthy again; its replicas are back", gpu=uuid)
                    self._mark(uuid, False)
