"""The bounded HTTP server behind the web endpoint, in this process with small limits and through real TCP
sockets: which connection the cap closes, the deadline for clients that do not read, answers that block or fail;
and its request parser, table-driven."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager, suppress
from http import HTTPStatus

import pytest
from anyio.from_thread import start_blocking_portal

from mpsagent.web.server import BadRequest, Blocking, HttpLimits, HttpServer, Request, Response, listen
from mpsagent_testing.http_clients import closed_by_peer, connect
from mpsagent_testing.kubelet.fake import wait_for
from mpsagent_testing.web import parse_head

OK = Response.text(HTTPStatus.OK, "ok\n")


@contextmanager
def running(answer: Callable[[Request], Response | Blocking], limits: HttpLimits) -> Iterator[tuple[HttpServer, tuple]]:
    listener = listen(("127.0.0.1", 0))
    address = listener.getsockname()
    server = HttpServer(answer, limits)
    with start_blocking_portal() as portal:
        future, _ = portal.start_task(server.run, listener)
        try:
            yield server, address
        finally:
            future.cancel()
            with suppress(CancelledError):
                future.result(10)
    assert listener.fileno() == -1  # closed with the server


def request(address: tuple, path: str = "/") -> bytes:
    with connect(address, timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_a_new_connection_beyond_the_cap_closes_the_one_that_waited_longest() -> None:
    with running(lambda _: OK, HttpLimits(connections=3)) as (server, address):
        first, second, third = (connect(address) for _ in range(3))
        wait_for(lambda: server.statistics().open == 3, 5, "three open")
        fourth = connect(address)
        wait_for(lambda: closed_by_peer(first), 5, "the first closed")
        assert not any(map(closed_by_peer, (second, third, fourth)))
        assert request(address).endswith(b"\r\n\r\nok\n")  # takes the second's slot, and is answered
        wait_for(lambda: closed_by_peer(second), 5, "the second closed")
        assert not any(map(closed_by_peer, (third, fourth)))
        assert server.statistics().closed["cap"] == 2
        for sock in (first, second, third, fourth):
            sock.close()


def test_a_client_that_does_not_read_its_answer_is_cut_off_at_the_deadline() -> None:
    big = Response("200 OK", (), bytes(64 << 20))  # far more than the socket buffers hold
    limits = HttpLimits(request_timeout_s=0.5, deadline_s=1.5)
    with running(lambda _: big, limits) as (server, address):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(address)
        with sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
            wait_for(lambda: server.statistics().closed["deadline"] == 1, limits.deadline_s + 3, "cut off")
            assert server.statistics().open == 0


def test_blocking_answers_run_in_bounded_threads_and_never_hold_up_the_others() -> None:
    """A scrape stuck in NVML must not stop /healthz, nor keep new clients out."""
    release = threading.Event()
    rendering: list[str] = []

    def render() -> Response:
        rendering.append("render")
        release.wait(10)
        return OK

    limits = HttpLimits(connections=4, threads=2)
    with running(lambda r: Blocking(render) if r.path == "/slow" else OK, limits) as (server, address):
        slow = [connect(address) for _ in range(3)]
        for sock in slow:
            sock.sendall(b"GET /slow HTTP/1.1\r\n\r\n")
        wait_for(lambda: len(rendering) == 2, 5, "two renders")  # the third waits for a thread
        idle = connect(address)
        wait_for(lambda: server.statistics().open == 4, 5, "every slot taken")
        # The new client closes the oldest connection that is not in a thread: the slow one that waits for one.
        assert request(address).endswith(b"\r\n\r\nok\n")
        waiting = wait_for(lambda: [s for s in slow if closed_by_peer(s)], 5, "the waiting one closed")
        assert len(waiting) == 1 and not closed_by_peer(idle)
        assert request(address).endswith(b"\r\n\r\nok\n")
        assert len(rendering) == 2
        release.set()
        for sock in slow:
            if sock not in waiting:
                wait_for(lambda s=sock: s.recv(64, socket.MSG_PEEK).startswith(b"HTTP/1.1 200 OK"), 5, "answered")
        for sock in (*slow, idle):
            sock.close()


def test_a_refused_client_that_keeps_sending_neither_holds_the_server_nor_its_connection() -> None:
    limits = HttpLimits(head_bytes=1024, deadline_s=30)
    with running(lambda _: OK, limits) as (server, address), connect(address, timeout=10) as streamer:
        streamer.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 2048)  # refused: 431
        started = time.monotonic()
        cut_off_after: list[float] = []

        def stream() -> None:
            chunk = b"a" * 65536
            with suppress(OSError):  # the server's reset
                while time.monotonic() - started < 5:
                    streamer.send(chunk)
                return
            cut_off_after.append(time.monotonic() - started)

        streaming = threading.Thread(target=stream)
        streaming.start()
        answered = []
        while streaming.is_alive():
            begun = time.monotonic()
            assert request(address).endswith(b"ok\n")
            answered.append(time.monotonic() - begun)
        streaming.join()
        # Closed after its answer and a moment to read it (REFUSAL_LINGER_S), not when the client chose to stop.
        assert cut_off_after and cut_off_after[0] < 3, cut_off_after
        assert max(answered) < 2.0, answered  # a server the streamer held would keep others out for its 5 s
        wait_for(lambda: server.statistics().open == 0, 5, "every connection closed")


def test_an_answer_that_fails_is_a_500_and_the_server_goes_on() -> None:
    def answer(request: Request) -> Response | Blocking:
        if request.path == "/boom":
            return Blocking(lambda: 1 // 0)  # type: ignore[arg-type, return-value]
        return OK

    with running(answer, HttpLimits()) as (_, address):
        assert request(address, "/boom").startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert request(address).endswith(b"ok\n")


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"GET /metrics HTTP/1.1", Request("GET", "/metrics", "", {})),
        (
            b"GET /metrics?name[]=a HTTP/1.0\r\nAccept:  text/plain \r\nACCEPT-Encoding: gzip",
            Request("GET", "/metrics", "name[]=a", {"accept": "text/plain", "accept-encoding": "gzip"}),
        ),
        (b"HEAD /heal%74hz HTTP/1.1\nHost: x", Request("HEAD", "/healthz", "", {"host": "x"})),
    ],
)
def test_request_heads_are_parsed(head: bytes, expected: Request) -> None:
    assert parse_head(head) == expected


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"GET",
        b"GET /metrics",
        b"GET /metrics HTTP/2.0",
        b"GET  /metrics HTTP/1.1",
        b"G3T /metrics HTTP/1.1",
        b"GET /metrics HTTP/1.1\r\nno colon here",
        b"GET /metrics HTTP/1.1\r\n: no name",
        b"GET /metrics HTTP/1.1\r\nHost : x",
        b"GET /metrics HTTP/1.1\r\n folded: line",
    ],
)
def test_malformed_request_heads_are_refused(head: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_head(head)
    assert refused.value.status == HTTPStatus.BAD_REQUEST
