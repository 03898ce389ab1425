"""systemd's notify protocol (sd_notify(3)): one datagram of `KEY=value` lines to `$NOTIFY_SOCKET`.

The protocol is these few lines; a library would add a dependency for nothing. Outside systemd (no
NOTIFY_SOCKET) every call does nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from mpsagent.base.logs import get_logger

log = get_logger(__name__)


def _watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Half the watchdog timeout, as sd_watchdog_enabled(3) advises; None when there is no watchdog for us."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
        pid = int(environ.get("WATCHDOG_PID", str(os.getpid())))
    except ValueError:
        return None
    return usec / 2 / 1e6 if usec > 0 and pid == os.getpid() else None


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        # A leading @ names an abstract socket.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) if address else None
        self.watchdog_interval_s = _watchdog_interval(environ) if address else None
        self._failed = False
        self._status: str | None = None

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, *lines: str) -> None:
        if self._socket is None:
            return
        try:
            self._socket.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:
            if not self._failed:  # systemd gone (or never there): say so once, then stay quiet
                log.warning("systemd notification failed", socket=self._address, reason=str(exc))
            self._failed = True

    def status(self, text: str) -> None:
        """Send `STATUS=` when it differs from the last one."""
        if text != self._status:
            self._status = text
            self.notify(f"STATUS={text}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
