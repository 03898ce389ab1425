"""The backoff and the failure episodes every retry loop uses (no sockets): the delay sequence, and one report as
an episode begins and one as it ends."""

from __future__ import annotations

import anyio
import structlog
from structlog.testing import capture_logs

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes


def test_the_delay_doubles_up_to_its_maximum_and_a_reset_starts_again() -> None:
    retry = Backoff(0.5, 3.0)
    seen = []
    for _ in range(5):
        seen.append(retry.delay)
        retry.grow()
    assert seen == [0.5, 1.0, 2.0, 3.0, 3.0]
    retry.grow(maximum=1.0)  # a call's own bound
    assert retry.delay == 1.0
    retry.reset()
    assert retry.delay == 0.5


def test_wait_sleeps_the_delay_then_grows_it() -> None:
    retry = Backoff(0.001, 0.004)

    async def main() -> list[float]:
        delays = []
        for _ in range(3):
            delays.append(retry.delay)
            await retry.wait()
        return delays

    assert anyio.run(main) == [0.001, 0.002, 0.004]


def test_an_episode_is_reported_once_as_it_begins_and_once_as_it_ends() -> None:
    now = [100.0]
    episodes = FailureEpisodes(
        structlog.get_logger(),
        failed="thing failed",
        still="thing still fails",
        again="thing works again",
        hint="fix it",
        lasted_key="failed_for_s",
        clock=lambda: now[0],
    )
    with capture_logs() as logs:
        assert episodes.works() is False  # nothing to end
        assert episodes.failed("boom", pid=1) is True
        now[0] = 112.34
        assert episodes.failed("boom again", pid=1) is False
        assert episodes.current == (100.0, "boom")
        assert episodes.works(pid=1) is True
        assert episodes.works() is False
    assert logs == [
        {"event": "thing failed", "log_level": "error", "reason": "boom", "pid": 1, "hint": "fix it"},
        {"event": "thing still fails", "log_level": "debug", "reason": "boom again", "pid": 1},
        {"event": "thing works again", "log_level": "info", "failed_for_s": 12.3, "pid": 1},
    ]
    assert (episodes.episodes, episodes.failures, episodes.failing) == (1, 2, False)


def test_an_episode_without_repeats_or_an_end_event_and_one_forgotten() -> None:
    episodes = FailureEpisodes(
        structlog.get_logger(), failed="file damaged", level="warning", again=None, reason_key="problem"
    )
    with capture_logs() as logs:
        episodes.failed("truncated", path="/x")
        episodes.failed("truncated", path="/x")
        episodes.works()
        episodes.failed("empty", path="/x")
        episodes.forget()
        episodes.works()
    assert logs == [
        {"event": "file damaged", "log_level": "warning", "problem": "truncated", "path": "/x"},
        {"event": "file damaged", "log_level": "warning", "problem": "empty", "path": "/x"},
    ]
    assert episodes.episodes == 2
