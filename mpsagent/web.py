"""The HTTP endpoint: `/metrics`, `/healthz` and `/readyz`, served by the standard library's WSGI server in
threads (prometheus_client's ThreadingWSGIServer), owned by one task of the supervisor.

`/healthz` answers 200 while the event loop keeps publishing (a stuck loop, or a dead supervisor, stops it);
`/readyz` answers 200 once every resource is registered with the kubelet and its MPS daemon is up.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import anyio
from anyio.abc import TaskStatus
from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from mpsagent.errors import MpsAgentError
from mpsagent.logs import get_logger
from mpsagent.metrics import AgentMetrics
from mpsagent.status import readiness_problems
from mpsagent.status_document import StatusDocument

log = get_logger(__name__)

STALE_AFTER_S = 10.0

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _Ipv6Server(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds would flood the log."""


class WebEndpoint:
    def __init__(self, address: tuple[str, int], metrics: AgentMetrics) -> None:
        self._address = address
        self.metrics = metrics
        self.metrics_app = make_wsgi_app(metrics.registry)
        self._heartbeat = time.monotonic()

    def publish(self, document: StatusDocument) -> None:
        """Called by the event loop: the state scrapes and probes read, and proof that the loop is alive."""
        self.metrics.document = document
        self._heartbeat = time.monotonic()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self.metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if path == "/healthz":
            age = time.monotonic() - self._heartbeat
            ok, text = age < STALE_AFTER_S, f"event loop last seen {age:.1f}s ago"
        elif path == "/readyz":
            problems = readiness_problems(self.metrics.document)
            ok, text = not problems, "\n".join(problems) or "ready"
        else:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: try /metrics, /healthz or /readyz\n"]
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")])
        return [text.encode() + b"\n"]

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        host, port = self._address
        server_class = _Ipv6Server if ":" in host else ThreadingWSGIServer
        try:
            server = make_server(host, port, self._app, server_class=server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise MpsAgentError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); choose another --metrics-address"
            ) from exc
        thread = threading.Thread(target=server.serve_forever, name="mpsagent-http", daemon=True)
        thread.start()
        log.info("http endpoint serving", address=f"{host}:{server.server_port}")
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(server.shutdown)
                server.server_close()
                await anyio.to_thread.run_sync(thread.join)
