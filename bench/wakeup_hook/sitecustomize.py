"""Loaded by `bench/tails.py --wakeups` into the agent's interpreter (through PYTHONPATH; any process with
MPSAGENT_TEST_DIR set installs the signal handlers, and only the agent is signalled).

Between SIGUSR1 (start) and SIGUSR2 (stop) it counts the asyncio event loop's callbacks by source, with the thread
CPU each took and how many took over 1 ms, and the loop's iterations; at the stop it writes them, per second, to
$MPSAGENT_TEST_DIR/wakeups-N.json (N: 1, 2, ... one per stop). A source is the coroutine chain a task resumes in
(its innermost frames, waits left out), or the callback's name.

WAKEUP_TIMED=module:Class.method,...: also time these functions (calls, mean, max) while counting.
WAKEUP_PROFILE=module:Class.method (one of WAKEUP_TIMED): also cProfile it; the top 25 by own time go to
$MPSAGENT_TEST_DIR/profile-N.txt.
"""

from __future__ import annotations

import asyncio.events
import collections
import cProfile
import functools
import importlib
import io
import json
import os
import pstats
import selectors
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

_DIRECTORY = os.environ.get("MPSAGENT_TEST_DIR", "")
_TIMED = os.environ.get("WAKEUP_TIMED", "")
_PROFILED = os.environ.get("WAKEUP_PROFILE", "")
_WAITS = ("sleep", "wait", "checkpoint", "CancelScope", "_run")

_counts: collections.Counter[str] = collections.Counter()
_busy: collections.Counter[str] = collections.Counter()
_slow: collections.Counter[str] = collections.Counter()
_timed: dict[str, list[float]] = {}
_profile = cProfile.Profile()
_state: dict[str, Any] = {"on": False, "since": 0.0, "selects": 0, "reports": 0}


def _source(handle: asyncio.events.Handle) -> str:
    callback = handle._callback  # type: ignore[attr-defined]
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        names = []
        coro: Any = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                names.append(f"{frame.f_code.co_qualname}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        own = [name for name in names if not name.startswith(_WAITS)]
        return "task " + " > ".join((own or names)[-3:])
    return str(getattr(callback, "__qualname__", repr(callback)))


_run = asyncio.events.Handle._run
_select = selectors.EpollSelector.select


def _counted_run(self: asyncio.events.Handle) -> None:
    if not _state["on"]:
        _run(self)
        return
    source = _source(self)
    started = time.thread_time()
    _run(self)
    took = time.thread_time() - started
    _counts[source] += 1
    _busy[source] += took
    if took > 0.001:
        _slow[source] += 1


def _counted_select(self: selectors.EpollSelector, timeout: float | None = None) -> Any:
    if _state["on"]:
        _state["selects"] += 1
    return _select(self, timeout)


def _timer(original: Callable[..., Any], key: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _state["on"]:
            return original(*args, **kwargs)
        started = time.perf_counter()
        if key == _PROFILED:
            _profile.enable()
        try:
            return original(*args, **kwargs)
        finally:
            if key == _PROFILED:
                _profile.disable()
            took = time.perf_counter() - started
            entry = _timed.setdefault(key, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += took
            entry[2] = max(entry[2], took)

    timed._wakeup_timed = True  # type: ignore[attr-defined]
    return timed


def _wrap_timed() -> None:
    for spec in filter(None, _TIMED.split(",")):
        module_name, _, attribute = spec.partition(":")
        owner_name, _, name = attribute.rpartition(".")
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        original = getattr(owner, name)
        if not getattr(original, "_wakeup_timed", False):
            setattr(owner, name, _timer(original, spec))


def _start(signum: int, frame: object) -> None:
    _wrap_timed()
    for counter in (_counts, _busy, _slow, _timed):
        counter.clear()
    _state.update(on=True, since=time.monotonic(), selects=0)


def _stop(signum: int, frame: object) -> None:
    _state["on"] = False
    _state["reports"] += 1
    elapsed = time.monotonic() - _state["since"]
    rates = {"(event-loop iterations: select returned)": _state["selects"] / elapsed}
    rates.update(
        {f"{key}  [{100 * _busy[key] / elapsed:.3f} % cpu]": n / elapsed for key, n in _counts.most_common(40)}
    )
    rates["(all callbacks, % cpu)"] = 100 * sum(_busy.values()) / elapsed
    for key, (calls, total, longest) in _timed.items():
        mean = 1000 * total / max(1, calls)
        rates[f"TIMED {key}: n={calls:.0f} mean={mean:.3f} ms max={1000 * longest:.2f} ms"] = 0.0
    rates.update({f"SLOW>1ms {key}": float(n) for key, n in _slow.most_common(30)})
    number = _state["reports"]
    with open(os.path.join(_DIRECTORY, f"wakeups-{number}.json"), "w") as out:
        json.dump(rates, out)
    if _PROFILED:
        text = io.StringIO()
        pstats.Stats(_profile, stream=text).sort_stats("tottime").print_stats(25)
        with open(os.path.join(_DIRECTORY, f"profile-{number}.txt"), "w") as out:
            out.write(text.getvalue())
        _profile.clear()  # type: ignore[attr-defined]


asyncio.events.Handle._run = _counted_run  # type: ignore[method-assign]
selectors.EpollSelector.select = _counted_select  # type: ignore[assignment,method-assign]
if _DIRECTORY:
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
