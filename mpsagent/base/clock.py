"""Time as the agent's documents write it and people read it: one format (`2026-12-05T10:48:31Z`, UTC, to the
second) for the status file, the daemon's record, a ResourceSlice's taints and the prepared claims; how long ago
such a time was; and a monotonic time (the ledger's grace clock) as the wall-clock time it was."""

from __future__ import annotations

import calendar
import time

UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def utc(wall: float) -> str:
    """A wall-clock time (seconds since the epoch) as the documents write it."""
    return time.strftime(UTC_FORMAT, time.gmtime(wall))


def parse_utc(when: str | None) -> float | None:
    """A time `utc` wrote, as wall clock; None for none, or one edited by hand."""
    try:
        return None if when is None else float(calendar.timegm(time.strptime(when, UTC_FORMAT)))
    except ValueError:
        return None


def ago(when: str, now: float) -> str:
    """How long before `now` (wall clock) a time `utc` wrote was, for people: `45 s ago`, `3 min ago`, `2 d ago`;
    the text itself when it is not such a time."""
    wall = parse_utc(when)
    if wall is None:  # a file edited by hand
        return when
    seconds = max(0, int(now - wall))
    for unit, size, shown_below in (("s", 1, 120), ("min", 60, 120), ("h", 3600, 48)):
        if seconds < size * shown_below:
            return f"{seconds // size} {unit} ago"
    return f"{seconds // 86400} d ago"


def utc_of_monotonic(monotonic: float) -> str:
    """A `time.monotonic()` reading as the UTC time it was."""
    return utc(time.time() - (time.monotonic() - monotonic))
