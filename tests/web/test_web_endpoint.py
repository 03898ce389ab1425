"""The web endpoint's routes in this process, through a real TCP socket: GET and HEAD on every path and 405 for
anything else, and `/metrics` rendered at most once per publish however many scrapes come in between."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import structlog
from anyio.from_thread import start_blocking_portal
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mpsagent.documents.metrics import AgentMetrics
from mpsagent.documents.status import starting_document
from mpsagent.web import WebEndpoint
from mpsagent_testing.http_clients import connect

PATHS = ["/metrics", "/healthz", "/readyz", "/nope"]


class CountingCollector(Collector):
    """Counts how often the registry is rendered."""

    def __init__(self) -> None:
        self.renders = 0

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.renders += 1
        yield GaugeMetricFamily("test_renders", "Renders so far", value=self.renders)


@contextmanager
def endpoint_running() -> Iterator[tuple[WebEndpoint, tuple[str, int], CountingCollector]]:
    starting = starting_document(["nvidia.com/gpu"])
    metrics = AgentMetrics(starting=starting, gpus=(), gpu_source=None, proc_root=Path("/proc"))
    counter = CountingCollector()
    metrics.registry.register(counter)
    endpoint = WebEndpoint(("127.0.0.1", 0), metrics)
    with structlog.testing.capture_logs() as logs, start_blocking_portal() as portal:
        future, _ = portal.start_task(endpoint.run)
        try:
            serving = next(e for e in logs if e["event"] == "http endpoint serving")
            host, _, port = str(serving["address"]).rpartition(":")
            yield endpoint, (host, int(port)), counter
        finally:
            future.cancel()
            with suppress(CancelledError):
                future.result(10)


def exchange(address: tuple[str, int], method: str, path: str, *headers: str) -> tuple[str, dict[str, str], bytes]:
    """(status line, headers by lower-case name, body) of one request."""
    with connect(address, timeout=10) as sock:
        sock.sendall("\r\n".join([f"{method} {path} HTTP/1.1", "Host: test", *headers, "", ""]).encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    return status, {name.lower(): value for name, _, value in (line.partition(": ") for line in lines)}, body


def test_get_and_head_answer_on_every_path_and_head_has_the_same_headers_without_a_body() -> None:
    with endpoint_running() as (_, address, _):
        for path in PATHS:
            status, headers, body = exchange(address, "GET", path)
            head_status, head_headers, head_body = exchange(address, "HEAD", path)
            assert (head_status, head_headers, head_body) == (status, headers, b""), path
            assert int(headers["content-length"]) == len(body) > 0, path
        assert exchange(address, "HEAD", "/metrics")[0] == "HTTP/1.1 200 OK"


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"])
def test_other_methods_are_refused_with_405_and_the_methods_allowed(method: str) -> None:
    with endpoint_running() as (_, address, counter):
        for path in PATHS:
            status, headers, body = exchange(address, method, path)
            assert status == "HTTP/1.1 405 Method Not Allowed", (method, path)
            assert headers["allow"] == "GET, HEAD"
            assert body == f"{method} is not allowed: use GET or HEAD\n".encode()
        assert counter.renders == 0


def test_a_scrape_flood_renders_once_per_publish_and_format() -> None:
    """What the agent's loop pays for scrapes is bounded by its publishes (every 0.5 s), not by the scrapers:
    scrapes between two publishes get the same bytes, for each format (text or OpenMetrics, gzip or not)."""
    with endpoint_running() as (endpoint, address, counter):
        plain = [exchange(address, "GET", "/metrics")[2] for _ in range(50)]
        assert counter.renders == 1
        assert len(set(plain)) == 1
        zipped = [exchange(address, "GET", "/metrics", "Accept-Encoding: gzip")[2] for _ in range(10)]
        assert counter.renders == 2
        assert len(set(zipped)) == 1 and b"test_renders 2.0" in gzip.decompress(zipped[0])
        endpoint.publish(endpoint.metrics.document)
        after = [exchange(address, "GET", "/metrics")[2] for _ in range(20)]
        assert counter.renders == 3
        assert b"test_renders 3.0" in after[0] and len(set(after)) == 1


def test_formats_beyond_the_budget_of_a_publish_wait_for_the_next_one() -> None:
    """A client that asks for a new format (another query) with every scrape would render each time: beyond
    MAX_RENDERS_PER_PUBLISH renders between two publishes it is told to come back (429, Retry-After)."""
    from mpsagent.web.endpoint import MAX_RENDERS_PER_PUBLISH  # noqa: PLC0415

    with endpoint_running() as (endpoint, address, counter):
        answers = [exchange(address, "GET", f"/metrics?x={i}") for i in range(12)]
        assert counter.renders == MAX_RENDERS_PER_PUBLISH
        assert [a[0] for a in answers[MAX_RENDERS_PER_PUBLISH:]] == ["HTTP/1.1 429 Too Many Requests"] * (
            12 - MAX_RENDERS_PER_PUBLISH
        )
        assert answers[-1][1]["retry-after"] == "1"
        assert exchange(address, "GET", "/metrics?x=0")[0] == "HTTP/1.1 200 OK"  # cached
        endpoint.publish(endpoint.metrics.document)
        assert exchange(address, "GET", "/metrics?x=11")[0] == "HTTP/1.1 200 OK"
