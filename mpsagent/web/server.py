"""A small HTTP/1.1 server that no client can hold open, for the web endpoint (`web.endpoint`, which owns the
routes): GET and HEAD only (HEAD: the GET's head without its body; any other method is answered 405 with `Allow`
and never reaches the routes), one request per connection, at most `HttpLimits.connections` connections (a new one
closes the oldest one, unless a worker thread is answering it), a request head that must arrive whole within
`request_timeout_s` and an exchange that ends within `deadline_s`. It runs on an event loop of its own in one
thread, so that no client touches the agent's loop; answers that may block run in at most `threads` worker threads.

h11 parses the request head and frames the answer (it does no I/O of its own); what is here is what no HTTP library
gives: the connection cap, the timeouts, the methods, the bound on the head, and the sockets.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Literal
from urllib.parse import unquote

import anyio
import h11
from anyio.abc import TaskGroup, TaskStatus

from mpsagent.base.errors import shown
from mpsagent.base.logs import get_logger

log = get_logger(__name__)

CloseReason = Literal["cap", "request_timeout", "deadline"]
CLOSE_REASONS: tuple[CloseReason, ...] = ("cap", "request_timeout", "deadline")
BACKLOG = 128
ACCEPT_RETRY_S = 0.1
"""After an accept that failed for want of resources (EMFILE, ENFILE, ENOBUFS): a pause, not a busy loop."""
STOP_TIMEOUT_S = 2.0
REFUSAL_LINGER_S = 1.0
ALLOWED_METHODS = ("GET", "HEAD")
CLOSED_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    connections: int = 64
    """Open connections at most. Probes and scrapes need a few; a new connection beyond this closes the oldest
    one that is not in a worker thread."""
    request_timeout_s: float = 5.0
    """From the connection to the end of its request head: idle clients and dribbled heads end here."""
    deadline_s: float = 10.0
    """From the connection to the last byte of its answer: clients that do not read their answer end here."""
    threads: int = 2
    """Worker threads for answers that may block (a scrape reads NVML)."""
    head_bytes: int = 8192
    """The largest request head (request line and headers); a larger one is answered 431."""

    def __post_init__(self) -> None:
        if self.connections <= self.threads:
            raise ValueError("connections must exceed threads, so that one connection can always be closed")


HTTP_LIMITS = HttpLimits()


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    """Lower-case names."""


@dataclass(frozen=True)
class Response:
    status: str
    """The status line's code and reason, `200 OK`."""
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @classmethod
    def text(cls, status: HTTPStatus, text: str) -> Response:
        return cls(f"{status.value} {status.phrase}", (("Content-Type", "text/plain; charset=utf-8"),), text.encode())


@dataclass(frozen=True)
class Blocking:
    """An answer that may block: the server runs `render` in a worker thread."""

    render: Callable[[], Response]


Answer = Callable[[Request], Response | Blocking]


