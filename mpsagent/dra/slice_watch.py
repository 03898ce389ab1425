"""Watching what the API server has: the slice publisher's watcher lists the driver's slices on the node into the
view (`slice_view`), the resourceVersion to watch from, and follows the watch (`list_watch`: listed again when it
fails, with backoff, and every WATCH_SESSION_S). It tells the publisher (`slice_publisher`, which starts it) each time
the view changes.
"""

from __future__ import annotations

from collections.abc import Callable

from lightkube.resources.resource_v1 import ResourceSlice

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import KubeApiError
from mpsagent.dra.api import KubeApi
from mpsagent.dra.list_watch import list_and_watch
from mpsagent.dra.slice_view import SliceView

_EVENTS = frozenset({"ADDED", "MODIFIED", "DELETED"})


class SliceWatcher:
    """Keeps `view` as the server has it until cancelled; `changed` is called whenever the view changed."""

    def __init__(
        self,
        api: KubeApi,
        view: SliceView,
        *,
        changed: Callable[[], None],
        backoff: Backoff,
        publishing: FailureEpisodes,
        watching: FailureEpisodes,
    ) -> None:
        """`backoff`: the wait after a list that failed or a watch that did not last WATCH_HEALTHY_S;
        `publishing`: told of a list that fails (the slice cannot be kept published while the server is not seen);
        `watching`: of the watch's failures and successes."""
        self._api = api
        self._view = view
        self._changed = changed
        self._backoff = backoff
        self._publishing = publishing
        self._watching = watching

    async def run(self) -> None:
        """List and watch until cancelled."""
        view = self._view
        await list_and_watch(
            listed=self._listed,
            events=lambda version: self._api.watch_slices(driver=view.driver, node=view.node, resource_version=version),
            seen=self._seen,
            watching=self._watching,
            backoff=self._backoff,
        )

    async def _listed(self) -> str | None:
        view = self._view
        try:
            items, version = await self._api.list_slices(driver=view.driver, node=view.node)
        except KubeApiError as exc:
            view.fresh = False
            self._publishing.failed(str(exc))
            await self._backoff.wait()
            return None
        view.take_list(items, version)
        self._changed()
        return version

    def _seen(self, kind: str, item: ResourceSlice) -> None:
        view = self._view
        if kind in _EVENTS and not view.own_write(item) and view.saw(item, gone=kind == "DELETED"):
            self._changed()
