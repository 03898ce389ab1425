"""What one run of the scenarios measured: metric values, how many of each thing were measured, raw samples."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResults:
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    samples_ms: dict[str, list[float]] = field(default_factory=dict)
    series: dict[str, list[list[float]]] = field(default_factory=dict)
    """(x, y) pairs, e.g. RSS against Allocate calls"""

    def update(self, other: RunResults) -> None:
        self.metrics.update(other.metrics)
        self.counts.update(other.counts)
        self.samples_ms.update(other.samples_ms)
        self.series.update(other.series)
