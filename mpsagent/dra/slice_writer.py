"""Deciding and writing the difference: the slice publisher's writer compares the view of what the API server has
(`slice_view`) with the slice the node should publish, applies the node's slice where it is missing or differs
(deleted, or edited by someone else: spec or content annotation), and deletes any other slice of the driver on the
node; on the way out it deletes the node's slices. The publisher (`slice_publisher`) calls it whenever the wanted
slice or the view changed, and once on its way out.

The pool generation is bumped only when what the slice shows changes (`next_generation`, by its content digest),
never below what this run published, and above any other live slice of the pool (the scheduler uses only the
slices of a pool's highest generation). A repair of the same wanted slice soon after another waits a growing time
(`RepairPace`), so that a fight with another writer stays slow.
"""

from __future__ import annotations

import anyio
from lightkube.resources.resource_v1 import ResourceSlice

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import KubeApiError
from mpsagent.base.logs import get_logger
from mpsagent.domain.claims import NodeSlice
from mpsagent.dra.api import KubeApi
from mpsagent.dra.slice_object import (
    SliceManifest,
    next_generation,
    pool_of,
    resource_slice,
    same_pool,
    slice_digest,
    slice_matches,
)
from mpsagent.dra.slice_view import SliceView

log = get_logger("mpsagent.slice_publisher")  # the publisher's lines, under its name

REPAIR_BACKOFF_S = (1.0, 30.0)
"""A repair within REPAIR_QUIET_S of the last one waits this long first, growing (the first is at once)."""
REPAIR_QUIET_S = 60.0
REMOVE_TIMEOUT_S = 3.0
"""On the way out, the node's slices are deleted within this long, or left with a warning: short enough that the
agent exits within 5 s of SIGTERM with the API server not answering (docs/dra.md), the rest of its way out included;
long enough for a list and a delete of a server that answers at all."""


