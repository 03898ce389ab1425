"""Reading the agent's HTTP endpoint: a GET that returns the status whatever it is, and `/metrics` samples; and
docs/metrics.md's table of the metrics it exports, which tests hold the code, the alerts and the dashboard to."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mpsagent_testing.repo import ROOT


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


METRICS_DOC = ROOT / "docs" / "metrics.md"


def documented_labels() -> dict[str, tuple[str, ...]]:
    """Each metric of docs/metrics.md's table with the label names its labels column gives, in order."""
    rows = re.findall(r"^\| `(mpsagent_\w+)` \| \w* \|([^|]*)\|", METRICS_DOC.read_text(), re.MULTILINE)
    # A label's values follow it in parentheses: `health` (`Healthy`, `Unhealthy`).
    return {name: tuple(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels))) for name, labels in rows}