class BadRequest(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


BAD_REQUEST_LINE = "expected a request line `METHOD /path HTTP/1.1`"
MALFORMED = f"{BAD_REQUEST_LINE} and header lines `Name: value`"
_PLACEHOLDER_HOST = b"mpsagent.invalid"


def _server_connection(head_bytes: int) -> h11.Connection:
    return h11.Connection(h11.SERVER, max_incomplete_event_size=head_bytes)


class Exchange:
    """One request and its answer, parsed and framed by h11 (which does no I/O of its own): the bytes received go
    in, the request comes out once its head is whole, and the answer's bytes come out with `Content-Length` and
    `Connection: close`. What h11 refuses is BadRequest: 431 for a head that has not ended within `head_bytes`,
    400 for anything malformed. No I/O here either: the server feeds it what its socket reads, and the tests feed
    it request heads (`mpsagent_testing.web`)."""

    def __init__(self, head_bytes: int) -> None:
        self._head_bytes = head_bytes
        self._http = _server_connection(head_bytes)
        self._received = bytearray()
        """Every byte given to h11, kept for a request without `Host` (`_without_host`); at most a head's."""

    def receive(self, data: bytes) -> None:
        self._received += data
        self._http.receive_data(data)

    def request(self) -> Request | None:
        """The request once its head is whole; None until then."""
        try:
            event = self._http.next_event()
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
                raise BadRequest(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"request head larger than {self._head_bytes} bytes"
                ) from None
            return self._without_host()
        if event is h11.NEED_DATA:
            return None
        if not isinstance(event, h11.Request):
            raise BadRequest(HTTPStatus.BAD_REQUEST, MALFORMED)
        return _request(event)

    def _without_host(self) -> Request:
        """An HTTP/1.1 request without `Host`, which h11 refuses as RFC 9112 asks and this server has always
        answered (nothing here depends on the host): parsed again, and answered, with a placeholder `Host` line
        that its headers leave out. BadRequest when h11 refused it for anything else."""
        received = bytes(self._received)
        line_end = received.find(b"\n") + 1
        if line_end == 0 or received[line_end : line_end + 1] in {b" ", b"\t"}:
            # No request line; or a first header line that continues it, which the placeholder would hide.
            raise BadRequest(HTTPStatus.BAD_REQUEST, MALFORMED)
        http = _server_connection(len(received) + 64)
        http.receive_data(received[:line_end] + b"Host: " + _PLACEHOLDER_HOST + b"\r\n" + received[line_end:])
        try:
            event = http.next_event()
        except h11.RemoteProtocolError:
            event = None
        if not isinstance(event, h11.Request) or event.http_version != b"1.1":
            raise BadRequest(HTTPStatus.BAD_REQUEST, MALFORMED)
        self._http = http
        request = _request(event)
        headers = {name: value for name, value in request.headers.items() if name != "host"}
        return Request(method=request.method, path=request.path, query=request.query, headers=headers)

    def answer(self, response: Response, *, head_only: bool = False) -> list[bytes]:
        """The answer's bytes: the status line, the headers, `Content-Length`, `Connection: close`, and the body
        unless `head_only`."""
        code, _, reason = response.status.partition(" ")
        headers = [*response.headers, ("Content-Length", str(len(response.body))), ("Connection", "close")]
        chunks = self._send(h11.Response(status_code=int(code), headers=headers, reason=reason))
        if not head_only and response.body:
            chunks += self._send(h11.Data(data=response.body))  # passed through: a large body is not copied
        return chunks + self._send(h11.EndOfMessage())

    def _send(self, event: h11.Event) -> list[bytes]:
        return self._http.send_with_data_passthrough(event) or []  # None only for ConnectionClosed


def _request(event: h11.Request) -> Request:
    """What the routes see of h11's request; only letters in a method, and HTTP/1.0 or 1.1."""
    method = event.method.decode("ascii")
    if not method.isalpha() or event.http_version not in {b"1.0", b"1.1"}:
        raise BadRequest(HTTPStatus.BAD_REQUEST, BAD_REQUEST_LINE)
    path, _, query = event.target.decode("latin-1").partition("?")
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
    return Request(method=method, path=unquote(path, "latin-1"), query=query, headers=headers)


@dataclass(frozen=True)
class HttpStatistics:
    open: int
    closed: Mapping[CloseReason, int]
    """Connections the server closed before their answer, by why."""


class _Connection:
    """One accepted connection; `scope` ends it (its deadline, or the cap)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.scope = anyio.CancelScope(deadline=deadline)
        self.in_thread = False
        self.evicted = False
        self.closed = anyio.Event()


@dataclass
class _ClosedLog:
    """Counts of connections closed early, and a warning about them at most every CLOSED_LOG_INTERVAL_S."""

    counts: dict[CloseReason, int] = field(default_factory=lambda: dict.fromkeys(CLOSE_REASONS, 0))
    next_log: float = 0.0

    def add(self, reason: CloseReason, open_connections: int) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now >= self.next_log:
            self.next_log = now + CLOSED_LOG_INTERVAL_S
            log.warning(
                "http clients cut off",
                open=open_connections,
                **{f"closed_{reason}": count for reason, count in self.counts.items()},
                hint="idle, slow or too many clients on the metrics port; restrict who can reach it",
            )


def listen(address: tuple[str, int]) -> socket.socket:
    """A non-blocking listening socket; raises OSError (an address in use, a host that does not resolve)."""
    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class HttpServer:
    def __init__(self, answer: Answer, limits: HttpLimits = HTTP_LIMITS) -> None:
        self._answer = answer
        self._limits = limits
        self._open: dict[_Connection, None] = {}
        """Oldest first."""
        self._closed = _ClosedLog()
        self._failure: BaseException | None = None

    def statistics(self) -> HttpStatistics:
        """Safe from any thread."""
        return HttpStatistics(open=len(self._open), closed=dict(self._closed.counts))

    async def run(self, listener: socket.socket, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve on `listener` from a thread of its own until cancelled; the listener is closed afterwards. An
        unexpected end of that thread ends this task too."""
        ours, theirs = socket.socketpair()  # ours: a byte asks the thread to stop; theirs closes when it ends
        thread = threading.Thread(target=self._thread_main, args=(listener, theirs), name="mpsagent-http", daemon=True)
        thread.start()
        task_status.started()
        try:
            await anyio.wait_readable(ours)
        finally:
            with anyio.CancelScope(shield=True):
                with suppress(OSError):  # the thread has already ended
                    ours.send(b"\0")
                await anyio.to_thread.run_sync(thread.join, STOP_TIMEOUT_S)
                ours.close()
        raise RuntimeError("the http endpoint's thread ended") from self._failure

    def _thread_main(self, listener: socket.socket, stop: socket.socket) -> None:
        try:
            anyio.run(self._serve, listener, stop)
        except BaseException as exc:  # handed to `run`, which raises it on the agent's loop
            self._failure = exc
        finally:
            listener.close()
            stop.close()

    async def _serve(self, listener: socket.socket, stop: socket.socket) -> None:
        threads = anyio.CapacityLimiter(self._limits.threads)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._accept, listener, threads, tg)
            await anyio.wait_readable(stop)
            tg.cancel_scope.cancel()

    async def _accept(self, listener: socket.socket, threads: anyio.CapacityLimiter, tg: TaskGroup) -> None:
        failing = False
        while True:
            await anyio.wait_readable(listener)
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                continue  # the client left before we took it
            except OSError as exc:
                if not failing:  # once per episode: out of descriptors, this would repeat ten times a second
                    log.warning("http connection not accepted", reason=exc.strerror or str(exc))
                failing = True
                await anyio.sleep(ACCEPT_RETRY_S)
                continue
            failing = False
            sock.setblocking(False)
            if len(self._open) >= self._limits.connections:
                await self._close_oldest()
            connection = _Connection(sock, deadline=anyio.current_time() + self._limits.deadline_s)
            self._open[connection] = None
            tg.start_soon(self._serve_connection, connection, threads)

    async def _close_oldest(self) -> None:
        # At most `threads` connections are in a worker thread, fewer than the cap: there always is one.
        oldest = next(c for c in self._open if not c.in_thread)
        oldest.evicted = True
        oldest.scope.cancel()
        await oldest.closed.wait()  # its descriptor is closed before the next one is taken

    async def _serve_connection(self, connection: _Connection, threads: anyio.CapacityLimiter) -> None:
        reason: CloseReason | None = None
        try:
            with connection.scope:
                reason = await self._exchange(connection, threads)
            if connection.scope.cancelled_caught:
                reason = "cap" if connection.evicted else "deadline"
        except OSError:
            pass  # the client reset or left
        finally:
            connection.sock.close()
            del self._open[connection]
            connection.closed.set()
        if reason is not None:
            self._closed.add(reason, len(self._open))

    async def _exchange(self, connection: _Connection, threads: anyio.CapacityLimiter) -> CloseReason | None:
        """Read one request and answer it; why the connection was cut off, if it was."""
        sock = connection.sock
        exchange = Exchange(self._limits.head_bytes)
        try:
            with anyio.move_on_after(self._limits.request_timeout_s) as reading:
                request = await _receive_request(sock, exchange, self._limits.head_bytes)
            if reading.cancelled_caught:
                return "request_timeout"
            if request is None:
                return None  # the client closed without a request
        except BadRequest as refusal:
            await _refuse(sock, exchange, refusal)
            return None
        if request.method not in ALLOWED_METHODS:
            await _refuse(sock, exchange, BadRequest(HTTPStatus.METHOD_NOT_ALLOWED, _not_allowed(request.method)))
            return None
        response = await self._respond(request, connection, threads)
        await _send_all(sock, exchange.answer(response, head_only=request.method == "HEAD"))
        sock.shutdown(socket.SHUT_WR)
        return None

    async def _respond(self, request: Request, connection: _Connection, threads: anyio.CapacityLimiter) -> Response:
        try:
            answer = self._answer(request)
            if isinstance(answer, Response):
                return answer
            async with threads:
                connection.in_thread = True
                try:
                    return await anyio.to_thread.run_sync(answer.render)
                finally:
                    connection.in_thread = False
        except Exception:
            log.exception("http request failed unexpectedly", path=request.path)
            return Response.text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the agent's log\n")


