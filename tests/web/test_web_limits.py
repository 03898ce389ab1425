"""The HTTP endpoint against clients that do not behave, through a real TCP socket to a real agent: connections
beyond the cap, idle connections, request heads dribbled a byte at a time, oversized and malformed heads."""

from __future__ import annotations

import gzip
import time
import urllib.request
from pathlib import Path

from mpsagent.web import HTTP_LIMITS
from mpsagent_testing.agents import AgentLauncher, serve
from mpsagent_testing.http_clients import SLOW_HEAD, closed_by_peer, connect, dribble
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.metrics import get, value
from mpsagent_testing.node import RESOURCE
from mpsagent_testing.processes import open_fds, threads


def address_of(base: str) -> tuple[str, int]:
    host, _, port = base.removeprefix("http://").rpartition(":")
    return host, int(port)


def exchange(address: tuple[str, int], data: bytes) -> bytes:
    """Send `data`, then read until the server closes."""
    with connect(address, timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_connections_beyond_the_cap_neither_grow_the_agent_nor_keep_a_scrape_out(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    # No read-back round within the test: each round's front-end is a child process with pipes and, on Python
    # 3.11, a thread that waits for it; one in flight at a count would be taken for the connections' growth.
    agent, base = serve(agents, kubelet, short_dir, "--probe-interval-seconds", "60")
    kubelet.wait_registered(RESOURCE)
    pid, address = agent.process.pid, address_of(base)
    assert get(base + "/metrics")[0] == 200  # its worker thread exists from here on
    fds, threads_before = open_fds(pid), threads(pid)
    cap = HTTP_LIMITS.connections
    idlers = [connect(address) for _ in range(4 * cap)]
    try:
        # Each connection beyond the cap closes the one that has waited longest for its request.
        wait_for(lambda: sum(map(closed_by_peer, idlers)) >= len(idlers) - cap, 5, "all but the cap closed")
        assert open_fds(pid) <= fds + cap + 2, (open_fds(pid), fds)
        assert threads(pid) <= threads_before
        # A scrape while idlers hold every slot: it takes the oldest idler's slot and is answered.
        status, text = get(base + "/metrics")
        assert status == 200 and "mpsagent_daemon_up" in text
        assert get(base + "/healthz")[0] == 200
        # A scrape renders what the last publish (every 0.5 s) allows, and the first one above is that publish's
        # render: a count read back at once can be the one from before the idlers.
        wait_for(
            lambda: (value(base, "mpsagent_http_connections_closed_total", reason="cap") or 0) >= 3 * cap,
            5,
            "the connections closed for the cap counted",
        )
        assert open_fds(pid) <= fds + cap + 2
    finally:
        for sock in idlers:
            sock.close()
    assert agent.stop() == 0


def test_an_idle_client_and_a_slow_header_client_are_cut_off_after_the_request_timeout(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, base = serve(agents, kubelet, short_dir)
    address = address_of(base)
    idle, slow = connect(address), connect(address)
    slow.sendall(SLOW_HEAD)
    started = time.monotonic()
    closed_after: dict[str, float] = {}
    byte = dribble()
    try:
        while len(closed_after) < 2 and time.monotonic() - started < HTTP_LIMITS.request_timeout_s + 5:
            try:
                slow.send(bytes([next(byte)]))  # a byte every 0.2 s: each read gets something, the head never ends
            except OSError:
                closed_after.setdefault("slow", time.monotonic() - started)
            for name, sock in (("idle", idle), ("slow", slow)):
                if name not in closed_after and closed_by_peer(sock):
                    closed_after[name] = time.monotonic() - started
            assert get(base + "/healthz")[0] == 200  # well-behaved clients are answered meanwhile
            time.sleep(0.2)
    finally:
        idle.close()
        slow.close()
    assert closed_after.keys() == {"idle", "slow"}, closed_after
    for name, seconds in closed_after.items():
        assert HTTP_LIMITS.request_timeout_s - 0.5 <= seconds <= HTTP_LIMITS.request_timeout_s + 2, (name, seconds)
    assert value(base, "mpsagent_http_connections_closed_total", reason="request_timeout") == 2
    assert agent.stop() == 0


def test_oversized_and_malformed_request_heads_are_refused(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, base = serve(agents, kubelet, short_dir)
    address = address_of(base)
    huge = b"GET /metrics HTTP/1.1\r\n" + b"X-Big: " + b"a" * HTTP_LIMITS.head_bytes + b"\r\n\r\n"
    answer = exchange(address, huge)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    assert b"larger than 8192 bytes" in answer
    for malformed in (b"GARBAGE\r\n\r\n", b"GET /healthz SPDY/3\r\n\r\n", b"GET /healthz HTTP/1.1\r\nno colon\r\n\r\n"):
        answer = exchange(address, malformed)
        assert answer.startswith(b"HTTP/1.1 400 "), (malformed, answer[:80])
    assert get(base + "/healthz")[0] == 200
    assert agent.stop() == 0


def test_well_behaved_clients_get_what_they_got_before(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    """What Prometheus and the kubelet's probes rely on: content negotiation, gzip, one answer per connection."""
    agent, base = serve(agents, kubelet, short_dir)
    kubelet.wait_registered(RESOURCE)
    request = urllib.request.Request(
        base + "/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert response.headers["Content-Encoding"] == "gzip"
        text = gzip.decompress(response.read()).decode()
    assert "mpsagent_daemon_up" in text and text.endswith("# EOF\n")
    wait_for(lambda: get(base + "/readyz")[0] == 200, 5, "ready")
    answer = exchange(address_of(base), b"GET /readyz HTTP/1.0\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] in {b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK"}
    assert body == b"ready\n"
    # An HTTP/1.1 client that would keep the connection gets its answer, then the server closes.
    answer = exchange(address_of(base), b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
    assert answer.startswith(b"HTTP/1.") and answer.endswith(b"s ago\n"), answer
    assert agent.stop() == 0
