"""Waiting, bounded, for something a test (or the bench) expects to become true: the one polling loop they share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
WAIT_S = 10.0
POLL_S = 0.01


def wait_for(
    condition: Callable[[], T], timeout: float = WAIT_S, what: str = "condition", interval: float = POLL_S
) -> T:
    """Call `condition` every `interval` until it returns something true, and return that; AssertionError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
