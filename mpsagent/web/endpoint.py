"""The HTTP endpoint: `/metrics`, `/healthz` and `/readyz`, served by `web.server` (bounded connections and
deadlines, a thread and event loop of its own), owned by one task of the supervisor.

`/healthz` answers 200 while the event loop keeps publishing (a stuck loop, or a dead supervisor, stops it);
`/readyz` answers 200 once every resource is registered with the kubelet and its MPS daemon is up. `/metrics` is
rendered at most once per publish and format (`_ScrapeCache`): the renders share the interpreter with the agent's
event loop, so a flood of scrapes must cost the loop what the publishes allow, not what the scrapers ask.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from http import HTTPStatus

import anyio
from anyio.abc import TaskStatus
from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mpsagent.base.errors import HostError
from mpsagent.base.logs import get_logger
from mpsagent.documents.metrics import AgentMetrics
from mpsagent.documents.status import readiness_problems
from mpsagent.documents.status_document import StatusDocument
from mpsagent.web.server import HTTP_LIMITS, Blocking, HttpLimits, HttpServer, Request, Response, listen

log = get_logger(__name__)

STALE_AFTER_S = 10.0
MAX_RENDERS_PER_PUBLISH = 8
"""Renders of `/metrics` between two publishes (every STATUS_INTERVAL_S): one per format asked for (Prometheus asks
for one, a person with curl another); a scrape that would render beyond it is answered 429."""
RETRY_AFTER_S = 1

_Format = tuple[str, str, str]
"""What picks a scrape's bytes: its Accept and Accept-Encoding headers and its query (`name[]` filters)."""


class _ScrapeCache:
    """`/metrics` answers, each rendered at most once per publish: the scrapes between two publishes get the same
    bytes (a HEAD the same head), at once on the server's loop. `published()` is called by the agent's loop (the
    only writer of the publish count); everything else runs in the server's threads."""

    def __init__(self, render: Callable[[Request], Response]) -> None:
        self._render = render
        self._published = 0
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        """One render at a time: a second scrape of a format waits for the first one's bytes."""
        self._seen = 0
        self._answers: dict[_Format, Response] = {}
        """Rendered since publish `_seen`."""
        self._renders = 0

    def published(self) -> None:
        self._published += 1

    def answer(self, request: Request) -> Response | Blocking:
        key = (request.headers.get("accept", ""), request.headers.get("accept-encoding", ""), request.query)
        with self._lock:
            cached = self._current().get(key)
        return cached if cached is not None else Blocking(partial(self._rendered, key, request))

    def _current(self) -> dict[_Format, Response]:
        """The answers of the latest publish (under `_lock`)."""
        if self._seen != self._published:
            self._seen, self._renders = self._published, 0
            self._answers = {}
        return self._answers

    def _rendered(self, key: _Format, request: Request) -> Response:
        """In a worker thread."""
        with self._render_lock:
            with self._lock:
                cached = self._current().get(key)
                if cached is not None:
                    return cached
                if self._renders >= MAX_RENDERS_PER_PUBLISH:
                    return _too_many()
                self._renders += 1
                publish = self._seen
            response = self._render(request)
            with self._lock:
                answers = self._current()
                if self._seen == publish:  # not published meanwhile: these bytes are the publish's
                    answers[key] = response
            return response


def _too_many() -> Response:
    refused = Response.text(
        HTTPStatus.TOO_MANY_REQUESTS,
        f"more than {MAX_RENDERS_PER_PUBLISH} formats of /metrics asked for since the last publish; "
        f"ask again in {RETRY_AFTER_S} s\n",
    )
    return Response(refused.status, (*refused.headers, ("Retry-After", str(RETRY_AFTER_S))), refused.body)


class WebEndpoint:
    def __init__(self, address: tuple[str, int], metrics: AgentMetrics, limits: HttpLimits = HTTP_LIMITS) -> None:
        self._address = address
        self.metrics = metrics
        self._metrics_app = make_wsgi_app(metrics.registry)
        self._scrapes = _ScrapeCache(self._scrape)
        self._heartbeat = time.monotonic()
        self._server = HttpServer(self._answer, limits)
        metrics.registry.register(_HttpCollector(self._server))

    def publish(self, document: StatusDocument) -> None:
        """Called by the event loop: the state scrapes and probes read, and proof that the loop is alive."""
        self.metrics.document = document
        self._heartbeat = time.monotonic()
        self._scrapes.published()

    def _answer(self, request: Request) -> Response | Blocking:
        """On the server's loop: cheap answers at once, and a scrape already rendered since the last publish; a new
        render (collectors, NVML) in a worker thread."""
        if request.path == "/metrics":
            return self._scrapes.answer(request)
        if request.path == "/healthz":
            age = time.monotonic() - self._heartbeat
            ok, text = age < STALE_AFTER_S, f"event loop last seen {age:.1f}s ago"
        elif request.path == "/readyz":
            problems = readiness_problems(self.metrics.document)
            ok, text = not problems, "\n".join(problems) or "ready"
        else:
            return Response.text(HTTPStatus.NOT_FOUND, "not found: try /metrics, /healthz or /readyz\n")
        return Response.text(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, text + "\n")

    def _scrape(self, request: Request) -> Response:
        """prometheus_client's own WSGI application: its content negotiation, gzip and `name[]` filter."""
        environ = {
            "REQUEST_METHOD": "GET",  # HEAD too: the server sends the GET's head without its body
            "PATH_INFO": request.path,
            "QUERY_STRING": request.query,
            **{"HTTP_" + name.upper().replace("-", "_"): value for name, value in request.headers.items()},
        }
        started: list[tuple[str, list[tuple[str, str]]]] = []

        def start_response(status: str, headers: list[tuple[str, str]]) -> None:
            started.append((status, headers))

        body: Iterable[bytes] = self._metrics_app(environ, start_response)
        (status, headers), content = started[0], b"".join(body)
        return Response(status, tuple(headers), content)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        host, port = self._address
        try:
            listener = listen(self._address)
        except OSError as exc:
            raise HostError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); choose another --metrics-address"
            ) from exc
        log.info("http endpoint serving", address=f"{host}:{listener.getsockname()[1]}")
        await self._server.run(listener, task_status=task_status)


class _HttpCollector(Collector):
    def __init__(self, server: HttpServer) -> None:
        self._server = server

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        statistics = self._server.statistics()
        yield GaugeMetricFamily(
            "mpsagent_http_connections", "Open connections to this HTTP endpoint", value=statistics.open
        )
        closed = CounterMetricFamily(
            "mpsagent_http_connections_closed",
            "Connections the HTTP endpoint closed before answering: cap (a newer one needed the slot), "
            "request_timeout (no whole request in time), deadline (the answer not taken in time)",
            labels=["reason"],
        )
        for reason, count in statistics.closed.items():
            closed.add_metric([reason], count)
        yield closed
