"""One resource's server: its allocator (and ledger), inventory, MPS daemon supervisor, gRPC servicer and plugin
endpoint, built whole before anything runs, and one task that runs the daemon supervisor, then the endpoint.

Every path that needs the daemon to hold the ledger's ceilings (an Allocate, a PreStartContainer, a
reconciliation) goes through `set_ceilings`: a daemon that cannot hold them is the same failure for all three, raised
to an RPC (which answers UNAVAILABLE and changes nothing) and logged for a reconciliation (which has no caller).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from mpsagent.base.errors import DaemonError
from mpsagent.base.logs import get_logger
from mpsagent.base.settings import Settings
from mpsagent.deviceplugin.endpoint import PluginEndpoint
from mpsagent.deviceplugin.servicer import DevicePluginServicer, RpcTimer
from mpsagent.documents.status import ResourceView
from mpsagent.domain.allocation import ContainerAllocation, ResourceAllocator
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import ResourcePlan
from mpsagent.gpu.port import GpuSource
from mpsagent.kubelet.memory_limit_devices import MemoryLimitDevices
from mpsagent.mps.daemon import DaemonSupervisor
from mpsagent.mps.hold_watch import OnEnded

log = get_logger("mpsagent.resource_server")

MAX_LOGGED_GRANTS = 5


class ResourceServer:
    def __init__(
        self,
        *,
        plan: ResourcePlan,
        shm_directory: Path,
        settings: Settings,
        gpu_source: GpuSource,
        rpc_timer: RpcTimer | None,
        reconcile_soon: Callable[[], None],
        on_hold_ended: OnEnded = lambda ended: None,
        limit_devices: MemoryLimitDevices | None = None,
    ) -> None:
        """`reconcile_soon`: called after each answered Allocate, to have the kubelet's listing read soon;
        `on_hold_ended`: told of each control-socket connection the daemon supervisor ended."""
        self.plan = plan
        self.inventory = Inventory(plan)
        self.allocator = ResourceAllocator(plan, shm_directory, problem=self.inventory.problem)
        self.daemon = DaemonSupervisor(
            resource=plan,
            inventory=self.inventory,
            gpu_source=gpu_source,
            control_bin=settings.mps_control_bin,
            on_exit=settings.mps_on_exit,
            owner=settings.mps_daemon,
            probe_interval_s=settings.probe_interval_s,
            control_hold_s=settings.control_hold_s,
            on_hold_ended=on_hold_ended,
        )
        self._reconcile_soon = reconcile_soon
        servicer = DevicePluginServicer(
            self.allocator,
            self.inventory,
            pre_start_required=plan.enforce_caps,
            set_ceilings=self.set_ceilings,
            on_granted=self._on_granted,
            rpc_timer=rpc_timer,
            ensure_limit_devices=None if limit_devices is None else limit_devices.ensure,
        )
        self.endpoint = PluginEndpoint(
            resource_name=plan.name,
            servicer=servicer,
            kubelet_socket=settings.kubelet_socket,
            pre_start_required=plan.enforce_caps,
        )
        self._running = False
        self._log = log.bind(resource=plan.name)

    def grants_known(self) -> None:
        """The kubelet's listing is in the ledger (before the daemon starts): the daemon starts, or keeps an
        adopted daemon, at the ledger's ceilings instead of the safe ones for unknown grants."""
        self.daemon.want_ceilings(self.allocator.ceilings())

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The daemon supervisor (reports once the daemon holds its ceilings), then the endpoint; reports started
        once the endpoint serves."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.daemon.run)
            self._running = True
            await tg.start(self.endpoint.run)
            task_status.started()

    async def set_ceilings(self, *, verify: bool = False) -> None:
        """Make the daemon hold the ceilings the ledger's live grants need (`verify`: read back even ceilings it is
        believed to hold); raises DaemonError when it cannot."""
        await self.daemon.set_ceilings(self.allocator.ceilings(), verify=verify)

    async def hold_ledger_ceilings(self) -> None:
        """After a reconciliation changed the ledger: as `set_ceilings`, logged instead of raised (a daemon that is
        down takes the ceilings when it is back; before the daemon runs, `grants_known` does this)."""
        if not self._running:
            return
        try:
            await self.set_ceilings()
        except DaemonError as exc:
            self._log.error("mps daemon caps not changed", reason=str(exc))

    def view(self) -> ResourceView:
        return ResourceView(
            allocator=self.allocator,
            inventory=self.inventory,
            daemon=self.daemon.status(),
            registration=self.endpoint.registration(),
        )

    def _on_granted(self, allocations: Sequence[ContainerAllocation]) -> None:
        for allocation in allocations:
            grant = allocation.record.grant
            self._log.info(
                "granted",
                grant=grant.grant_id,
                kind=grant.kind.value,
                share=grant.share.describe(),
                replicas=len(grant.replica_ids),
                gpus=sorted(gpu.uuid for gpu in grant.share.gpus),
            )
            ended = allocation.record.ended
            if ended:
                # One line per Allocate however many grants it ends: a full grant can end hundreds at once.
                self._log.warning(
                    "replicas granted again while believed live",
                    grant=grant.grant_id,
                    earlier_grants=[g.grant_id for g in ended[:MAX_LOGGED_GRANTS]],
                    earlier_grant_count=len(ended),
                    containers=sorted({str(g.owner) for g in ended if g.owner})[:MAX_LOGGED_GRANTS],
                    replicas=len(grant.superseded_ids),
                )
        self._reconcile_soon()
