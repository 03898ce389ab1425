"""Backoff: the growing wait between the tries of something that keeps failing (registration, a daemon start, a
pod-resources `List`, the GPU event watch, a busy control daemon), for every retry loop of the agent.

The sequence itself is plain arithmetic (`delay`, `grow`, `reset`); `wait` is the one part that sleeps.
"""

from __future__ import annotations

import anyio


class Backoff:
    """Waits from `initial`, each `factor` times the last, up to `maximum`; `reset` starts again from `initial`."""

    __slots__ = ("delay", "factor", "initial", "maximum")

    def __init__(self, initial: float, maximum: float, *, factor: float = 2.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.delay = initial
        """The wait due now."""

    def grow(self, maximum: float | None = None) -> None:
        """The next wait: `factor` times this one, at most `maximum` (this call's bound, else the backoff's)."""
        self.delay = min(self.delay * self.factor, self.maximum if maximum is None else maximum)

    def reset(self) -> None:
        self.delay = self.initial

    async def wait(self, maximum: float | None = None) -> None:
        """Sleep the wait due now, then grow it (bounded by `maximum` if given)."""
        await anyio.sleep(self.delay)
        self.grow(maximum)
