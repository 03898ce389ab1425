"""The claims prepared on this node, in memory (each with the ledger grants that hold it) and on disk: each claim's
CDI spec (`cdi`) and the checkpoint of them all (`checkpoint`). The driver decides when a claim stands or goes; this
keeps the three in step, and says what failed when a file cannot be written.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from mpsagent.base.errors import HostError, MpsAgentError
from mpsagent.base.logs import get_logger
from mpsagent.base.words import counted
from mpsagent.domain.claim_grants import LiveClaim
from mpsagent.domain.claims import PreparedClaim
from mpsagent.dra import cdi, checkpoint
from mpsagent.kubelet.cdi_spec import CdiDevice

log = get_logger("mpsagent.dra.prepared_claims")

CHECKPOINT_FILE = "dra-claims.json"


class PreparedClaims:
    def __init__(self, *, cdi_dir: Path, checkpoint_path: Path) -> None:
        self._cdi_dir = cdi_dir
        self._checkpoint = checkpoint_path
        self._live: dict[str, LiveClaim] = {}

    def get(self, uid: str) -> LiveClaim | None:
        return self._live.get(uid)

    def records(self) -> tuple[PreparedClaim, ...]:
        """Each prepared claim's record, with the pods it is reserved for as last read."""
        return tuple(live.prepared for live in self._live.values())

    # --- a start -----------------------------------------------------------------------------------------

    def restore(self, hold: Callable[[int, PreparedClaim], LiveClaim]) -> int:
        """Each checkpointed claim held again by `hold` (given its index), its CDI spec written again (without
        fsync: one lost with a power cut is whole again), and the CDI specs of claims no longer prepared removed.
        Returns how many claims it holds. `hold` raising leaves none held; a spec that cannot be written raises
        HostError naming it."""
        for index, prepared in enumerate(checkpoint.load(self._checkpoint)):
            self._live[prepared.claim.uid] = hold(index, prepared)
        for live in self._live.values():
            cdi.write_claim_spec(self._cdi_dir, live.prepared.claim.uid, _spec_devices(live))
        for uid in cdi.claim_spec_uids(self._cdi_dir) - set(self._live):
            cdi.remove_claim_spec(self._cdi_dir, uid)
            log.info("cdi spec of a claim no longer prepared removed", claim_uid=uid)
        if self._live:
            log.info("prepared claims restored", claims=len(self._live), checkpoint=str(self._checkpoint))
        return len(self._live)

    def held(self) -> list[LiveClaim]:
        """What the claims hold now (a `restore` that failed halfway gives back what it held)."""
        return list(self._live.values())

    def clear(self) -> None:
        self._live.clear()

    # --- a prepare -------------------------------------------------------------------------------------------

    def write(self, batch: Sequence[LiveClaim]) -> tuple[dict[str, MpsAgentError], HostError | None]:
        """Each claim's CDI spec, then the checkpoint of the prepared claims and those of `batch` whose spec was
        written (blocking: the driver calls it in a worker thread). The failure of each spec by UID, and the
        checkpoint's (None: written)."""
        earlier = self.records()
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

    def stand(self, claims: Sequence[LiveClaim]) -> None:
        """`claims`, whose files `write` wrote, are prepared."""
        self._live.update((live.prepared.claim.uid, live) for live in claims)

    def unwrite(self, claims: Sequence[LiveClaim], *, checkpoint_too: bool) -> None:
        """Remove the specs of `claims`, which are not prepared; `checkpoint_too`: write the checkpoint of the
        prepared claims again (it may list them). A file that cannot be changed is logged: the failure reported is
        the one before."""
        for live in claims:
            with contextlib.suppress(MpsAgentError):
                cdi.remove_claim_spec(self._cdi_dir, live.prepared.claim.uid)
        if not checkpoint_too:
            return
        try:
            self._save()
            return
        except HostError as exc:  # it lists claims the kubelet retries: answered as prepared
            reason = str(exc)
        log.error("dra checkpoint not written back", reason=reason)

    def reserved_for(self, live: LiveClaim, pods: tuple[str, ...]) -> bool:
        """The pods `live` is reserved for, read again; False when it is no longer prepared as it was (unprepared,
        and maybe prepared again, while they were read)."""
        uid = live.prepared.claim.uid
        if self._live.get(uid) is not live:
            return False
        self._live[uid] = dataclasses.replace(live, prepared=msgspec.structs.replace(live.prepared, pods=pods))
        return True

    # --- an unprepare ----------------------------------------------------------------------------------------

    def take(self, uid: str) -> LiveClaim | None:
        """The prepared claim `uid`, no longer prepared: dropped from the checkpoint first, so that a claim it
        cannot drop stays prepared, whole, for the kubelet's retry (HostError); its spec removed (raises for a spec
        that cannot go: the claim is unknown by then, and the retry removes it). None: not prepared (its spec, if
        any, removed)."""
        live = self._live.pop(uid, None)
        if live is None:
            cdi.remove_claim_spec(self._cdi_dir, uid)
            return None
        try:
            self._save()
        except HostError:
            self._live[uid] = live
            raise
        return live

    def remove_spec(self, uid: str) -> None:
        cdi.remove_claim_spec(self._cdi_dir, uid)

    def _save(self) -> None:
        checkpoint.save(self._checkpoint, self.records())


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


def _spec_devices(live: LiveClaim) -> list[CdiDevice]:
    return [CdiDevice(name=d.name, envs=d.edits.envs, mounts=d.edits.mounts) for d in live.cdi_devices]
