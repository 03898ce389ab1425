"""The grant transaction both routes share (`kubelet.grant_transaction`), on its own: a step runs to its end
whatever cancels the call (asyncio's own `cancel`, once or twice, as grpclib does; an anyio cancel scope), and the
cancellation comes after it; a step that fails or is cancelled is released and the ceilings restored, once; one that
completes is not. (Both routes' calls cancelled at every await: tests/dra/test_dra_driver.py and
tests/deviceplugin/test_servicer.py.)"""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import pytest

from mpsagent.base.errors import DaemonError
from mpsagent.kubelet.grant_transaction import carry_out, to_the_end

STEP_TURNS = 5


class Recorder:
    def __init__(self) -> None:
        self.said: list[str] = []

    async def step(self, fail: bool = False) -> str:
        for _ in range(STEP_TURNS):
            await asyncio.sleep(0)
        self.said.append("step ended")
        if fail:
            raise DaemonError("the MPS daemon of nvidia.com/gpu is not running")
        return "done"

    def release(self) -> None:
        self.said.append("released")

    async def set_ceilings(self, *, verify: bool = False) -> None:
        await asyncio.sleep(0)
        self.said.append("ceilings restored")


@pytest.mark.parametrize("cancels", [1, 2])
def test_a_step_cancelled_natively_runs_to_its_end_then_the_cancellation_is_raised(cancels: int) -> None:
    recorder = Recorder()

    async def main() -> None:
        call = asyncio.ensure_future(to_the_end(recorder.step))
        for _ in range(cancels):
            await asyncio.sleep(0)
            call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert recorder.said == ["step ended"]

    anyio.run(main)


def test_a_step_under_a_cancelled_scope_runs_to_its_end_and_the_scope_ends_the_call() -> None:
    recorder = Recorder()

    async def main() -> None:
        after: list[str] = []
        with anyio.CancelScope() as scope:
            scope.cancel()
            await to_the_end(recorder.step)
            after.append("not reached: the scope's cancellation comes after the step")
        assert scope.cancelled_caught
        assert (recorder.said, after) == (["step ended"], [])

    anyio.run(main)


@pytest.mark.parametrize(
    ("fail", "cancel", "said"),
    [
        (False, False, ["step ended"]),
        (True, False, ["step ended", "released", "ceilings restored", "ceilings restored"]),
        (False, True, ["step ended", "released", "ceilings restored", "ceilings restored"]),
    ],
    ids=["completed", "failed", "cancelled"],
)
def test_a_transaction_releases_and_restores_every_daemon_on_failure_or_cancellation_only(
    fail: bool, cancel: bool, said: list[str]
) -> None:
    recorder = Recorder()

    async def main() -> None:
        call = asyncio.ensure_future(
            carry_out(
                lambda: recorder.step(fail),
                release=recorder.release,
                ceilings=(recorder.set_ceilings, recorder.set_ceilings),
            )
        )
        if cancel:
            await asyncio.sleep(0)
            call.cancel()
        with contextlib.suppress(DaemonError, asyncio.CancelledError):
            assert await call == "done"
        assert call.cancelled() is cancel
        assert recorder.said == said

    anyio.run(main)