class RepairPace:
    """How long a repair waits: none unless the last one was within REPAIR_QUIET_S, then a growing time."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._due: float | None = None
        """When the repair waiting now is due (None: none is waiting)."""
        self._backoff = Backoff(*REPAIR_BACKOFF_S)

    def wait(self) -> float:
        """How long the repair due now waits still."""
        now = anyio.current_time()
        if self._due is None:
            if self._last is not None and now - self._last < REPAIR_QUIET_S:
                self._due = now + self._backoff.delay
                self._backoff.grow()
            else:
                self._backoff.reset()
                self._due = now
        return max(0.0, self._due - now)

    def repaired(self) -> None:
        self._last = anyio.current_time()

    def settled(self) -> None:
        """The server holds the wanted slice: no repair is waiting."""
        self._due = None


class SliceWriter:
    """Writes what differs between `view` and the wanted slice; counts its calls, says whether the slice is
    published."""

    def __init__(self, api: KubeApi, view: SliceView, *, failures: Backoff, publishing: FailureEpisodes) -> None:
        """`failures`: the wait after a write that failed; `publishing`: told of each write's failure or
        success."""
        self._api = api
        self._view = view
        self._failures = failures
        self._publishing = publishing
        self._generation = 0
        """The highest pool generation this run published or found, and the digest of what it showed."""
        self._digest: str | None = None
        self._repairs = RepairPace()
        self.published = False
        """The server's slice was last seen as the wanted one (after a write, or found so)."""
        self.writes = 0
        """Apply and delete calls made, failed ones too."""

    async def write(self, wanted: NodeSlice) -> float:
        """Make the server hold `wanted` as the node's one slice of the driver. Returns how long to wait before
        looking again: 0, what a repair must wait first, or the backoff after a failure (reported)."""
        try:
            wait = await self._write_difference(wanted)
        except KubeApiError as exc:
            self.published = False
            self._publishing.failed(str(exc))
            wait = self._failures.delay
            self._failures.grow()
        else:
            self._failures.reset()
        return wait

    async def _write_difference(self, wanted: NodeSlice) -> float:
        own = self._view.node_slice()
        # The server's slice as JSON, once: lightkube's to_dict walks the whole object.
        existing = own.to_dict() if own is not None else None
        others = self._view.others()
        generation = self._generation_for(existing, wanted, list(others.values()))
        digest = slice_digest(wanted)
        if existing is None or not slice_matches(existing, resource_slice(wanted, generation=generation, node_uid="")):
            repair = digest == self._digest  # what this run published or found before: the server lost it
            wait = self._repairs.wait() if repair else 0.0
            if wait > 0:
                return wait
            self.published = False
            await self._publish(wanted, existing, generation, repair=repair)
        elif self._digest is None:  # a restarted agent whose slice the server still holds as it should be
            log.info(
                "resource slice already published",
                slice=self._view.name,
                generation=generation,
                devices=len(wanted.devices),
            )
        self._generation, self._digest = max(self._generation, generation), digest
        for name in sorted(others):
            if await self._delete(name):
                log.info("obsolete resource slice removed", slice=name, node=self._view.node)
            self._view.forget(name)
        self._repairs.settled()
        self.published = True
        if self._view.fresh:  # else the view may be old: the next list that works says
            self._publishing.works()
        return 0.0

    async def _publish(
        self, wanted: NodeSlice, existing: SliceManifest | None, generation: int, *, repair: bool
    ) -> None:
        node_uid = await self._api.node_uid(self._view.node)  # each time: a Node re-created has another UID
        if existing is not None and not same_pool(existing, wanted):  # driver, node and pool cannot be changed
            await self._delete(self._view.name)
        self.writes += 1
        written = await self._api.apply_slice(resource_slice(wanted, generation=generation, node_uid=node_uid))
        self._view.applied(written)
        if repair:
            self._repairs.repaired()
            why = "restored: " + ("deleted" if existing is None else "changed") + " behind the agent"
        else:
            why = "new" if existing is None else "changed"
        log.info(
            "resource slice published",
            slice=self._view.name,
            generation=generation,
            devices=len(wanted.devices),
            why=why,
        )

    async def _delete(self, name: str) -> bool:
        """Delete the slice `name` as the view holds it (False: it was gone already), remembering its UID: the
        watch's word of that slice is then known as older than the delete."""
        uid = self._view.uid(name)
        self.writes += 1
        deleted = await self._api.delete_slice(name)
        self._view.deleted(uid)
        return deleted

    def _generation_for(self, existing: SliceManifest | None, wanted: NodeSlice, others: list[ResourceSlice]) -> int:
        """`next_generation`, but never below what this run published (one more for other contents), and above
        any other live slice of the pool."""
        generation = next_generation(existing, wanted)
        if self._generation:
            generation = max(generation, self._generation + (0 if self._digest == slice_digest(wanted) else 1))
        pools = [pool_of(other.to_dict()) for other in others]
        rivals = [rival for pool, rival in pools if pool == wanted.pool]
        return max([generation, *(rival + 1 for rival in rivals)])

    async def remove(self) -> None:
        """Delete the node's slices of the driver within REMOVE_TIMEOUT_S; one warning naming those left."""
        self.published = False
        view = self._view
        left = view.names()
        reason = f"no answer within {REMOVE_TIMEOUT_S:g} s"
        with anyio.move_on_after(REMOVE_TIMEOUT_S):
            try:
                items, _ = await self._api.list_slices(driver=view.driver, node=view.node)
                left = {name for name in map(view.ours, items) if name is not None}
                removed = 0
                for name in sorted(left):
                    self.writes += 1
                    removed += int(await self._api.delete_slice(name))
                    left.discard(name)
            except KubeApiError as exc:
                reason = str(exc)
            else:
                log.info("resource slices removed", slices=removed, node=view.node)
                return
        names = sorted(left)
        log.warning(
            "resource slices not removed",
            slices=names,
            reason=reason,
            hint="the agent's next start on the node replaces it, the Node's deletion removes it (its "
            f"ownerReference), or remove it by hand: kubectl delete resourceslice {' '.join(names)}",
        )
