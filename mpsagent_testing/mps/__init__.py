"""The MPS control daemon in tests: the real front-end (`daemon`), and `nvidia-cuda-mps-control` here, a fake
binary for the faults the real one cannot show (`FAKE_CONTROL_BIN`)."""

from __future__ import annotations

from pathlib import Path

from mpsagent.mps.lifecycle import RECHECK_S, RESTART_AFTER_S
from mpsagent.mps.liveness import GREETING_TIMEOUT_S, HUNG_AFTER_MISSES

FAKE_CONTROL_BIN = Path(__file__).with_name("nvidia-cuda-mps-control")


def unanswered_bound_s(probe_interval_s: float) -> float:
    """The longest a daemon that greets no connection goes unnoticed (its replicas Unhealthy from then on), as the
    docs promise it: a check every probe interval, and HUNG_AFTER_MISSES greetings that do not come (whatever the
    RPC load: the check waits for no lock)."""
    return probe_interval_s + HUNG_AFTER_MISSES * GREETING_TIMEOUT_S


def restart_bound_s(probe_interval_s: float) -> float:
    """The longest a hung daemon lives before it is ended (and another started): noticed, then RESTART_AFTER_S of
    checks every RECHECK_S, each one greeting long."""
    return unanswered_bound_s(probe_interval_s) + RESTART_AFTER_S + RECHECK_S + GREETING_TIMEOUT_S
