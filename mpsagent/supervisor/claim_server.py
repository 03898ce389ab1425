"""The DRA driver's server (`--dra on`): prepares and unprepares claims for the kubelet, keeps the node's
ResourceSlice published as the node's accounting and health say, tells the kubelet each device's health, and owns
all of it as one task.

It decides nothing itself: the domain's `ClaimGrants` decides and holds each claim's shares (the same accounting a
device-plugin Allocate meets), and the server carries it out. A NodePrepareResources call is one batch: its claims
are read from the API server at once (bounded), decided one by one, then the daemons are made to hold the ceilings
once, the claims' CDI specs are written, and the checkpoint saved once, in that order. A claim that fails at any
step holds nothing; the others of its batch stand. Prepare and unprepare are idempotent (the kubelet retries): a
prepared claim is answered from what it holds, an unknown claim is unprepared at once. DRA says when a claim ends, so
unprepare releases at once, with no grace period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import anyio
import msgspec
from anyio.abc import TaskStatus

from mpsagent.base.clock import utc
from mpsagent.base.devices import GpuUuid, ResourceName
from mpsagent.base.errors import DaemonError, HostError, KubeApiError, MpsAgentError, RequestError
from mpsagent.base.logs import get_logger
from mpsagent.base.values import TaintEffect
from mpsagent.base.words import counted
from mpsagent.documents.status_document import ClaimDeviceStatus, ClaimStatus, DraStatus
from mpsagent.domain.claim_grants import ClaimGrants, LiveClaim
from mpsagent.domain.claim_shares import device_name, node_slice
from mpsagent.domain.claims import DRA_DRIVER, ClaimAllocation, ClaimRef, NodeSlice, PreparedClaim
from mpsagent.domain.grant_kind import describe_claim_share
from mpsagent.domain.plan import NodePlan
from mpsagent.dra import cdi, checkpoint
from mpsagent.dra.api import KubeApi, connect
from mpsagent.dra.endpoint import DraEndpoint
from mpsagent.dra.health_service import DeviceHealth
from mpsagent.dra.node_service import PrepareOutcome
from mpsagent.dra.slice_publisher import SlicePublisher
from mpsagent.kubelet.cdi_spec import CdiDevice
from mpsagent.kubelet.memory_limit_devices import MemoryLimitDevices
from mpsagent.supervisor.resource_server import ResourceServer

log = get_logger("mpsagent.claim_server")

CHECKPOINT_FILE = "dra-claims.json"
MAX_CONCURRENT_READS = 8
"""Claims of one call read from the API server at once."""
FOLLOW_INTERVAL_S = 0.2
"""How often the node's accounting and health are looked at for a change the slice, the withheld replicas and the
health streams must show (a look is a few integer comparisons)."""


class ClaimServer:
    """Implements the DRA node service's `ClaimHandler` and the health service's `DeviceHealthSource`."""

    def __init__(
        self,
        *,
        plan: NodePlan,
        resources: Sequence[ResourceServer],
        node: str,
        kubelet_dir: Path,
        cdi_dir: Path,
        kubeconfig: Path | None,
        prepare_timer: Callable[[float, str], None] | None = None,
        api: KubeApi | None = None,
        unhealthy_effect: TaintEffect = TaintEffect.NO_SCHEDULE,
        limit_devices: MemoryLimitDevices | None = None,
    ) -> None:
        """`prepare_timer`: called with each claim's prepare time in seconds and its outcome (ok, refused); `api`:
        the API server's client (None: `run` connects with `kubeconfig`, or the pod's service account)."""
        self._plan = plan
        self._resources = {ResourceName(server.plan.name): server for server in resources}
        self._gpu_resource = {gpu.uuid: server for server in resources for gpu in server.plan.gpus}
        self._node = node
        self._cdi_dir = cdi_dir
        self._kubeconfig = kubeconfig
        self._checkpoint = plan.mps_root / CHECKPOINT_FILE
        self._grants = ClaimGrants(
            plan,
            {name: server.allocator for name, server in self._resources.items()},
            node,
            problem=self._problem,
            unhealthy_effect=unhealthy_effect,
        )
        self._live: dict[str, LiveClaim] = {}
        self._lock = anyio.Lock()
        self._limit_devices = limit_devices
        self._api = api
        self._publisher: SlicePublisher | None = None
        self.slice: NodeSlice = node_slice(plan, node)
        self.endpoint = DraEndpoint(kubelet_dir=kubelet_dir, driver=DRA_DRIVER, handler=self, health=self)
        self._prepare_timer = prepare_timer
        self._health: tuple[DeviceHealth, ...] = self._device_health()
        self._health_generation = 0
        self._health_changed = anyio.Event()
        self.prepared_total = 0
        self.unprepared_total = 0
        self.refused_total = 0

    @property
    def api(self) -> KubeApi:
        """The API server's client, once `run` has started."""
        assert self._api is not None, "the claim server has not started"
        return self._api

    def _problem(self, uuid: GpuUuid) -> str | None:
        server = self._gpu_resource.get(uuid)
        return None if server is None else server.inventory.problem(uuid)

    # --- start: what the checkpoint holds ---------------------------------------------------------------

    def restore(self) -> int:
        """Hold the checkpointed claims' shares again (before the daemons start, so that they start at ceilings
        that cover them), each checked as a fresh prepare is, write their CDI specs again (written without fsync:
        one lost with a power cut is whole again), and remove CDI specs of claims no longer prepared. Returns how
        many claims it holds. Raises HostError naming the file and the entry that breaks a rule, or the spec that
        cannot be written."""
        for index, prepared in enumerate(checkpoint.load(self._checkpoint)):
            try:
                live = self._grants.restore(prepared)
            except RequestError as exc:
                for earlier in self._live.values():
                    self._grants.release(earlier)
                self._live.clear()
                raise HostError(
                    f"the DRA checkpoint {self._checkpoint} entry {index} (claim {prepared.claim}) cannot be held "
                    f"again: {exc}; if the claim's pods are gone, delete the file: the kubelet prepares each claim "
                    "again on its next try"
                ) from exc
            self._live[prepared.claim.uid] = live
        for live in self._live.values():
            cdi.write_claim_spec(self._cdi_dir, live.prepared.claim.uid, _spec_devices(live))
        for uid in cdi.claim_spec_uids(self._cdi_dir) - set(self._live):
            cdi.remove_claim_spec(self._cdi_dir, uid)
            log.info("cdi spec of a claim no longer prepared removed", claim_uid=uid)
        if self._live:
            log.info("prepared claims restored", claims=len(self._live), checkpoint=str(self._checkpoint))
        return len(self._live)

    def status(self) -> DraStatus:
        publisher = self._publisher
        return DraStatus(
            driver=DRA_DRIVER,
            node=self._node,
            registered=self.endpoint.registration.statistics().registered,
            slice_published=publisher is not None and publisher.published and not publisher.publishing.failing,
            slice_writes=0 if publisher is None else publisher.writes,
            prepared=self.prepared_total,
            refused=self.refused_total,
            unprepared=self.unprepared_total,
            claims=tuple(_claim_status(live.prepared) for live in self._live.values()),
        )

    def prepared_claims(self) -> tuple[PreparedClaim, ...]:
        """The claims prepared now, with the pods each is reserved for as last read."""
        return tuple(live.prepared for live in self._live.values())

    async def read_pods_again(self, claim_uids: Iterable[str]) -> None:
        """Read again which pods the prepared claims `claim_uids` are reserved for: a pod that shares a claim
        prepared for another is never told to the driver. A claim that cannot be read keeps what it had (logged)."""
        for uid in sorted(claim_uids):
            live = self._live.get(uid)
            if live is None:
                continue
            ref = live.prepared.claim
            try:
                pods = await self.api.claim_pods(ref)
            except KubeApiError as exc:
                log.warning("claim's pods not read again", claim=str(ref), reason=str(exc))
                continue
            now = self._live.get(uid)
            if pods is None or now is not live or pods == live.prepared.pods:
                continue  # gone, or unprepared (and maybe prepared again) while it was read
            self._live[uid] = dataclasses.replace(live, prepared=msgspec.structs.replace(live.prepared, pods=pods))
            log.info("claim's pods read again", claim=str(ref), pods=list(pods))

    # --- the task --------------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect to the API server, serve the kubelet's DRA calls, keep the node's slice published and the
        withheld replicas and devices' health current; the publisher removes the slice on the way out."""
        if self._api is None:
            self._api = await connect(self._kubeconfig)
        self._publisher = SlicePublisher(self._api, driver=DRA_DRIVER, node=self._node)
        self._follow_node()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.endpoint.run)
                await tg.start(self._publisher.run)
                tg.start_soon(self._keep_following)
                log.info("dra driver serving", driver=DRA_DRIVER, node=self._node, devices=len(self.slice.devices))
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self._api.close()

    async def _keep_following(self) -> None:
        while True:
            await anyio.sleep(FOLLOW_INTERVAL_S)
            self._follow_node()

    def _follow_node(self) -> None:
        """Show what the node's accounting and health say now: the slice's capacity and taints, the replicas
        ListAndWatch withholds, the devices' health (each only when it changed)."""
        self.slice = node_slice(self._plan, self._node, self._grants.room(now=time.time()))
        if self._publisher is not None:
            self._publisher.want(self.slice)
        for server in self._resources.values():
            before = {gpu.uuid: gpu for gpu in server.inventory.withheld()}
            if server.inventory.set_withheld(server.allocator.withheld()):
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
        health = self._device_health()
        if health != self._health:
            self._health = health
            self._health_generation += 1
            self._health_changed.set()
            self._health_changed = anyio.Event()

    # --- the devices' health (DeviceHealthSource) -------------------------------------------------------

    def _device_health(self) -> tuple[DeviceHealth, ...]:
        return tuple(
            DeviceHealth(pool=self._node, device=device_name(gpu), problem=self._problem(gpu.uuid))
            for resource in self._plan.resources
            for gpu in resource.gpus
        )

    def device_health(self) -> Sequence[DeviceHealth]:
        return self._health

    @property
    def health_generation(self) -> int:
        return self._health_generation

    async def wait_health_changed(self, since: int) -> int:
        while self._health_generation == since:
            await self._health_changed.wait()
        return self._health_generation

    # --- the kubelet's calls ---------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareOutcome]:
        started = time.monotonic()
        outcomes: dict[str, PrepareOutcome] = {}
        for claim in claims:
            live = self._live.get(claim.uid)
            if live is not None:
                outcomes[claim.uid] = PrepareOutcome(devices=live.prepared.devices)
        to_read = [claim for claim in claims if claim.uid not in outcomes]
        read = await self._read_claims(to_read)
        async with self._lock:
            batch: list[LiveClaim] = []
            for claim in to_read:
                found = read[claim.uid]
                live = self._live.get(claim.uid)  # prepared meanwhile by a concurrent call
                if live is not None:
                    outcomes[claim.uid] = PrepareOutcome(devices=live.prepared.devices)
                elif isinstance(found, MpsAgentError):
                    outcomes[claim.uid] = self._refused(claim, found, started)
                else:
                    try:
                        batch.append(self._grants.prepare(found, now=time.time()))
                    except RequestError as exc:
                        outcomes[claim.uid] = self._refused(claim, exc, started)
            failures = await self._carry_out(batch)
            for live in batch:
                ref = live.prepared.claim
                failure = failures.get(ref.uid)
                outcomes[ref.uid] = (
                    self._refused(ref, failure, started) if failure is not None else self._prepared(live, started)
                )
        self._follow_node()
        return outcomes

    async def _read_claims(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimAllocation | MpsAgentError]:
        """Each claim's allocation from the API server, or why it could not be read; at most MAX_CONCURRENT_READS
        at once."""
        read: dict[str, ClaimAllocation | MpsAgentError] = {}
        limit = anyio.Semaphore(MAX_CONCURRENT_READS)

        async def one(claim: ClaimRef) -> None:
            async with limit:
                try:
                    if self._api is None:
                        raise KubeApiError(f"reading claim {claim}", "the agent is not connected to the API server yet")
                    read[claim.uid] = await self._api.read_claim(claim, driver=DRA_DRIVER, node=self._node)
                except MpsAgentError as exc:
                    read[claim.uid] = exc

        async with anyio.create_task_group() as tg:
            for claim in claims:
                tg.start_soon(one, claim)
        return read

    async def _carry_out(self, batch: Sequence[LiveClaim]) -> dict[str, MpsAgentError]:
        """Make the daemons hold the ceilings (once) while each claim's CDI spec and the checkpoint (once) are
        written: the front-end sessions wait on the daemons, the writes on the disk, so the prepare waits for the
        longer of the two, not their sum. The failure of each claim that does not stand, by UID; a claim that fails
        is released, its spec removed, and the checkpoint holds only the claims that stand."""
        if not batch:
            return {}
        earlier = [live.prepared for live in self._live.values()]
        daemon_failure: list[DaemonError] = []
        if self._limit_devices is not None:
            try:  # before the kubelet hands the runtime a name the spec does not have
                self._limit_devices.ensure([d.edits.memory_limits for live in batch for d in live.cdi_devices])
            except HostError as exc:
                return await self._undo(batch, exc, {})

        async def hold_ceilings() -> None:
            try:
                await self._hold_ceilings(frozenset().union(*(live.resources for live in batch)), raise_errors=True)
            except DaemonError as exc:
                daemon_failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_ceilings)
            failures, saved = await anyio.to_thread.run_sync(self._write_files, batch, earlier)
        if daemon_failure or saved is not None:
            # Every claim of the call fails; the checkpoint goes back to what it held before, when it was written.
            if saved is None:
                with contextlib.suppress(HostError):  # it lists claims the kubelet retries: answered as prepared
                    self._save()
            for live in batch if daemon_failure else ():
                failures.setdefault(live.prepared.claim.uid, _ceilings_not_held(live, daemon_failure[0]))
            return await self._undo(batch, saved, failures)
        self._live.update((live.prepared.claim.uid, live) for live in batch if live.prepared.claim.uid not in failures)
        failed = [live for live in batch if live.prepared.claim.uid in failures]
        return await self._undo(failed, None, failures) if failed else failures

    def _write_files(
        self, batch: Sequence[LiveClaim], earlier: Sequence[PreparedClaim]
    ) -> tuple[dict[str, MpsAgentError], HostError | None]:
        """Each claim's CDI spec, then the checkpoint of the earlier claims and those whose spec was written (in a
        worker thread). The failure of each spec by UID, and the checkpoint's (None: written)."""
        failures: dict[str, MpsAgentError] = {}
        for live in batch:
            try:
                cdi.write_claim_spec(self._cdi_dir, live.prepared.claim.uid, _spec_devices(live))
            except MpsAgentError as exc:
                failures[live.prepared.claim.uid] = exc
        standing = [live.prepared for live in batch if live.prepared.claim.uid not in failures]
        try:
            checkpoint.save(self._checkpoint, [*earlier, *standing])
        except HostError as exc:
            return failures, exc
        return failures, None

    async def _undo(
        self, failed: Sequence[LiveClaim], failure: MpsAgentError | None, failures: dict[str, MpsAgentError]
    ) -> dict[str, MpsAgentError]:
        """Release the failed claims (`failure` for each that has none yet), remove their specs, and bring the
        daemons back to the ceilings of what is left."""
        for live in failed:
            uid = live.prepared.claim.uid
            if failure is not None:
                failures.setdefault(uid, failure)
            self._grants.release(live)
            with contextlib.suppress(MpsAgentError):  # the failure to report is the one above
                cdi.remove_claim_spec(self._cdi_dir, uid)
        await self._hold_ceilings(frozenset().union(*(live.resources for live in failed)), raise_errors=False)
        return failures

    def _prepared(self, live: LiveClaim, started: float) -> PrepareOutcome:
        self.prepared_total += 1
        self._time(started, "ok")
        ref = live.prepared.claim
        log.info(
            "claim prepared",
            claim=str(ref),
            claim_uid=ref.uid,
            devices=[f"{d.device}: {describe_claim_share(d)}" for d in live.prepared.devices],
        )
        return PrepareOutcome(devices=live.prepared.devices)

    def _refused(self, claim: ClaimRef, failure: MpsAgentError, started: float) -> PrepareOutcome:
        self.refused_total += 1
        self._time(started, "refused")
        log.warning("claim not prepared", claim=str(claim), claim_uid=claim.uid, reason=str(failure))
        return PrepareOutcome(error=str(failure))

    def _time(self, started: float, outcome: str) -> None:
        if self._prepare_timer is not None:
            self._prepare_timer(time.monotonic() - started, outcome)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        answers = {}
        async with self._lock:
            for ref in claims:
                try:
                    answers[ref.uid] = await self._unprepare_one(ref)
                except MpsAgentError as exc:  # a claim UID no file can be named by, a spec that cannot go
                    answers[ref.uid] = str(exc)
        self._follow_node()
        return answers

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        """The checkpoint first: a claim it cannot drop stays prepared, whole, for the kubelet's retry."""
        live = self._live.pop(ref.uid, None)
        if live is None:
            cdi.remove_claim_spec(self._cdi_dir, ref.uid)
            return ""
        try:
            self._save()
        except HostError as exc:
            self._live[ref.uid] = live
            return str(exc)
        self._grants.release(live)
        await self._hold_ceilings(live.resources, raise_errors=False)
        self.unprepared_total += 1
        log.info("claim unprepared", claim=str(ref), claim_uid=ref.uid, devices=len(live.prepared.devices))
        cdi.remove_claim_spec(self._cdi_dir, ref.uid)  # a failure is the kubelet's retry's: the claim is unknown
        return ""

    async def _hold_ceilings(self, resources: frozenset[ResourceName], *, raise_errors: bool) -> None:
        for name in sorted(resources):
            server = self._resources[name]
            try:
                await server.set_ceilings()
                continue
            except DaemonError as exc:
                if raise_errors:
                    raise
                reason = str(exc)
            log.error("mps daemon caps not changed", resource=server.plan.name, reason=reason)

    def _save(self) -> None:
        checkpoint.save(self._checkpoint, [live.prepared for live in self._live.values()])


