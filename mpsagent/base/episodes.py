"""Failure episodes: a failure that lasts (a kubelet API that does not answer, a front-end the agent cannot run, a
file it cannot write) is reported once as it begins and once as it ends, never once per retry.

One `FailureEpisodes` per kind of failure: `failed` on every failure (the first of an episode logs its event, at the
given level, with the caller's fields and the hint; the rest log the `still` event at debug level, or nothing),
`works` on every success (the first after a failure logs the `again` event, with how long the episode lasted when
asked). It counts episodes and failures, and keeps since when and why the current one fails, for the status.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from structlog.typing import FilteringBoundLogger


class FailureEpisodes:
    def __init__(
        self,
        log: FilteringBoundLogger,
        *,
        failed: str,
        again: str | None,
        level: str = "error",
        still: str | None = None,
        hint: str | None = None,
        reason_key: str = "reason",
        lasted_key: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`failed`/`again`: the events that open and close an episode (`again` None: no closing event); `still`:
        the debug event of a failure inside an episode (None: none); `hint`: what to do, on the opening event only;
        `reason_key`: the field the reason is logged as; `lasted_key`: the closing event's field for the episode's
        length in seconds (None: none); `clock`: wall clock, for `current`."""
        self._log = log
        self._failed = failed
        self._again = again
        self._level = level
        self._still = still
        self._hint = hint
        self._reason_key = reason_key
        self._lasted_key = lasted_key
        self._clock = clock
        self.current: tuple[float, str] | None = None
        """Since when (wall clock) and why the current episode fails; None while it works."""
        self.episodes = 0
        self.failures = 0

    @property
    def failing(self) -> bool:
        return self.current is not None

    def failed(self, reason: str, **fields: object) -> bool:
        """A failure; True when it opens an episode (logged), False inside one (debug, or not logged)."""
        self.failures += 1
        if self.current is None:
            self.current = (self._clock(), reason)
            self.episodes += 1
            hint = {} if self._hint is None else {"hint": self._hint}
            getattr(self._log, self._level)(self._failed, **{self._reason_key: reason}, **fields, **hint)
            return True
        if self._still is not None:
            self._log.debug(self._still, **{self._reason_key: reason}, **fields)
        return False

    def works(self, **fields: object) -> bool:
        """A success; True when it closes an episode (logged)."""
        if self.current is None:
            return False
        since, _ = self.current
        self.current = None
        if self._again is not None:
            lasted = {} if self._lasted_key is None else {self._lasted_key: round(self._clock() - since, 1)}
            self._log.info(self._again, **lasted, **fields)
        return True

    def forget(self) -> None:
        """End the current episode without a word (something else reports how it ended)."""
        self.current = None
