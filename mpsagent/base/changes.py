"""A count of changes that tasks wait on: the owner counts each change (`changed`), a watcher waits for the count to
move past the one it last saw (`wait`), so a change made between two waits is never missed."""

from __future__ import annotations

import anyio


class Changes:
    def __init__(self) -> None:
        self.count = 0
        self._event = anyio.Event()

    def changed(self) -> None:
        self.count += 1
        self._event.set()
        self._event = anyio.Event()

    async def wait(self, since: int) -> int:
        """Wait until the count differs from `since`; the count then."""
        while self.count == since:
            await self._event.wait()
        return self.count
