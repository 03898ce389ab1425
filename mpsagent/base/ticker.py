"""One timer for every poller of the same period: the agent's idle wake-ups.

An idle agent still looks at a few things every 0.2 s (each resource's plugin and kubelet sockets, each daemon's
`control.log`). Each poller sleeping on its own costs the event loop a timer and a task step per poll; here every
poll of one period runs in one timer callback on the loop (no task), and the timer runs only while someone polls.
A poll is a plain function: it must be quick and must not raise (one that does is logged and stays registered).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from mpsagent.base.logs import get_logger

log = get_logger(__name__)

Poll = Callable[[], None]


class Ticker:
    """Runs the registered polls every `period_s`, on the event loop of the first `polling` (asyncio backend)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._polls: dict[int, Poll] = {}
        self._next_key = 0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def polling(self, poll: Poll) -> Iterator[None]:
        """`poll` runs every period (the first one period after the call) until the block ends."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (the tests run many): the old timer died with the old loop
            self._loop, self._timer = loop, None
        key = self._next_key
        self._next_key += 1
        self._polls[key] = poll
        if self._timer is None:
            self._timer = loop.call_later(self.period_s, self._tick)
        try:
            yield
        finally:
            self._polls.pop(key, None)
            if not self._polls and self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _tick(self) -> None:
        self._timer = None
        for poll in list(self._polls.values()):
            try:
                poll()
            except Exception:  # a poller's bug must not stop the others' polls
                log.exception("poll failed", poll=getattr(poll, "__qualname__", repr(poll)))
        if self._polls and self._loop is not None:
            self._timer = self._loop.call_later(self.period_s, self._tick)


FAST_POLLS = Ticker(0.2)
"""The 0.2 s polls: each resource's plugin and kubelet sockets (a kubelet restart noticed within 0.2 s) and each
daemon's control.log (a ceiling changed behind the agent seen within 0.2 s)."""
