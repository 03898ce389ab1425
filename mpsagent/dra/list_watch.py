"""One kind of object followed as the API server has it, the one way every watcher of the agent does it: listed
(with the resourceVersion to watch from), then watched, listed again when the watch fails (with backoff) and every
WATCH_SESSION_S (a connection gone silent raises nothing). The slice watcher (`slice_watch`) and the DeviceTaintRule
watcher (`taint_rule_watch`) each say how to list and what an event means.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import NoReturn, TypeVar

import anyio

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import KubeApiError

_Item = TypeVar("_Item")

WATCH_SESSION_S = 300.0
"""Listed and watched again at least this often: a connection gone silent raises nothing."""
WATCH_HEALTHY_S = 30.0
"""A watch that lasted this long was a good one: the next list follows without backoff, and a failure is over."""


async def list_and_watch(
    *,
    listed: Callable[[], Awaitable[str | None]],
    events: Callable[[str], AsyncGenerator[tuple[str, _Item], None]],
    seen: Callable[[str, _Item], None],
    watching: FailureEpisodes,
    backoff: Backoff,
) -> NoReturn:
    """Until cancelled: `listed` lists and takes what it listed, giving the resourceVersion to watch from (None: it
    could not, and has said so and waited as it needs); `events` watches from a version, each event told to `seen`
    (its type and object); `watching` is told how the watch goes; `backoff` is the wait after a watch that did not
    last WATCH_HEALTHY_S."""
    while True:
        started = anyio.current_time()
        version = await listed()
        if version is None:
            continue
        try:
            with anyio.move_on_after(WATCH_SESSION_S):
                async with aclosing(events(version)) as stream:
                    async for kind, item in stream:
                        if anyio.current_time() - started >= WATCH_HEALTHY_S:
                            watching.works()
                        seen(kind, item)
            watching.works()
        except KubeApiError as exc:
            watching.failed(str(exc))
        if anyio.current_time() - started >= WATCH_HEALTHY_S:
            backoff.reset()
        else:
            await backoff.wait()
