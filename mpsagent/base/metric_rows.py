"""Metric families declared as rows of a table, beside the snapshot fields they read.

A row says a family's name, help text, type and labels, and how its samples come from a typed snapshot; `within`
lifts rows of a part (a daemon's status, a GPU's) to the whole that holds it, adding the part's labels.
`documents.metrics` turns the status document's table into Prometheus families, so that a new fact is one field
and one row. Plain data: nothing here imports prometheus_client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

S = TypeVar("S")
T = TypeVar("T")

MetricKind = Literal["gauge", "counter"]
Labels = tuple[str, ...]
Sample = tuple[Labels, int | float]
Samples = Callable[[S], Iterable[Sample]]


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricRow(Generic[S]):
    """One metric family: its samples (label values and value) read from a snapshot of type S."""

    name: str
    help: str
    kind: MetricKind
    labels: Labels
    samples: Samples[S]


def _number(value: int | float) -> int | float:
    return int(value) if isinstance(value, bool) else value


def one(value: Callable[[S], int | float | None]) -> Samples[S]:
    """One sample without labels of its own (a bool is 1 or 0); none while the value is None (not known)."""

    def samples(snapshot: S) -> Iterable[Sample]:
        found = value(snapshot)
        return () if found is None else (((), _number(found)),)

    return samples


def each(label_values: Labels, value: Callable[[S, str], int | float]) -> Samples[S]:
    """One sample per value of the row's one label, always all of them."""

    def samples(snapshot: S) -> Iterable[Sample]:
        return (((label,), _number(value(snapshot, label))) for label in label_values)

    return samples


def gauge(name: str, help_text: str, samples: Samples[S], labels: Labels = ()) -> MetricRow[S]:
    return MetricRow(name=name, help=help_text, kind="gauge", labels=labels, samples=samples)


def counter(name: str, help_text: str, samples: Samples[S], labels: Labels = ()) -> MetricRow[S]:
    """`name` without `_total`: prometheus_client adds it."""
    return MetricRow(name=name, help=help_text, kind="counter", labels=labels, samples=samples)


def within(
    labels: Labels, parts: Callable[[T], Iterable[tuple[Labels, S]]], rows: Iterable[MetricRow[S]]
) -> tuple[MetricRow[T], ...]:
    """`rows` of a part, read from the whole that holds its `parts` (each with its values of `labels`, which come
    first)."""

    def lifted(row: MetricRow[S]) -> MetricRow[T]:
        def samples(whole: T) -> Iterable[Sample]:
            return ((outer + inner, value) for outer, part in parts(whole) for inner, value in row.samples(part))

        return MetricRow(name=row.name, help=row.help, kind=row.kind, labels=labels + row.labels, samples=samples)

    return tuple(lifted(row) for row in rows)
