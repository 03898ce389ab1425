"""The DRA driver's prepares and unprepares (the node service's `ClaimHandler`), over two ports: the domain's
`ClaimGrants`, which decides and holds each claim's shares (the same accounting a device-plugin Allocate meets), and
each resource's ceilings (`SetCeilings`, its daemon made to hold what its ledger's live grants need). It writes each
prepared claim's CDI spec and the checkpoint of the prepared claims, and restores them at a start.

A NodePrepareResources call is one batch and one grant transaction (`kubelet.grant_transaction`): its claims are
read from the API server at once (bounded), decided and held one by one, then the daemons are made to hold the
ceilings once while the claims' CDI specs and the checkpoint (once) are written. A claim that fails at any step holds
nothing; the others of its batch stand, unless the daemons or the checkpoint fail, which fails the whole batch. A
cancelled call (the kubelet's deadline, a reset stream) holds nothing of its batch anywhere. Prepare and unprepare
are idempotent (the kubelet retries): a prepared claim is answered from what it holds, an unknown claim is
unprepared at once. DRA says when a claim ends, so unprepare releases at once, with no grace period.

The supervisor's claim server builds it and serves it; the driver calls nothing above `dra/`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import anyio

from mpsagent.base.changes import Changes
from mpsagent.base.devices import ResourceName
from mpsagent.base.errors import DaemonError, HostError, KubeApiError, MpsAgentError, RequestError
from mpsagent.base.logs import get_logger
from mpsagent.domain.claim_grants import ClaimGrants, LiveClaim
from mpsagent.domain.claims import DRA_DRIVER, ClaimAllocation, ClaimRef, PreparedClaim
from mpsagent.domain.grant_kind import describe_claim_share
from mpsagent.dra.node_service import PrepareOutcome
from mpsagent.dra.prepared_claims import PreparedClaims
from mpsagent.kubelet.grant_transaction import SetCeilings, carry_out, restore_ceilings
from mpsagent.kubelet.memory_limit_devices import EnsureLimitDevices

log = get_logger("mpsagent.dra.driver")

MAX_CONCURRENT_READS = 8
"""Claims of one call read from the API server at once."""

PrepareTimer = Callable[[float, str], None]
"""Told each claim's prepare time in seconds and its outcome (`ok`, `refused`)."""


class ClaimSource(Protocol):
    """The API server, as far as the driver reads it."""

    async def read_claim(self, ref: ClaimRef, *, driver: str, node: str) -> ClaimAllocation:
        """The claim's allocation on this node; raises KubeApiError, or RequestError for a claim outside the
        bounds."""
        ...

    async def claim_pods(self, ref: ClaimRef) -> tuple[str, ...] | None:
        """The pods the claim is reserved for now (None: the claim is gone); raises KubeApiError."""
        ...


@dataclasses.dataclass(kw_only=True, slots=True)
class DriverCounts:
    """Claims counted by their outcome since the start."""

    prepared: int = 0
    refused: int = 0
    unprepared: int = 0


