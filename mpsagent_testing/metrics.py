"""Reading the agent's HTTP endpoint: a GET that returns the status whatever it is, and `/metrics` samples."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def get(url: str) -> tuple[int, str]:
    """(HTTP status, body)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `base/metrics`, by name and sorted labels."""
    status, text = get(base + "/metrics")
    assert status == 200, f"GET {base}/metrics answered {status}"
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(base: str, name: str, **labels: str) -> float | None:
    """One sample's value, or None when `/metrics` has no such sample."""
    return samples(base).get((name, tuple(sorted(labels.items()))))
