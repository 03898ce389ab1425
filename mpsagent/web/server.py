"""A small HTTP/1.1 server that no client can hold open, for the web endpoint (`web.endpoint`, which owns the
routes): GET and HEAD only (HEAD: the GET's head without its body; any other method is answered 405 with `Allow`
and never reaches the routes), one request per connection, at most `HttpLimits.connections` connections (a new one
closes the oldest one, unless a worker thread is answering it), a request head that must arrive whole within
`request_timeout_s` and an exchange that ends within `deadline_s`. It runs on an event loop of its own in one
thread, so that no client touches the agent's loop; answers that may block run in at most `threads` worker threads.
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


def parse_head(head: bytes) -> Request:
    """A request head (without the blank line that ends it), or BadRequest."""
    request_line, *header_lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")
    method, _, rest = request_line.partition(" ")
    target, _, version = rest.partition(" ")
    if not method.isalpha() or not target or version not in {"HTTP/1.0", "HTTP/1.1"}:
        raise BadRequest(HTTPStatus.BAD_REQUEST, "expected a request line `METHOD /path HTTP/1.1`")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise BadRequest(HTTPStatus.BAD_REQUEST, "expected header lines `Name: value`")
        headers[name.lower()] = value.strip()
    path, _, query = target.partition("?")
    return Request(method=method, path=unquote(path, "latin-1"), query=query, headers=headers)


def end_of_head(data: bytes | bytearray) -> int | None:
    """Where the head ends, once the blank line that ends it is there (CRLF, or bare LF as some tools send)."""
    ends = [end for end in (data.find(b"\r\n\r\n"), data.find(b"\n\n")) if end >= 0]
    return min(ends) if ends else None


def encode(response: Response, *, head_only: bool) -> bytes:
    lines = [f"HTTP/1.1 {response.status}", *(f"{name}: {value}" for name, value in response.headers)]
    lines += [f"Content-Length: {len(response.body)}", "Connection: close", "", ""]
    head = "\r\n".join(lines).encode("latin-1")
    return head if head_only else head + response.body


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
        head: bytes | None = None
        try:
            with anyio.move_on_after(self._limits.request_timeout_s) as reading:
                head = await _receive_head(sock, self._limits.head_bytes)
            if reading.cancelled_caught:
                return "request_timeout"
            if head is None:
                return None  # the client closed without a request
            request = parse_head(head)
        except BadRequest as refusal:
            await _refuse(sock, refusal)
            return None
        if request.method not in ALLOWED_METHODS:
            await _refuse(sock, BadRequest(HTTPStatus.METHOD_NOT_ALLOWED, _not_allowed(request.method)))
            return None
        response = await self._respond(request, connection, threads)
        await _send_all(sock, encode(response, head_only=request.method == "HEAD"))
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


async def _receive_head(sock: socket.socket, limit: int) -> bytes | None:
    """The request head, or None when the client closes first; BadRequest when it is larger than `limit`."""
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(limit + 4 - len(data))
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        if not chunk:
            return None
        data += chunk
        if (end := end_of_head(data)) is not None:
            return bytes(data[:end])
        if len(data) > limit:
            raise BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"request head larger than {limit} bytes")


def _not_allowed(method: str) -> str:
    return f"{shown(method, 16)} is not allowed: use {' or '.join(ALLOWED_METHODS)}"


async def _refuse(sock: socket.socket, refusal: BadRequest) -> None:
    """Answer a bad request, then read what the client still sends for a moment: closing with unread data would
    reset the connection, and the client would lose the answer (a request body, for a method refused)."""
    response = Response.text(refusal.status, f"{refusal}\n")
    if refusal.status == HTTPStatus.METHOD_NOT_ALLOWED:
        response = Response(response.status, (*response.headers, ("Allow", ", ".join(ALLOWED_METHODS))), response.body)
    await _send_all(sock, encode(response, head_only=False))
    sock.shutdown(socket.SHUT_WR)
    with anyio.move_on_after(REFUSAL_LINGER_S):
        while True:
            await anyio.wait_readable(sock)  # each round waits: a client that streams cannot hold the loop
            with suppress(BlockingIOError):
                if not sock.recv(65536):
                    return


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await anyio.wait_writable(sock)
            continue
        view = view[sent:]
