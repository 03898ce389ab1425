"""Forwarding the MPS control daemon's `control.log` into the agent's log, each line at a level that fits it:
the agent's own round trips at debug, failures as warnings."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import anyio
from structlog.typing import FilteringBoundLogger

LOG_POLL_S = 0.5
MAX_READ_BYTES = 1 << 20
"""At most this much of the log per poll: a daemon that writes faster is followed, not read whole at once."""
MAX_LINE_BYTES = 4096


async def forward_daemon_log(path: Path, log: FilteringBoundLogger) -> None:
    """Forward lines appended to `path` from now on, until cancelled. A log that cannot be read (replaced by
    something else, unreadable) is reported once and tried again; it never ends its owner."""
    position = _file_size(path)
    pending = b""
    failing = False
    while True:
        await anyio.sleep(LOG_POLL_S)
        try:
            position, chunk = _read_from(path, position)
        except OSError as exc:
            if not failing:
                log.warning("mps daemon log not forwarded", path=str(path), reason=exc.strerror or str(exc))
            failing = True
            continue
        failing = False
        *lines, pending = (pending + chunk).split(b"\n")
        pending = pending[-MAX_LINE_BYTES:]
        for line in lines:
            text = line.decode(errors="replace").strip()
            if text:
                log.log(daemon_log_level(text), "mps daemon log", line=text[:MAX_LINE_BYTES])


# The agent's own commands (a round trip every few seconds) make most of the daemon's log: debug level for them,
# and for the liveness check's connection, which closes once the daemon greets it (mps.liveness).
_CONTROL_CHATTER = re.compile(
    r"\] (Accepting connection\.\.\.|NEW UI|UI closed|Cmd:(get|set)_\S*.*|[\d.]+[MG]?|(\d+=\d+[MG],?)+"
    r"|User did not send valid credentials)$"
)


def daemon_log_level(line: str) -> int:
    if _CONTROL_CHATTER.search(line):
        return logging.DEBUG
    if re.search(r"error|fail", line, re.IGNORECASE):
        return logging.WARNING
    return logging.INFO


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_from(path: Path, position: int) -> tuple[int, bytes]:
    """What was appended since `position` (from the start again when the file was truncated or rotated)."""
    size = _file_size(path)
    if size < position:
        position = 0
    if size == position:
        return position, b""
    with path.open("rb") as file:
        file.seek(position)
        chunk = file.read(min(size - position, MAX_READ_BYTES))
        return position + len(chunk), chunk
