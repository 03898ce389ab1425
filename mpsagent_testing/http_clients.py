"""HTTP clients that do not behave, for the tests of the agent's HTTP endpoint: idle connections, clients that
dribble their request head a byte at a time, and a flood that keeps thousands of both open (run as its own process:
`python -m mpsagent_testing.http_clients HOST PORT IDLE SLOW`), re-opening every one the server closes."""

from __future__ import annotations

import itertools
import json
import select
import signal
import socket
import struct
import sys
import time
from contextlib import suppress
from dataclasses import asdict, dataclass

SLOW_HEAD = b"GET /metrics HTTP/1.1\r\nHost: mpsagent\r\n"
"""What a slow client sends at once; then header bytes, one at a time, never the blank line that ends the head."""
SLOW_DRIBBLE = b"X-Slow: a header that never ends"
FLOOD_TICK_S = 1.0
CONNECT_TIMEOUT_S = 0.5
"""How often the flood re-opens what the server closed and sends each slow client its next byte."""


def connect(address: tuple[str, int], timeout: float = 3.0) -> socket.socket:
    return socket.create_connection(address, timeout=timeout)


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed this connection (without answering: an answer counts as not closed)."""
    if sock.fileno() < 0:
        return True
    readable = select.poll()
    readable.register(sock, select.POLLIN)
    if not readable.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True  # reset


def dribble() -> itertools.cycle[int]:
    return itertools.cycle(SLOW_DRIBBLE)


@dataclass
class FloodStatistics:
    connections: int = 0
    """Connections established, all told."""
    closed_by_server: int = 0
    failed_connects: int = 0
    most_held: int = 0
    """The most connections the flood held open at once."""


class Flood:
    """Keeps `idle` connections that send nothing and `slow` ones that send a byte of their head every tick,
    re-opening each one the server closes at the next tick."""

    def __init__(self, address: tuple[str, int], idle: int, slow: int) -> None:
        self._address = address
        self._targets = {"idle": idle, "slow": slow}
        self._open: dict[socket.socket, str] = {}
        self._bytes = dribble()
        self.statistics = FloodStatistics()

    def _connect_missing(self) -> None:
        """One connection after the other, each established before the next, as the server's kernel takes them."""
        for kind, target in self._targets.items():
            for _ in range(target - sum(1 for k in self._open.values() if k == kind)):
                try:
                    sock = connect(self._address, timeout=CONNECT_TIMEOUT_S)
                except OSError:
                    self.statistics.failed_connects += 1  # the server's backlog is full: again at the next tick
                    continue
                # Closed with a reset, not a FIN: a FIN that the server's kernel does not take at once is sent
                # again for half a minute, and its connection may reach the server after the flood has stopped.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.setblocking(False)
                if kind == "slow":
                    with suppress(OSError):
                        sock.send(SLOW_HEAD)
                self._open[sock] = kind
                self.statistics.connections += 1
        self.statistics.most_held = max(self.statistics.most_held, len(self._open))

    def _forget_closed(self) -> None:
        for sock in [s for s in self._open if closed_by_peer(s)]:
            del self._open[sock]
            sock.close()
            self.statistics.closed_by_server += 1

    def _dribble(self) -> None:
        byte = bytes([next(self._bytes)])
        for sock, kind in self._open.items():
            if kind == "slow":
                with suppress(OSError):  # closed by the server: the next round notices and re-opens it
                    sock.send(byte)

    def run(self, stop_after_s: float) -> FloodStatistics:
        until = time.monotonic() + stop_after_s
        try:
            while time.monotonic() < until:
                self._forget_closed()
                self._connect_missing()
                self._dribble()
                time.sleep(FLOOD_TICK_S)
        finally:
            for sock in self._open:
                sock.close()
        return self.statistics


def main() -> None:
    host, port, idle, slow = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    flood = Flood((host, port), idle, slow)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        flood.run(stop_after_s=600)
    finally:
        print(json.dumps(asdict(flood.statistics)), flush=True)


if __name__ == "__main__":
    main()
