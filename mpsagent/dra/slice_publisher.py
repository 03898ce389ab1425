"""The node's ResourceSlice kept published, quietly: `SlicePublisher` follows the driver's own slices on the node and
writes only where the server's differ from the slice the node should publish, as upstream's resourceslice
controller does. The claim server owns it and tells it what to publish (`want`).

Two tasks share one view of the server's slices. The watcher lists them (the resourceVersion to watch from) and
follows the watch, listing again when it fails (with backoff) and every WATCH_SESSION_S (a connection gone silent
raises nothing). The writer compares the view with the wanted slice whenever either changes: it applies the node's
slice where it is missing or differs (deleted, or edited by someone else: spec or content annotation), and deletes
any other slice of the driver on the node. So an idle node costs no write at all, and a slice deleted behind the
agent is back as soon as the watch says so.

The watch's word of the agent's own writes is no one else's edit, however late it comes: the publisher keeps the
resourceVersion the server gave each of its applies and the UID of each slice it deleted, and an event carrying one
of those changes nothing. Every other event newer than the view is taken (the server's resourceVersions order
where they are numbers, as the API server's are; others by arrival).

The pool generation is bumped only when what the slice shows changes (`next_generation`, by its content digest),
never below what this run published, and above any other live slice of the pool (the scheduler uses only the
slices of a pool's highest generation). A repair of the same wanted slice soon after another waits a growing time,
so that a fight with another writer stays slow.
"""

from __future__ import annotations

from collections import deque
from contextlib import aclosing
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from lightkube.resources.resource_v1 import ResourceSlice

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import KubeApiError
from mpsagent.base.logs import get_logger
from mpsagent.domain.claims import NodeSlice
from mpsagent.dra.api import MAX_LISTED_SLICES, KubeApi
from mpsagent.dra.slice_object import (
    SliceManifest,
    next_generation,
    pool_of,
    resource_slice,
    same_pool,
    slice_digest,
    slice_matches,
    slice_name,
)

log = get_logger("mpsagent.slice_publisher")

PUBLISH_BACKOFF_S = (1.0, 30.0)
"""A failed call (write, list or watch) is tried again after this long, growing to the most."""
REPAIR_BACKOFF_S = (1.0, 30.0)
"""A repair within REPAIR_QUIET_S of the last one waits this long first, growing (the first is at once)."""
REPAIR_QUIET_S = 60.0
WATCH_SESSION_S = 300.0
"""The slices are listed and watched again at least this often: a connection gone silent raises nothing."""
WATCH_HEALTHY_S = 30.0
"""A watch that lasted this long was a good one: the next list follows without backoff."""
REMOVE_TIMEOUT_S = 3.0
"""On the way out, the node's slices are deleted within this long, or left with a warning: short enough that the
agent exits within 5 s of SIGTERM with the API server not answering (docs/dra.md), the rest of its way out included;
long enough for a list and a delete of a server that answers at all."""
OWN_WRITES_KEPT = 32
"""The agent's own applies and deletes remembered, to know the watch's word of them (which comes within moments)."""
_EVENTS = frozenset({"ADDED", "MODIFIED", "DELETED"})


@dataclass(frozen=True, slots=True)
class _Seen:
    """A slice as the view last saw it, with its resourceVersion as a number (None: not one); `item` None: the
    node's slice is known to be gone (so that an older answer does not bring it back into the view)."""

    version: int | None
    item: ResourceSlice | None


def _version(text: str | None) -> int | None:
    """A resourceVersion as a number, to order what the watch, a list and a write's answer say; the API server's
    are decimal (etcd's revision), anything else orders by arrival."""
    return int(text) if text and len(text) <= 20 and text.isascii() and text.isdigit() else None


def _newer(version: int | None, than: int | None) -> bool:
    return version is None or than is None or version > than


