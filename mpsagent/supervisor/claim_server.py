"""The DRA driver's server (`--dra on`): prepares and unprepares claims for the kubelet, publishes the node's
ResourceSlice, and owns both as one task.

A claim's share of a GPU is held in the ledger of the resource whose MPS daemon serves that GPU (`Ledger.hold_claim`),
so the daemon's ceilings and MPS's client limit count device-plugin grants and claims alike; then the daemon is made
to hold the ceilings, the claim's CDI spec is written, and the prepared claims are checkpointed, in that order. A
prepare that fails at any step undoes the earlier ones and answers the claim's error: it holds nothing. Prepare and
unprepare are idempotent (the kubelet retries): a prepared claim is answered from what it holds, an unknown claim is
unprepared at once. DRA says when a claim ends, so unprepare releases at once, with no grace period.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from mpsagent.base.backoff import Backoff
from mpsagent.base.devices import ResourceName
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import DaemonError, HostError, KubeApiError, MpsAgentError, RequestError
from mpsagent.base.logs import get_logger
from mpsagent.documents.status_document import ClaimDeviceStatus, ClaimStatus, DraStatus, rounding
from mpsagent.domain.claim_shares import ClaimShare, claim_shares, node_slice
from mpsagent.domain.claims import DRA_DRIVER, ClaimRef, NodeSlice, PreparedClaim, PreparedDevice
from mpsagent.domain.ledger import Grant
from mpsagent.domain.plan import NodePlan
from mpsagent.dra import cdi, checkpoint
from mpsagent.dra.api import KubeApi, connect
from mpsagent.dra.endpoint import DraEndpoint
from mpsagent.dra.node_service import PrepareOutcome
from mpsagent.mps.daemon_status import utc
from mpsagent.supervisor.resource_server import ResourceServer

log = get_logger("mpsagent.claim_server")

CHECKPOINT_FILE = "dra-claims.json"
PUBLISH_BACKOFF_S = (1.0, 30.0)
REPUBLISH_INTERVAL_S = 60.0
"""How often the slice is applied again, so that one deleted behind the agent comes back."""
REMOVE_SLICES_TIMEOUT_S = 5.0


@dataclass(kw_only=True, slots=True)
class _Held:
    """A prepared claim and the ledger grants that hold its shares."""

    prepared: PreparedClaim
    grants: list[tuple[ResourceServer, Grant]]


class ClaimServer:
    """Implements the DRA node service's `ClaimHandler` over the resources' ledgers and daemons."""

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
    ) -> None:
        """`prepare_timer`: called with each claim's prepare time in seconds and its outcome (ok, refused); `api`:
        the API server's client (None: `run` connects with `kubeconfig`, or the pod's service account)."""
        self._plan = plan
        self._resources = {server.plan.name: server for server in resources}
        self._node = node
        self._cdi_dir = cdi_dir
        self._kubeconfig = kubeconfig
        self._checkpoint = plan.mps_root / CHECKPOINT_FILE
        self._held: dict[str, _Held] = {}
        self._lock = anyio.Lock()
        self._api = api
        self.slice: NodeSlice = node_slice(plan, node)
        self.slice_published = False
        self.publishing = FailureEpisodes(
            log,
            failed="resource slice not published",
            again="resource slice published again",
            hint="check that the agent's service account may write resourceslices (resource.k8s.io)",
        )
        self.endpoint = DraEndpoint(kubelet_dir=kubelet_dir, driver=DRA_DRIVER, handler=self)
        self._prepare_timer = prepare_timer
        self.prepared_total = 0
        self.unprepared_total = 0
        self.refused_total = 0

    # --- start: what the checkpoint holds ---------------------------------------------------------------

    def restore(self) -> int:
        """Hold the checkpointed claims' shares again (before the daemons start, so that they start at ceilings
        that cover them) and remove CDI specs of claims no longer prepared. Returns how many claims it holds."""
        for prepared in checkpoint.load(self._checkpoint):
            grants = []
            for device in prepared.devices:
                server = self._resources.get(ResourceName(device.resource))
                ordinal = server.plan.shares.ordinal_of(device.gpu) if server is not None else None
                if server is None or ordinal is None:
                    log.warning(
                        "prepared claim's GPU no longer shared",
                        claim=str(prepared.claim),
                        device=device.device,
                        gpu=device.gpu,
                        resource=device.resource,
                    )
                    continue
                share = server.plan.shares.capacity_share(ordinal, device.memory_mib, device.thread_percentage)
                grants.append((server, server.allocator.ledger.hold_claim(prepared.claim, device.device, share)))
            self._held[prepared.claim.uid] = _Held(prepared=prepared, grants=grants)
        for uid in cdi.claim_spec_uids(self._cdi_dir) - set(self._held):
            cdi.remove_claim_spec(self._cdi_dir, uid)
            log.info("cdi spec of a claim no longer prepared removed", claim_uid=uid)
        if self._held:
            log.info("prepared claims restored", claims=len(self._held), checkpoint=str(self._checkpoint))
        return len(self._held)

    def status(self) -> DraStatus:
        return DraStatus(
            driver=DRA_DRIVER,
            node=self._node,
            registered=self.endpoint.registered,
            slice_published=self.slice_published and not self.publishing.failing,
            prepared=self.prepared_total,
            refused=self.refused_total,
            unprepared=self.unprepared_total,
            claims=tuple(_claim_status(held.prepared) for held in self._held.values()),
        )

    # --- the task --------------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect to the API server, serve the kubelet's DRA calls, keep the node's slice published; on the way
        out, remove the slice (no one prepares claims for it any more) within a bounded time."""
        if self._api is None:
            self._api = await connect(self._kubeconfig)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.endpoint.run)
                tg.start_soon(self._keep_slice_published, self._api)
                log.info("dra driver serving", driver=DRA_DRIVER, node=self._node, devices=len(self.slice.devices))
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(REMOVE_SLICES_TIMEOUT_S):
                try:
                    removed = await self._api.remove_slices(driver=DRA_DRIVER, node=self._node)
                    log.info("resource slices removed", slices=removed)
                except KubeApiError as exc:
                    log.warning("resource slices not removed", reason=str(exc))
                await self._api.close()

    async def _keep_slice_published(self, api: KubeApi) -> None:
        backoff = Backoff(*PUBLISH_BACKOFF_S)
        while True:
            try:
                await api.publish_slice(self.slice)
            except KubeApiError as exc:
                self.publishing.failed(str(exc))
                await backoff.wait()
                continue
            if not self.slice_published:
                log.info("resource slice published", node=self._node, devices=len(self.slice.devices))
            self.publishing.works()
            self.slice_published = True
            backoff.reset()
            await anyio.sleep(REPUBLISH_INTERVAL_S)

    # --- the kubelet's calls ---------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareOutcome]:
        return {claim.uid: await self._prepare_one(claim) for claim in claims}

    async def _prepare_one(self, ref: ClaimRef) -> PrepareOutcome:
        started = time.monotonic()
        held = self._held.get(ref.uid)
        if held is not None:
            return PrepareOutcome(devices=held.prepared.devices)
        try:
            if self._api is None:
                raise KubeApiError(f"reading claim {ref}", "the agent is not connected to the API server yet")
            allocation = await self._api.read_claim(ref, driver=DRA_DRIVER, node=self._node)
            async with self._lock:
                held = self._held.get(ref.uid)
                if held is None:
                    shares = claim_shares(self._plan, allocation, self._node)
                    held = await self._hold(_prepared(ref, shares, allocation.pods), shares)
        except MpsAgentError as exc:
            self.refused_total += 1
            self._time(started, "refused")
            log.warning("claim not prepared", claim=str(ref), claim_uid=ref.uid, reason=str(exc))
            return PrepareOutcome(error=str(exc))
        self.prepared_total += 1
        self._time(started, "ok")
        log.info(
            "claim prepared",
            claim=str(ref),
            claim_uid=ref.uid,
            devices=[f"{d.device}: {_describe(d)}" for d in held.prepared.devices],
        )
        return PrepareOutcome(devices=held.prepared.devices)

    def _time(self, started: float, outcome: str) -> None:
        if self._prepare_timer is not None:
            self._prepare_timer(time.monotonic() - started, outcome)

    async def _hold(self, prepared: PreparedClaim, shares: tuple[ClaimShare, ...]) -> _Held:
        """Hold the shares, make the daemons hold the ceilings, write the CDI spec, checkpoint; undo all on any
        failure (raised)."""
        ref = prepared.claim
        for server in {self._resources[share.resource.name] for share in shares}:
            mine = [share.share for share in shares if share.resource.name == server.plan.name]
            over = server.plan.shares.clients_over_limit(server.allocator.ledger.tally, (), mine)
            if over:
                first = over[0]
                raise RequestError(
                    f"claim {ref}: GPU {first.uuid} would hold {first.grants} MPS clients (device-plugin grants and "
                    f"claims), but MPS serves at most {first.limit}; nothing was prepared: the kubelet retries, and "
                    "the claim is prepared once a container on the GPU ends (the scheduler does not count MPS clients)"
                )
        grants = [
            (server, server.allocator.ledger.hold_claim(ref, share.device.device, share.share))
            for share in shares
            for server in (self._resources[share.resource.name],)
        ]
        held = _Held(prepared=prepared, grants=grants)
        try:
            await self._hold_ceilings({server for server, _ in grants}, raise_errors=True)
            devices = [
                cdi.CdiDevice(name=_cdi_name(ref, share), envs=share.edits.envs, mounts=share.edits.mounts)
                for share in shares
            ]
            try:
                cdi.write_claim_spec(self._cdi_dir, ref.uid, devices)
                self._held[ref.uid] = held
                self._save()
            except MpsAgentError:
                self._held.pop(ref.uid, None)
                with contextlib.suppress(MpsAgentError):  # the failure to report is the one above
                    cdi.remove_claim_spec(self._cdi_dir, ref.uid)
                raise
        except BaseException:
            for server, grant in grants:
                server.allocator.ledger.release([grant.grant_id])
            await self._hold_ceilings({server for server, _ in grants}, raise_errors=False)
            raise
        return held

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        answers = {}
        for ref in claims:
            async with self._lock:
                try:
                    answers[ref.uid] = await self._unprepare_one(ref)
                except MpsAgentError as exc:  # a claim UID no file can be named by, a spec that cannot go
                    answers[ref.uid] = str(exc)
        return answers

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        """The checkpoint first: a claim it cannot drop stays prepared, whole, for the kubelet's retry."""
        held = self._held.pop(ref.uid, None)
        if held is None:
            cdi.remove_claim_spec(self._cdi_dir, ref.uid)
            return ""
        try:
            self._save()
        except HostError as exc:
            self._held[ref.uid] = held
            return str(exc)
        for server, grant in held.grants:
            server.allocator.ledger.release([grant.grant_id])
        await self._hold_ceilings({server for server, _ in held.grants}, raise_errors=False)
        self.unprepared_total += 1
        log.info("claim unprepared", claim=str(ref), claim_uid=ref.uid, devices=len(held.prepared.devices))
        cdi.remove_claim_spec(self._cdi_dir, ref.uid)  # a failure is the kubelet's retry's: the claim is unknown
        return ""

    async def _hold_ceilings(self, servers: set[ResourceServer], *, raise_errors: bool) -> None:
        for server in sorted(servers, key=lambda s: s.plan.name):
            try:
                await server.set_ceilings()
                continue
            except DaemonError as exc:
                if raise_errors:
                    raise
                reason = str(exc)
            log.error("mps daemon caps not changed", resource=server.plan.name, reason=reason)

    def _save(self) -> None:
        checkpoint.save(self._checkpoint, [held.prepared for held in self._held.values()])


