"""GPU health decisions: which Xids count (the NVIDIA plugin's DP_* conventions) and when a GPU recovers."""

from __future__ import annotations

import pytest

from mpsagent.base.devices import GpuUuid
from mpsagent.base.errors import UsageError
from mpsagent.base.settings import APPLICATION_XIDS, xid_policy
from mpsagent.domain.health import GpuHealthTracker
from mpsagent.gpu.monitor import probe_interval

A = GpuUuid("GPU-a")
B = GpuUuid("GPU-b")


def policy(disable: str | None = None, enable: str | None = None):
    env = {}
    if disable is not None:
        env["DP_DISABLE_HEALTHCHECKS"] = disable
    if enable is not None:
        env["DP_ENABLE_HEALTHCHECKS"] = enable
    return xid_policy(env)


@pytest.mark.parametrize("xid", sorted(APPLICATION_XIDS))
def test_application_xids_never_count_by_default(xid: int) -> None:
    assert not policy().is_critical(xid)


def test_other_xids_count_by_default() -> None:
    assert policy().is_critical(79) and policy().is_critical(48) and policy().is_critical(0)


def test_disable_adds_xids_to_ignore_and_keeps_the_application_ones() -> None:
    p = policy(disable="79, 48")
    assert not p.is_critical(79) and not p.is_critical(48) and not p.is_critical(13)
    assert p.is_critical(94) and p.watching


@pytest.mark.parametrize("word", ["all", "xids", "XIDS", " All "])
def test_disable_all_turns_the_watch_off(word: str) -> None:
    p = policy(disable=word)
    assert not p.watching and not p.is_critical(79)


def test_enable_overrides_disable_even_for_application_xids() -> None:
    p = policy(disable="79", enable="79,13")
    assert p.is_critical(79) and p.is_critical(13) and not p.is_critical(31)


def test_enable_selects_single_xids_when_all_are_disabled() -> None:
    p = policy(disable="all", enable="48")
    assert p.watching and p.is_critical(48) and not p.is_critical(79)


def test_enable_all_makes_every_xid_count() -> None:
    p = policy(enable="all")
    assert all(p.is_critical(x) for x in APPLICATION_XIDS)


@pytest.mark.parametrize(
    ("variable", "value", "bad"),
    [("DP_DISABLE_HEALTHCHECKS", "79;48", "79;48"), ("DP_ENABLE_HEALTHCHECKS", "79,-1", "-1")],
)
def test_a_malformed_list_names_the_variable_and_the_item(variable: str, value: str, bad: str) -> None:
    with pytest.raises(UsageError) as error:
        xid_policy({variable: value})
    assert variable in str(error.value) and f"`{bad}`" in str(error.value)


def test_a_failed_gpu_recovers_only_after_a_quiet_period_of_normal_answers() -> None:
    tracker = GpuHealthTracker([A, B], recovery_s=60)
    assert tracker.fail(A, "critical Xid 79", now=100)
    assert not tracker.fail(A, "critical Xid 79", now=130)  # already failed: no news, but the quiet period restarts
    assert tracker.unhealthy() == {A: "critical Xid 79"}
    assert not tracker.answered(A, now=189)
    assert tracker.answered(A, now=190)
    assert tracker.unhealthy() == {}
    assert not tracker.answered(B, now=190)  # a healthy GPU answering is no recovery


def test_zero_recovery_means_the_next_normal_answer() -> None:
    tracker = GpuHealthTracker([A], recovery_s=0)
    tracker.fail(A, "lost", now=5)
    assert tracker.answered(A, now=5)


def test_probes_run_often_enough_for_short_quiet_periods_and_rarely_for_long_ones() -> None:
    assert probe_interval(60) == 5.0
    assert probe_interval(1) == 0.25
    assert probe_interval(0) == 0.1