class SlicePublisher:
    """Publishes the node's one ResourceSlice of `driver` and keeps it published, writing only what differs."""

    def __init__(self, api: KubeApi, *, driver: str, node: str) -> None:
        """`api`: the one client of the API server (the publisher makes none, and does not close it)."""
        self._api = api
        self._driver = driver
        self._node = node
        self._name = slice_name(node, driver)
        self._wanted: NodeSlice | None = None
        self._wants = 0
        self._want_signal = anyio.Event()
        self._changed = anyio.Event()
        """The wanted slice or the view changed: the writer looks again."""
        self._view: dict[str, _Seen] = {}
        """The server's slices of the driver on the node, by name, as listed and watched (MAX_LISTED_SLICES)."""
        self._written: deque[str] = deque(maxlen=OWN_WRITES_KEPT)
        """The resourceVersions the server gave the agent's applies: the view holds each from the answer already,
        or something newer."""
        self._deleted: deque[str] = deque(maxlen=OWN_WRITES_KEPT)
        """The UIDs of the slices the agent deleted (a delete's answer carries no resourceVersion): whatever the
        watch says of one of them is older than that delete."""
        self._listed = False
        """The view was listed once: the writer may compare."""
        self._fresh = False
        """The last list worked: what the writer finds in the view is the server's word."""
        self._generation = 0
        """The highest pool generation this run published or found, and the digest of what it showed."""
        self._digest: str | None = None
        self._last_repair: float | None = None
        self._repair_at: float | None = None
        self._repairs = Backoff(*REPAIR_BACKOFF_S)
        self.published = False
        """The server's slice was last seen as the wanted one (after a write, or found so)."""
        self.writes = 0
        """Apply and delete calls made, failed ones too."""
        self.publishing = FailureEpisodes(
            log,
            failed="resource slice not published",
            again="resource slice published again",
            hint="check that the agent's service account may write resourceslices (resource.k8s.io)",
        )
        self.watching = FailureEpisodes(
            log,
            failed="resource slice watch failed",
            again="resource slice watched again",
            level="warning",
            hint="check that the agent's service account may list and watch resourceslices (resource.k8s.io); "
            "until then a slice deleted or changed behind the agent comes back only when it lists them again",
        )

    def want(self, node_slice: NodeSlice) -> None:
        """The slice the node should publish now (cheap, callable any time, from the event loop's thread): wakes
        the writer when it differs from the last one wanted; an equal one does nothing."""
        if (node_slice.driver, node_slice.node) != (self._driver, self._node):
            raise ValueError(
                f"the slice publisher of {self._driver} on node {self._node} was given the slice of "
                f"{node_slice.driver} on node {node_slice.node}: make one publisher per driver and node"
            )
        if node_slice == self._wanted:
            return
        self._wanted = node_slice
        self.published = False
        self._wants += 1
        self._want_signal.set()
        self._want_signal = anyio.Event()
        self._changed.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Publish the wanted slice and keep it published until cancelled (started at once, not after the first
        publish); then remove the node's slices of the driver within REMOVE_TIMEOUT_S."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch)
                tg.start_soon(self._write)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self._remove()

    # --- the watcher: the view --------------------------------------------------------------------------

    async def _watch(self) -> None:
        backoff = Backoff(*PUBLISH_BACKOFF_S)
        while True:
            started = anyio.current_time()
            try:
                items, version = await self._api.list_slices(driver=self._driver, node=self._node)
            except KubeApiError as exc:  # the slice cannot be kept published while the server is not seen
                self._fresh = False
                self.publishing.failed(str(exc))
                await backoff.wait()
                continue
            self._take_list(items, version)
            try:
                with anyio.move_on_after(WATCH_SESSION_S):
                    await self._follow(version, started)
                self.watching.works()
            except KubeApiError as exc:
                self.watching.failed(str(exc))
            if anyio.current_time() - started >= WATCH_HEALTHY_S:
                backoff.reset()
            else:
                await backoff.wait()

    async def _follow(self, version: str, started: float) -> None:
        async with aclosing(
            self._api.watch_slices(driver=self._driver, node=self._node, resource_version=version)
        ) as events:
            async for kind, item in events:
                if anyio.current_time() - started >= WATCH_HEALTHY_S:
                    self.watching.works()
                if kind in _EVENTS and not self._own_write(item) and self._saw(item, gone=kind == "DELETED"):
                    self._changed.set()

    def _own_write(self, item: ResourceSlice) -> bool:
        """Whether the watch's `item` is word of the agent's own write: an apply's resourceVersion, or a slice the
        agent deleted."""
        metadata = item.metadata
        return metadata is not None and (metadata.resourceVersion in self._written or metadata.uid in self._deleted)

    def _ours(self, item: ResourceSlice) -> str | None:
        """The slice's name when it is one of the driver's on the node (the watch's objects are untrusted)."""
        name = item.metadata.name if item.metadata else None
        spec = item.spec
        return name if name and spec.driver == self._driver and spec.nodeName == self._node else None

    def _saw(self, item: ResourceSlice, *, gone: bool = False) -> bool:
        """Take `item` (from the watch or a write's answer) into the view unless it is not ours or older than
        what the view holds; whether the view changed."""
        name = self._ours(item)
        if name is None:
            return False
        held = self._view.get(name)
        version = _version(item.metadata.resourceVersion if item.metadata else None)
        if held is not None and not (_newer(version, held.version) or (gone and version == held.version)):
            return False  # older than the view (a deletion at the same version: a server that keeps it)
        if held is None and (gone or len(self._view) >= MAX_LISTED_SLICES):
            return False  # a slice the view cannot hold is seen at the next list
        if not gone:
            self._view[name] = _Seen(version, item)
        elif name == self._name:
            self._view[name] = _Seen(version, None)
        else:
            del self._view[name]
        return True

    def _take_list(self, items: list[ResourceSlice], version: str) -> None:
        """The view as listed at `version`, except what it holds newer (a write's answer that came first)."""
        listed = _version(version)
        view = {}
        for item in items:
            name = self._ours(item)
            if name is not None:
                view[name] = _Seen(_version(item.metadata.resourceVersion if item.metadata else None), item)
        view.setdefault(self._name, _Seen(listed, None))
        for name, seen in view.items():
            held = self._view.get(name)
            if held is not None and held.version is not None and seen.version is not None:
                view[name] = held if held.version > seen.version else seen
        self._view = view
        self._listed = self._fresh = True
        self._changed.set()

    # --- the writer: the difference ---------------------------------------------------------------------

    async def _write(self) -> None:
        failures = Backoff(*PUBLISH_BACKOFF_S)
        while True:
            await self._changed.wait()
            self._changed = anyio.Event()
            if self._wanted is None or not self._listed:
                continue
            wants = self._wants
            try:
                wait = await self._write_difference(self._wanted)
            except KubeApiError as exc:
                self.published = False
                self.publishing.failed(str(exc))
                wait = failures.delay
                failures.grow()
            else:
                failures.reset()
            if wait > 0:
                await self._pause(wait, wants)
                self._changed.set()

    async def _pause(self, seconds: float, wants: int) -> None:
        """Wait `seconds`, or until a new slice is wanted (it is tried at once, whatever failed before)."""
        with anyio.move_on_after(seconds):
            while self._wants == wants:
                await self._want_signal.wait()

    async def _write_difference(self, wanted: NodeSlice) -> float:
        """Make the server hold `wanted` as the node's one slice of the driver. Returns how long to wait before
        looking again: 0, or what a repair must wait first."""
        own = self._view.get(self._name)
        # The server's slice as JSON, once: lightkube's to_dict walks the whole object.
        existing = own.item.to_dict() if own is not None and own.item is not None else None
        others = {name: seen.item for name, seen in self._view.items() if name != self._name and seen.item}
        generation = self._generation_for(existing, wanted, list(others.values()))
        digest = slice_digest(wanted)
        if existing is None or not slice_matches(existing, resource_slice(wanted, generation=generation, node_uid="")):
            repair = digest == self._digest  # what this run published or found before: the server lost it
            wait = self._repair_wait() if repair else 0.0
            if wait > 0:
                return wait
            self.published = False
            await self._publish(wanted, existing, generation, repair=repair)
        elif self._digest is None:  # a restarted agent whose slice the server still holds as it should be
            log.info(
                "resource slice already published",
                slice=self._name,
                generation=generation,
                devices=len(wanted.devices),
            )
        self._generation, self._digest = max(self._generation, generation), digest
        for name in sorted(others):
            if await self._delete(name):
                log.info("obsolete resource slice removed", slice=name, node=self._node)
            self._view.pop(name, None)
        self._repair_at = None
        self.published = True
        if self._fresh:  # else the view may be old: the next list that works says
            self.publishing.works()
        return 0.0

    async def _publish(
        self, wanted: NodeSlice, existing: SliceManifest | None, generation: int, *, repair: bool
    ) -> None:
        node_uid = await self._api.node_uid(self._node)  # each time: a Node re-created has another UID
        if existing is not None and not same_pool(existing, wanted):  # driver, node and pool cannot be changed
            await self._delete(self._name)
        self.writes += 1
        written = await self._api.apply_slice(resource_slice(wanted, generation=generation, node_uid=node_uid))
        self._saw(written)
        if written.metadata is not None and written.metadata.resourceVersion:
            self._written.append(written.metadata.resourceVersion)
        if repair:
            self._last_repair = anyio.current_time()
            why = "restored: " + ("deleted" if existing is None else "changed") + " behind the agent"
        else:
            why = "new" if existing is None else "changed"
        log.info(
            "resource slice published", slice=self._name, generation=generation, devices=len(wanted.devices), why=why
        )

    async def _delete(self, name: str) -> bool:
        """Delete the slice `name` as the view holds it (False: it was gone already), remembering its UID: the
        watch's word of that slice is then known as older than the delete."""
        held = self._view.get(name)
        uid = held.item.metadata.uid if held and held.item and held.item.metadata else None
        self.writes += 1
        deleted = await self._api.delete_slice(name)
        if uid:
            self._deleted.append(uid)
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

    def _repair_wait(self) -> float:
        """How long the repair due now waits: none unless the last one was within REPAIR_QUIET_S."""
        now = anyio.current_time()
        if self._repair_at is None:
            if self._last_repair is not None and now - self._last_repair < REPAIR_QUIET_S:
                self._repair_at = now + self._repairs.delay
                self._repairs.grow()
            else:
                self._repairs.reset()
                self._repair_at = now
        return max(0.0, self._repair_at - now)

    # --- the way out ------------------------------------------------------------------------------------

    async def _remove(self) -> None:
        """Delete the node's slices of the driver within REMOVE_TIMEOUT_S; one warning naming those left."""
        self.published = False
        left = {self._name, *(name for name, seen in self._view.items() if seen.item is not None)}
        reason = f"no answer within {REMOVE_TIMEOUT_S:g} s"
        with anyio.move_on_after(REMOVE_TIMEOUT_S):
            try:
                items, _ = await self._api.list_slices(driver=self._driver, node=self._node)
                left = {name for name in map(self._ours, items) if name is not None}
                removed = 0
                for name in sorted(left):
                    self.writes += 1
                    removed += int(await self._api.delete_slice(name))
                    left.discard(name)
            except KubeApiError as exc:
                reason = str(exc)
            else:
                log.info("resource slices removed", slices=removed, node=self._node)
                return
        names = sorted(left)
        log.warning(
            "resource slices not removed",
            slices=names,
            reason=reason,
            hint="the agent's next start on the node replaces it, the Node's deletion removes it (its "
            f"ownerReference), or remove it by hand: kubectl delete resourceslice {' '.join(names)}",
        )
