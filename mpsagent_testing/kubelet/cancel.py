"""A kubelet call given up on, as grpclib does it on the kubelet's deadline, a reset stream or a closed connection:
the handler's task cancelled with asyncio's own `Task.cancel`, once or (a deadline, then the connection) twice."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine


async def cancelled_after(
    call: Coroutine[object, object, object], *, turns: int | None = 0, seconds: float = 0.0, cancels: int = 1
) -> bool:
    """Start `call`, let the loop turn `turns` times (None: until the call ends) and then `seconds` pass, then cancel
    its task `cancels` times, a turn apart, and wait for it to end; whether it had completed before the first
    cancel."""
    task = asyncio.ensure_future(call)
    if turns is None:
        await asyncio.wait((task,))
    for _ in range(turns or 0):
        await asyncio.sleep(0)
    if seconds:
        await asyncio.sleep(seconds)
    completed = task.done()
    for _ in range(cancels):
        task.cancel()
        await asyncio.sleep(0)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return completed
