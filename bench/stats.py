"""Order statistics of latency samples."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

NS_PER_MS = 1_000_000


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated between the closest ranks."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ms(ns: float) -> float:
    return ns / NS_PER_MS


def median_ms(samples_ns: Sequence[int]) -> float:
    return ms(median(samples_ns))


def p99_ms(samples_ns: Sequence[int]) -> float:
    return ms(percentile(samples_ns, 99))
