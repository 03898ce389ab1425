"""Watching what the API server has: the slice publisher's watcher lists the driver's slices on the node into the
view (`slice_view`), the resourceVersion to watch from, and follows the watch, listing again when it fails (with
backoff) and every WATCH_SESSION_S (a connection gone silent raises nothing). It tells the publisher
(`slice_publisher`, which starts it) each time the view changes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

import anyio

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import KubeApiError
from mpsagent.dra.api import KubeApi
from mpsagent.dra.slice_view import SliceView

WATCH_SESSION_S = 300.0
"""The slices are listed and watched again at least this often: a connection gone silent raises nothing."""
WATCH_HEALTHY_S = 30.0
"""A watch that lasted this long was a good one: the next list follows without backoff."""
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
        view, backoff = self._view, self._backoff
        while True:
            started = anyio.current_time()
            try:
                items, version = await self._api.list_slices(driver=view.driver, node=view.node)
            except KubeApiError as exc:
                view.fresh = False
                self._publishing.failed(str(exc))
                await backoff.wait()
                continue
            view.take_list(items, version)
            self._changed()
            try:
                with anyio.move_on_after(WATCH_SESSION_S):
                    await self._follow(version, started)
                self._watching.works()
            except KubeApiError as exc:
                self._watching.failed(str(exc))
            if anyio.current_time() - started >= WATCH_HEALTHY_S:
                backoff.reset()
            else:
                await backoff.wait()

    async def _follow(self, version: str, started: float) -> None:
        view = self._view
        async with aclosing(
            self._api.watch_slices(driver=view.driver, node=view.node, resource_version=version)
        ) as events:
            async for kind, item in events:
                if anyio.current_time() - started >= WATCH_HEALTHY_S:
                    self._watching.works()
                if kind in _EVENTS and not view.own_write(item) and view.saw(item, gone=kind == "DELETED"):
                    self._changed()