class ClaimDriver:
    """Prepares and unprepares claims for the kubelet (`ClaimHandler`); holds what is prepared."""

    def __init__(
        self,
        *,
        grants: ClaimGrants,
        ceilings: Mapping[ResourceName, SetCeilings],
        node: str,
        cdi_dir: Path,
        checkpoint_path: Path,
        limit_devices: EnsureLimitDevices | None = None,
        prepare_timer: PrepareTimer | None = None,
    ) -> None:
        """`ceilings`: each resource's daemon made to hold its ledger's ceilings (by resource name)."""
        self._grants = grants
        self._ceilings = ceilings
        self._node = node
        self._checkpoint = checkpoint_path
        self._limit_devices = limit_devices
        self._prepare_timer = prepare_timer
        self._source: ClaimSource | None = None
        self._claims = PreparedClaims(cdi_dir=cdi_dir, checkpoint_path=checkpoint_path)
        self._lock = anyio.Lock()
        self.counts = DriverCounts()
        self.changes = Changes()
        """Counts each prepare and unprepare that changed what the ledgers hold (the slice and the withheld
        replicas follow it)."""

    def connected(self, source: ClaimSource) -> None:
        """Read claims from `source` from now on (before it, a claim to read is refused: not connected yet)."""
        self._source = source

    def prepared_claims(self) -> tuple[PreparedClaim, ...]:
        """The claims prepared now, with the pods each is reserved for as last read."""
        return self._claims.records()

    # --- start: what the checkpoint holds ---------------------------------------------------------------

    def restore(self) -> int:
        """Hold the checkpointed claims' shares again (before the daemons start, so that they start at ceilings
        that cover them), each checked as a fresh prepare is, and write their CDI specs again
        (`PreparedClaims.restore`). Returns how many claims it holds. Raises HostError naming the file and the entry
        that breaks a rule, or the spec that cannot be written."""

        def hold(index: int, prepared: PreparedClaim) -> LiveClaim:
            try:
                return self._grants.restore(prepared)
            except RequestError as exc:
                for earlier in self._claims.held():
                    self._grants.release(earlier)
                self._claims.clear()
                raise HostError(
                    f"the DRA checkpoint {self._checkpoint} entry {index} (claim {prepared.claim}) cannot be held "
                    f"again: {exc}; if the claim's pods are gone, delete the file: the kubelet prepares each claim "
                    "again on its next try"
                ) from exc

        return self._claims.restore(hold)

    async def read_pods_again(self, claim_uids: Iterable[str]) -> None:
        """Read again which pods the prepared claims `claim_uids` are reserved for: a pod that shares a claim
        prepared for another is never told to the driver. A claim that cannot be read keeps what it had (logged)."""
        for uid in sorted(claim_uids):
            live = self._claims.get(uid)
            if live is None or self._source is None:
                continue
            ref = live.prepared.claim
            try:
                pods = await self._source.claim_pods(ref)
            except KubeApiError as exc:
                log.warning("claim's pods not read again", claim=str(ref), reason=str(exc))
                continue
            if pods is not None and pods != live.prepared.pods and self._claims.reserved_for(live, pods):
                log.info("claim's pods read again", claim=str(ref), pods=list(pods))

    # --- prepare -----------------------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareOutcome]:
        started = time.monotonic()
        outcomes = {claim.uid: self._answered(live) for claim in claims if (live := self._claims.get(claim.uid))}
        to_read = [claim for claim in claims if claim.uid not in outcomes]
        read = await self._read_claims(to_read)
        async with self._lock:
            batch: list[LiveClaim] = []
            for claim in to_read:
                found = read[claim.uid]
                live = self._claims.get(claim.uid)  # prepared meanwhile by a concurrent call
                if live is not None:
                    outcomes[claim.uid] = self._answered(live)
                elif isinstance(found, MpsAgentError):
                    outcomes[claim.uid] = self._refused(claim, found, started)
                else:
                    try:
                        batch.append(self._grants.prepare(found, now=time.time()))
                    except RequestError as exc:
                        outcomes[claim.uid] = self._refused(claim, exc, started)
            if batch:
                try:
                    outcomes.update(await self._prepare_batch(batch, started))
                finally:
                    self.changes.changed()
        return outcomes

    async def _read_claims(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimAllocation | MpsAgentError]:
        """Each claim's allocation from the API server, or why it could not be read; at most MAX_CONCURRENT_READS
        at once."""
        read: dict[str, ClaimAllocation | MpsAgentError] = {}
        limit = anyio.Semaphore(MAX_CONCURRENT_READS)

        async def one(claim: ClaimRef) -> None:
            async with limit:
                try:
                    if self._source is None:
                        raise KubeApiError(f"reading claim {claim}", "the agent is not connected to the API server yet")
                    read[claim.uid] = await self._source.read_claim(claim, driver=DRA_DRIVER, node=self._node)
                except MpsAgentError as exc:
                    read[claim.uid] = exc

        async with anyio.create_task_group() as tg:
            for claim in claims:
                tg.start_soon(one, claim)
        return read

    async def _prepare_batch(self, batch: Sequence[LiveClaim], started: float) -> dict[str, PrepareOutcome]:
        """The batch's grant transaction (its claims held already): carried out, or undone whole on a failure of the
        daemons or the checkpoint, or a cancellation; a claim whose spec alone failed is undone alone."""
        try:
            failures = await carry_out(
                lambda: self._carry_out(batch),
                release=lambda: self._drop(batch, save=True),
                ceilings=self._setters(batch),
            )
        except DaemonError as exc:
            failures = {live.prepared.claim.uid: _ceilings_not_held(live, exc) for live in batch}
        except HostError as exc:
            failures = {live.prepared.claim.uid: exc for live in batch}
        else:
            failed = [live for live in batch if live.prepared.claim.uid in failures]
            self._claims.stand([live for live in batch if live not in failed])
            if failed:
                self._drop(failed, save=False)  # the checkpoint was written without them
                await restore_ceilings(self._setters(failed))
        return {
            live.prepared.claim.uid: (
                self._refused(live.prepared.claim, failure, started)
                if (failure := failures.get(live.prepared.claim.uid)) is not None
                else self._prepared(live, started)
            )
            for live in batch
        }

    async def _carry_out(self, batch: Sequence[LiveClaim]) -> dict[str, MpsAgentError]:
        """Make the daemons hold the ceilings (once) while each claim's CDI spec and the checkpoint (once) are
        written: the front-end sessions wait on the daemons, the writes on the disk, so the prepare waits for the
        longer of the two, not their sum. Returns the failure of each claim whose spec could not be written (the
        checkpoint lists the others); raises DaemonError or HostError when the whole batch fails."""
        if self._limit_devices is not None:  # before the kubelet hands the runtime a name the spec does not have
            self._limit_devices([d.edits.memory_limits for live in batch for d in live.cdi_devices])
        daemon_failure: list[DaemonError] = []

        async def hold_ceilings() -> None:
            try:
                for set_ceilings in self._setters(batch):
                    await set_ceilings()
            except DaemonError as exc:
                daemon_failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_ceilings)
            failures, saved = await anyio.to_thread.run_sync(self._claims.write, batch)
        if daemon_failure:
            raise daemon_failure[0]
        if saved is not None:
            raise saved
        return failures

    def _drop(self, claims: Sequence[LiveClaim], *, save: bool) -> None:
        """Give back what `claims` hold and remove their files (`save`: the checkpoint written back too)."""
        for live in claims:
            self._grants.release(live)
        self._claims.unwrite(claims, checkpoint_too=save)

    def _setters(self, claims: Iterable[LiveClaim]) -> list[SetCeilings]:
        resources = frozenset[ResourceName]().union(*(live.resources for live in claims))
        return [self._ceilings[name] for name in sorted(resources)]

    def _answered(self, live: LiveClaim) -> PrepareOutcome:
        return PrepareOutcome(devices=live.prepared.devices)

    def _prepared(self, live: LiveClaim, started: float) -> PrepareOutcome:
        self.counts.prepared += 1
        self._time(started, "ok")
        ref = live.prepared.claim
        log.info(
            "claim prepared",
            claim=str(ref),
            claim_uid=ref.uid,
            devices=[f"{d.device}: {describe_claim_share(d)}" for d in live.prepared.devices],
        )
        return self._answered(live)

    def _refused(self, claim: ClaimRef, failure: MpsAgentError, started: float) -> PrepareOutcome:
        self.counts.refused += 1
        self._time(started, "refused")
        log.warning("claim not prepared", claim=str(claim), claim_uid=claim.uid, reason=str(failure))
        return PrepareOutcome(error=str(failure))

    def _time(self, started: float, outcome: str) -> None:
        if self._prepare_timer is not None:
            self._prepare_timer(time.monotonic() - started, outcome)

    # --- unprepare ---------------------------------------------------------------------------------------

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        answers = {}
        async with self._lock:
            for ref in claims:
                try:
                    answers[ref.uid] = await self._unprepare_one(ref)
                except MpsAgentError as exc:  # a claim UID no file can be named by, a spec that cannot go
                    answers[ref.uid] = str(exc)
        return answers

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        """The checkpoint first (`PreparedClaims.take`): a claim it cannot drop stays prepared, whole, for the
        kubelet's retry. Once it is dropped, the claim's share goes and its daemons are brought down to the ceilings
        of what is left, to the end even if the call is cancelled."""
        try:
            live = self._claims.take(ref.uid)
        except HostError as exc:
            return str(exc)
        if live is None:
            return ""
        self._grants.release(live)
        self.changes.changed()
        self.counts.unprepared += 1
        log.info("claim unprepared", claim=str(ref), claim_uid=ref.uid, devices=len(live.prepared.devices))
        try:
            self._claims.remove_spec(ref.uid)  # a failure is the kubelet's retry's: the claim is unknown
        finally:
            await restore_ceilings(self._setters([live]))
        return ""


def _ceilings_not_held(live: LiveClaim, failure: DaemonError) -> DaemonError:
    """A claim whose GPUs' daemons did not take the ceilings it needs: which claim, which GPUs, and that nothing of
    it stands."""
    gpus = ", ".join(sorted({device.gpu for device in live.prepared.devices}))
    return DaemonError(
        f"claim {live.prepared.claim}: the MPS daemon of GPU {gpus} did not take the ceilings the claim needs "
        f"({failure}); nothing was prepared: the kubelet retries"
    )
