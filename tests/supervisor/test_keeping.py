"""In-process checks of what keeps a daemon alive through the agent's or daemon host's own failures: the daemon
host's keeper loop, and the daemon-log forwarder."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
import structlog
from anyio.abc import TaskStatus

from mpsagent.base.errors import DaemonError, UnrecordedDaemonError
from mpsagent.mps.daemon_log import DaemonLog
from mpsagent.supervisor.daemon_host import _keep


class FlakyKeeper:
    """Reports started, then fails `failures` times (each run after the first adopts), then keeps."""

    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.runs = 0
        self.recorded = 0
        self.pid = 4242

    async def record(self) -> None:
        self.recorded += 1

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.runs += 1
        task_status.started()
        if self.failures:
            raise self.failures.pop(0)
        await anyio.sleep_forever()


@pytest.mark.anyio
async def test_a_keeper_that_fails_after_its_start_is_run_again_and_the_host_lives_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("mpsagent.supervisor.daemon_host.KEEPER_RETRY_S", 0.01)
    keeper = FlakyKeeper([OSError("log unreadable"), DaemonError("refused")])
    with structlog.testing.capture_logs() as logs:
        with anyio.move_on_after(5):
            async with anyio.create_task_group() as tg:
                await tg.start(_keep, keeper, keeper.record)  # type: ignore[arg-type]
                while keeper.runs < 3:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    assert keeper.runs == keeper.recorded == 3  # a daemon its record lost is recorded again before each run
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [
        "daemon keeper failed unexpectedly; the daemon is kept",
        "daemon keeper failed; the daemon is kept",
    ]


@pytest.mark.anyio
async def test_a_keeper_that_fails_before_its_start_stops_the_host() -> None:
    class Broken:
        pid = None

        async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
            raise DaemonError("cannot start nvidia-cuda-mps-control")

    async def record() -> None:
        pass

    with pytest.raises(DaemonError), anyio.fail_after(5):
        await _keep(Broken(), record)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_daemon_that_cannot_be_recorded_again_before_the_start_stops_the_host() -> None:
    async def unrecorded() -> None:
        raise UnrecordedDaemonError("an MPS daemon answers on /pipe but /daemon.json does not decode")

    with pytest.raises(UnrecordedDaemonError), anyio.fail_after(5):
        await _keep(FlakyKeeper([]), unrecorded)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_daemon_log_that_cannot_be_opened_is_reported_once_and_followed_once_it_can(tmp_path: Path) -> None:
    path = tmp_path / "control.log"
    path.mkdir()  # something else in its place: it cannot be followed
    log = DaemonLog(path, structlog.stdlib.get_logger("test"), proc_root=tmp_path / "no-proc")
    with structlog.testing.capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(log.run)
            log.attach(4242)
            await anyio.sleep(1.2)  # several polls: reported once
            following = log.following()
            assert following.followed is False
            assert following.problem == (
                f"the daemon's output cannot be opened (No such file or directory); {path} is a directory, not a file"
            )
            path.rmdir()
            path.write_bytes(b"[2026-12-01 00:00:00.000 Control 1] Starting control daemon\n")
            with anyio.fail_after(5):
                while not any(e["event"] == "mps daemon log" for e in logs):
                    await anyio.sleep(0.05)
            assert log.following().followed is True
            tg.cancel_scope.cancel()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "mps daemon log not followed; the caps are checked by reading them back only"
    ]
    assert "mps daemon log followed again" in [e["event"] for e in logs]
    forwarded = next(e for e in logs if e["event"] == "mps daemon log")
    assert forwarded["line"].endswith("Starting control daemon")
    assert forwarded["log_level"] == logging.getLevelName(logging.INFO).lower()
