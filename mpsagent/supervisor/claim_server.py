"""The DRA driver's wiring (`--dra on`): the driver (`dra.driver`: prepares and unprepares over the domain's
`ClaimGrants` and the resources' ceilings) served to the kubelet, the node's ResourceSlice kept published as the
node's accounting and health say, the replicas the device plugins withhold beside the claims, each device's
health told to the kubelet, and the administrators' DeviceTaintRules on the node's devices followed, all owned as
one task; and the DRA part of the status document.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from mpsagent.base.backoff import Backoff
from mpsagent.base.devices import GpuUuid, ResourceName
from mpsagent.base.logs import get_logger
from mpsagent.base.values import TaintEffect
from mpsagent.documents.status import claim_status, taint_rule_status
from mpsagent.documents.status_document import DraStatus
from mpsagent.domain.claim_grants import ClaimGrants
from mpsagent.domain.claim_shares import device_name, node_slice
from mpsagent.domain.claims import DRA_DRIVER, NodeSlice
from mpsagent.domain.plan import NodePlan
from mpsagent.dra.api import KubeApi, connect
from mpsagent.dra.driver import ClaimDriver, PrepareTimer
from mpsagent.dra.endpoint import DraEndpoint
from mpsagent.dra.health_service import DeviceHealth, DeviceHealthBoard
from mpsagent.dra.prepared_claims import CHECKPOINT_FILE
from mpsagent.dra.slice_publisher import SlicePublisher
from mpsagent.dra.taint_rule_watch import NOT_LISTED, TaintRuleWatcher
from mpsagent.kubelet.memory_limit_devices import MemoryLimitDevices
from mpsagent.supervisor.resource_server import ResourceServer

log = get_logger("mpsagent.claim_server")

TAINT_RULES_BACKOFF_S = (1.0, 30.0)
"""A failed list or watch of the DeviceTaintRules is tried again after this long, growing to the most."""
FOLLOW_INTERVAL_S = 0.2
"""How often the node's accounting and health are looked at for a change the slice, the withheld replicas and the
health streams must show (a look is a few integer comparisons)."""


class ClaimServer:
    """Builds the DRA driver over the resource servers and owns what serves and follows it."""

    def __init__(
        self,
        *,
        plan: NodePlan,
        resources: Sequence[ResourceServer],
        node: str,
        kubelet_dir: Path,
        cdi_dir: Path,
        kubeconfig: Path | None,
        prepare_timer: PrepareTimer | None = None,
        api: KubeApi | None = None,
        unhealthy_effect: TaintEffect = TaintEffect.NO_SCHEDULE,
        limit_devices: MemoryLimitDevices | None = None,
    ) -> None:
        """`prepare_timer`: told each claim's prepare time and outcome; `api`: the API server's client (None: `run`
        connects with `kubeconfig`, or the pod's service account)."""
        self._plan = plan
        self._resources = {ResourceName(server.plan.name): server for server in resources}
        self._gpu_resource = {gpu.uuid: server for server in resources for gpu in server.plan.gpus}
        self._node = node
        self._kubeconfig = kubeconfig
        self._grants = ClaimGrants(
            plan,
            {name: server.allocator for name, server in self._resources.items()},
            node,
            problem=self._problem,
            unhealthy_effect=unhealthy_effect,
        )
        self.driver = ClaimDriver(
            grants=self._grants,
            ceilings={name: server.set_ceilings for name, server in self._resources.items()},
            node=node,
            cdi_dir=cdi_dir,
            checkpoint_path=plan.mps_root / CHECKPOINT_FILE,
            limit_devices=None if limit_devices is None else limit_devices.ensure,
            prepare_timer=prepare_timer,
        )
        self._api = api
        if api is not None:
            self.driver.connected(api)
        self._publisher: SlicePublisher | None = None
        self._taint_rules: TaintRuleWatcher | None = None
        self.slice: NodeSlice = node_slice(plan, node)
        self._followed: tuple[tuple[int, int], ...] | None = None
        """The node's generations (`_generations`) when the slice, the withheld replicas and the health were last
        worked out: while they hold, so does what was worked out."""
        self.health = DeviceHealthBoard(self._device_health())
        self.endpoint = DraEndpoint(kubelet_dir=kubelet_dir, driver=DRA_DRIVER, handler=self.driver, health=self.health)

    @property
    def api(self) -> KubeApi:
        """The API server's client, once `run` has started."""
        assert self._api is not None, "the claim server has not started"
        return self._api

    def _problem(self, uuid: GpuUuid) -> str | None:
        server = self._gpu_resource.get(uuid)
        return None if server is None else server.inventory.problem(uuid)

    def restore(self) -> int:
        """The driver's checkpointed claims held again (`ClaimDriver.restore`), before the daemons start."""
        return self.driver.restore()

    def status(self) -> DraStatus:
        publisher, taint_rules = self._publisher, self._taint_rules
        counts = self.driver.counts
        return DraStatus(
            driver=DRA_DRIVER,
            node=self._node,
            registered=self.endpoint.registration.statistics().registered,
            slice_published=publisher is not None and publisher.published and not publisher.publishing.failing,
            slice_writes=0 if publisher is None else publisher.writes,
            prepared=counts.prepared,
            refused=counts.refused,
            unprepared=counts.unprepared,
            claims=tuple(claim_status(prepared) for prepared in self.driver.prepared_claims()),
            health_watched=() if self.endpoint.health_service is None else self.endpoint.health_service.watched,
            taint_rules=() if taint_rules is None else tuple(taint_rule_status(*on) for on in taint_rules.rules),
            taint_rules_unseen=NOT_LISTED if taint_rules is None else taint_rules.unseen,
        )

    # --- the task --------------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect to the API server, serve the kubelet's DRA calls, keep the node's slice published and the
        withheld replicas and devices' health current; the publisher removes the slice on the way out."""
        if self._api is None:
            self._api = await connect(self._kubeconfig)
        self.driver.connected(self._api)
        self._publisher = SlicePublisher(self._api, driver=DRA_DRIVER, node=self._node)
        self._taint_rules = TaintRuleWatcher(self._api, self.slice, backoff=Backoff(*TAINT_RULES_BACKOFF_S))
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.follow)
                await tg.start(self.endpoint.run)
                await tg.start(self._publisher.run)
                tg.start_soon(self._taint_rules.run)
                log.info("dra driver serving", driver=DRA_DRIVER, node=self._node, devices=len(self.slice.devices))
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self._api.close()

    async def follow(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Show the node's accounting and health as they change: at once after each prepare or unprepare that
        changed the ledgers, and every FOLLOW_INTERVAL_S for what changes elsewhere (a device-plugin grant, a GPU's
        health). Reports started once it has shown them the first time."""
        seen = self.driver.changes.count
        self._follow_node()
        task_status.started()
        while True:
            with anyio.move_on_after(FOLLOW_INTERVAL_S):
                seen = await self.driver.changes.wait(seen)
            self._follow_node()

    def _follow_node(self) -> None:
        """Show what the node's accounting and health say now: the slice's capacity and taints, the replicas
        ListAndWatch withholds, the devices' health (each only when it changed); nothing to do while the node's
        generations are those of the last time."""
        if self._generations() == self._followed:
            return
        self.slice = node_slice(self._plan, self._node, self._grants.room(now=time.time()))
        if self._publisher is not None:
            self._publisher.want(self.slice)
        for server in self._resources.values():
            _show_withheld(server)
        self.health.show(self._device_health())
        self._followed = self._generations()  # after the pass: the withheld replicas it set moved a generation

    def _generations(self) -> tuple[tuple[int, int], ...]:
        """Each resource's ledger (its grants and claims) and inventory (its GPUs' health, withheld replicas)
        generations: all the slice, the withheld replicas and the devices' health are worked out from."""
        return tuple(
            (server.allocator.ledger.tally.changes, server.inventory.generation) for server in self._resources.values()
        )

    def _device_health(self) -> tuple[DeviceHealth, ...]:
        return tuple(
            DeviceHealth(pool=self._node, device=device_name(gpu), problem=self._problem(gpu.uuid))
            for resource in self._plan.resources
            for gpu in resource.gpus
        )


def _show_withheld(server: ResourceServer) -> None:
    """The replicas the resource's ListAndWatch withholds beside the claims, as its allocator says now; each change
    logged."""
    before = {gpu.uuid: gpu for gpu in server.inventory.withheld()}
    if not server.inventory.set_withheld(server.allocator.withheld()):
        return
    now = {gpu.uuid: gpu for gpu in server.inventory.withheld()}
    for withheld in now.values():
        if before.get(withheld.uuid) != withheld:
            log.info(
                "replicas withheld beside the claims",
                resource=server.plan.name,
                gpu=withheld.uuid,
                replicas=len(withheld.replica_ids),
                reason=withheld.reason,
            )
    for uuid in before.keys() - now.keys():
        log.info("withheld replicas offered again", resource=server.plan.name, gpu=uuid)