def _cdi_name(ref: ClaimRef, share: ClaimShare) -> str:
    """Unique within the claim's spec: two requests of one claim can share a device (each its own share ID)."""
    share_id = share.device.share_id
    return f"{ref.uid}-{share.device.device}" + (f"-{share_id}" if share_id else "")


def _prepared(ref: ClaimRef, shares: tuple[ClaimShare, ...], pods: tuple[str, ...]) -> PreparedClaim:
    return PreparedClaim(
        claim=ref,
        devices=tuple(
            PreparedDevice(
                request=share.device.request,
                pool=share.device.pool,
                device=share.device.device,
                share_id=share.device.share_id,
                cdi_device_ids=(cdi.cdi_device_id(_cdi_name(ref, share)), *share.edits.cdi_devices),
                resource=share.resource.name,
                gpu=share.gpu.uuid,
                memory_mib=share.share.gpus[0].memory_mib,
                thread_percentage=share.share.thread_percentage,
                whole=share.share.full,
                rounded_off_bytes=share.rounded_off_bytes,
            )
            for share in shares
        ),
        pods=pods,
        prepared_at=time.time(),
    )


def _describe(device: PreparedDevice) -> str:
    if device.whole:
        return "whole GPU"
    return f"{device.memory_mib} MiB{rounding(device.rounded_off_bytes)}, threads {device.thread_percentage}%"


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
                whole=d.whole,
                rounded_off_bytes=d.rounded_off_bytes,
            )
            for d in prepared.devices
        ),
        prepared_at=utc(prepared.prepared_at),
    )
