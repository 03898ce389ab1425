"""A resource's daemon as the kubelet plugins' ceilings port sees it (`kubelet.grant_transaction.SetCeilings`): it
records each call, fails while told to, and holds its ledger's ceilings once a switch that takes a few of the loop's
turns has ended, as a daemon's control sessions do; halfway it holds neither the old ceilings nor the new."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mpsagent.base.errors import DaemonError
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.shares import Ceilings

SWITCH_TURNS = 3
"""The loop's turns a switch of the ceilings takes."""


@dataclass
class FakeCeilings:
    allocator: ResourceAllocator | None = None
    """Whose ceilings it holds (`held`); None: it only records and fails."""
    held: Ceilings | None = None
    calls: list[bool] = field(default_factory=list)
    """Each call's `verify`."""
    failing: DaemonError | None = None

    def __post_init__(self) -> None:
        if self.allocator is not None and self.held is None:
            self.held = self.allocator.ceilings()

    async def __call__(self, *, verify: bool = False) -> None:
        self.calls.append(verify)
        if self.failing is not None:
            raise self.failing
        if self.allocator is None:
            return
        wanted = self.allocator.ceilings()
        for _ in range(SWITCH_TURNS):
            self.held = None  # halfway: some ceilings switched, some not
            await asyncio.sleep(0)
        self.held = wanted