async def _receive_request(sock: socket.socket, exchange: Exchange, head_bytes: int) -> Request | None:
    """The request once its head is whole, or None when the client closes first; BadRequest for a head that is
    malformed or larger than `head_bytes`."""
    received = 0
    while (request := exchange.request()) is None:
        try:
            chunk = sock.recv(head_bytes + 4 - received)  # never more than a head's bytes, and a blank line
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        if not chunk:
            return None
        received += len(chunk)
        exchange.receive(chunk)
    return request


def _not_allowed(method: str) -> str:
    return f"{shown(method, 16)} is not allowed: use {' or '.join(ALLOWED_METHODS)}"


async def _refuse(sock: socket.socket, exchange: Exchange, refusal: BadRequest) -> None:
    """Answer a bad request, then read what the client still sends for a moment: closing with unread data would
    reset the connection, and the client would lose the answer (a request body, for a method refused)."""
    response = Response.text(refusal.status, f"{refusal}\n")
    if refusal.status == HTTPStatus.METHOD_NOT_ALLOWED:
        response = Response(response.status, (*response.headers, ("Allow", ", ".join(ALLOWED_METHODS))), response.body)
    await _send_all(sock, exchange.answer(response))
    sock.shutdown(socket.SHUT_WR)
    with anyio.move_on_after(REFUSAL_LINGER_S):
        while True:
            await anyio.wait_readable(sock)  # each round waits: a client that streams cannot hold the loop
            with suppress(BlockingIOError):
                if not sock.recv(65536):
                    return


async def _send_all(sock: socket.socket, chunks: list[bytes]) -> None:
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(sock)
                continue
            view = view[sent:]
