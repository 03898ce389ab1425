"""The node's ResourceSlice kept published, quietly: `SlicePublisher` follows the driver's own slices on the node and
writes only where the server's differ from the slice the node should publish, as upstream's resourceslice
controller does. The claim server owns it and tells it what to publish (`want`).

Two tasks share one view of the server's slices (`slice_view`): the watcher (`slice_watch`) lists and watches them,
the writer (`slice_writer`) compares the view with the wanted slice whenever either changes and writes only the
difference. So an idle node costs no write at all, and a slice deleted behind the agent is back as soon as the
watch says so. On the way out the writer deletes the node's slices.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.logs import get_logger
from mpsagent.domain.claims import NodeSlice
from mpsagent.dra.api import KubeApi
from mpsagent.dra.slice_view import SliceView
from mpsagent.dra.slice_watch import SliceWatcher
from mpsagent.dra.slice_writer import SliceWriter

log = get_logger("mpsagent.slice_publisher")

PUBLISH_BACKOFF_S = (1.0, 30.0)
"""A failed call (write, list or watch) is tried again after this long, growing to the most."""


class SlicePublisher:
    """Publishes the node's one ResourceSlice of `driver` and keeps it published, writing only what differs."""

    def __init__(self, api: KubeApi, *, driver: str, node: str) -> None:
        """`api`: the one client of the API server (the publisher makes none, and does not close it)."""
        self._wanted: NodeSlice | None = None
        self._wants = 0
        self._want_signal = anyio.Event()
        self._changed = anyio.Event()
        """The wanted slice or the view changed: the writer looks again."""
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
        self._view = SliceView(driver=driver, node=node)
        self._watcher = SliceWatcher(
            api,
            self._view,
            changed=self._look_again,
            backoff=Backoff(*PUBLISH_BACKOFF_S),
            publishing=self.publishing,
            watching=self.watching,
        )
        self._writer = SliceWriter(api, self._view, failures=Backoff(*PUBLISH_BACKOFF_S), publishing=self.publishing)

    @property
    def published(self) -> bool:
        """The server's slice was last seen as the wanted one (after a write, or found so)."""
        return self._writer.published

    @property
    def writes(self) -> int:
        """Apply and delete calls made, failed ones too."""
        return self._writer.writes

    def want(self, node_slice: NodeSlice) -> None:
        """The slice the node should publish now (cheap, callable any time, from the event loop's thread): wakes
        the writer when it differs from the last one wanted; an equal one does nothing."""
        view = self._view
        if (node_slice.driver, node_slice.node) != (view.driver, view.node):
            raise ValueError(
                f"the slice publisher of {view.driver} on node {view.node} was given the slice of "
                f"{node_slice.driver} on node {node_slice.node}: make one publisher per driver and node"
            )
        if node_slice == self._wanted:
            return
        self._wanted = node_slice
        self._writer.published = False
        self._wants += 1
        self._want_signal.set()
        self._want_signal = anyio.Event()
        self._changed.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Publish the wanted slice and keep it published until cancelled (started at once, not after the first
        publish); then remove the node's slices of the driver within the writer's REMOVE_TIMEOUT_S."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watcher.run)
                tg.start_soon(self._write)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self._writer.remove()

    def _look_again(self) -> None:
        self._changed.set()

    async def _write(self) -> None:
        """Have the writer look whenever the wanted slice or the view changed, once the view was listed."""
        while True:
            await self._changed.wait()
            self._changed = anyio.Event()
            if self._wanted is None or not self._view.listed:
                continue
            wants = self._wants
            wait = await self._writer.write(self._wanted)
            if wait > 0:
                await self._pause(wait, wants)
                self._changed.set()

    async def _pause(self, seconds: float, wants: int) -> None:
        """Wait `seconds`, or until a new slice is wanted (it is tried at once, whatever failed before)."""
        with anyio.move_on_after(seconds):
            while self._wants == wants:
                await self._want_signal.wait()
