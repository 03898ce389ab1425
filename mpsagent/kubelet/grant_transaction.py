"""One grant transaction for both routes (a device-plugin Allocate, a DRA NodePrepareResources): what a call has just
held in the ledgers is carried out (the daemons made to hold the ceilings it needs, its files written), or, on any
failure or cancellation, released and the daemons brought back to the ceilings of what is left, before the call
ends. A cancelled call leaves the node as if it never happened; one that completed stands exactly once.

A kubelet that gives up on a call cancels it: grpclib cancels the handler's task with asyncio's own `Task.cancel` on
the call's deadline, a reset stream or a closed connection, and may do so twice. anyio's shielded scopes do not stop
that, and a worker thread is not stopped at all. So each step here runs to its end in a task of its own
(`to_the_end`), the undo after it, and the cancellation is raised once both have ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

import anyio
import anyio.lowlevel

from mpsagent.base.errors import MpsAgentError
from mpsagent.base.logs import get_logger

log = get_logger(__name__)

_T = TypeVar("_T")

RESTORE_TIMEOUT_S = 30.0
"""The longest an undo waits for the daemons to take the ceilings of what is left (each resource's daemon supervisor
bounds its own sessions well within it)."""


class SetCeilings(Protocol):
    """Makes one resource's daemon hold the ceilings its ledger's live grants need; raises DaemonError when it cannot.
    `verify`: read the daemon's real values back even when it is believed to hold them."""

    async def __call__(self, *, verify: bool = False) -> None: ...


async def to_the_end(step: Callable[[], Awaitable[_T]]) -> _T:
    """`step`'s result, with `step` run to its end in a task of its own whatever cancellation this task receives
    meanwhile; that cancellation is raised once `step` has ended. The wait is shielded from anyio's cancel scopes
    (which would cancel it again on every turn of the loop), and catches asyncio's own cancellations, each time."""
    task = asyncio.ensure_future(step())
    cancelled: asyncio.CancelledError | None = None
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.wait((task,))
            except asyncio.CancelledError as exc:
                cancelled = exc
    if cancelled is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller is told
        raise cancelled
    await anyio.lowlevel.checkpoint_if_cancelled()  # a cancel scope's cancellation, now that the step has ended
    return task.result()


async def carry_out(
    step: Callable[[], Awaitable[_T]], *, release: Callable[[], None], ceilings: Iterable[SetCeilings]
) -> _T:
    """The transaction: `step` carries out what the caller has just held (with no await in between, so nothing comes
    between the hold and this call); if it fails or the call is cancelled, `release` gives back what was held and
    the daemons of `ceilings` are brought back to the ceilings of what is left, then the failure is raised."""
    try:
        return await to_the_end(step)
    except BaseException:
        release()
        await restore_ceilings(ceilings)
        raise


async def restore_ceilings(ceilings: Iterable[SetCeilings]) -> None:
    """Bring each daemon to the ceilings of its ledger's live grants (after a release, or a switch that failed
    halfway and may have lifted them), each on its own, to the end, within RESTORE_TIMEOUT_S; a daemon that cannot is
    logged (the failure the caller reports is the one before, and the daemon takes the ceilings once it is back)."""
    setters = tuple(ceilings)

    async def each() -> None:
        with anyio.move_on_after(RESTORE_TIMEOUT_S):
            for set_ceilings in setters:
                try:
                    await set_ceilings()
                    continue
                except (MpsAgentError, OSError) as exc:
                    reason = str(exc)
                log.error("mps daemon caps not changed", reason=reason)

    await to_the_end(each)