def live_claims_without_dra(checkpoint_path: Path) -> str | None:
    """With `--dra off`: why the agent must not start when the checkpoint still holds prepared claims (their pods may
    run, and without the claims the daemons' ceilings would drop below their caps), or None. Raises HostError for a
    checkpoint that cannot be read."""
    prepared = checkpoint.load(checkpoint_path)
    if not prepared:
        return None
    named = ", ".join(str(p.claim) for p in prepared[:5]) + (
        f" and {len(prepared) - 5} more" if len(prepared) > 5 else ""
    )
    return (
        f"--dra is off, but the DRA checkpoint {checkpoint_path} holds {counted(len(prepared), 'prepared claim')} "
        f"({named}) whose pods may still run: without them the MPS daemons' "
        "ceilings would drop below those pods' caps. Start with --dra on until those pods are gone (kubectl delete "
        "the pods, or drain the node), or, if none runs any more, remove the checkpoint"
    )


def _ceilings_not_held(live: LiveClaim, failure: DaemonError) -> DaemonError:
    """A claim whose GPUs' daemons did not take the ceilings it needs: which claim, which GPUs, and that nothing of
    it stands."""
    gpus = ", ".join(sorted({device.gpu for device in live.prepared.devices}))
    return DaemonError(
        f"claim {live.prepared.claim}: the MPS daemon of GPU {gpus} did not take the ceilings the claim needs "
        f"({failure}); nothing was prepared: the kubelet retries"
    )


def _spec_devices(live: LiveClaim) -> list[CdiDevice]:
    return [CdiDevice(name=d.name, envs=d.edits.envs, mounts=d.edits.mounts) for d in live.cdi_devices]


def _claim_status(prepared: PreparedClaim) -> ClaimStatus:
    return ClaimStatus(
        claim=str(prepared.claim),
        uid=prepared.claim.uid,
        pods=prepared.pods,
        devices=tuple(
            ClaimDeviceStatus(
                device=d.device,
                gpu=d.gpu,
                resource=d.resource,
                memory_mib=d.memory_mib,
                thread_percentage=d.thread_percentage,
                kind=d.kind,
                rounded_off_bytes=d.rounded_off_bytes,
            )
            for d in prepared.devices
        ),
        prepared_at=utc(prepared.prepared_at),
    )
