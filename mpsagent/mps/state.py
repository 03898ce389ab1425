"""The daemon state file `<mps-root>/<resource>/daemon.json`: what the agent needs to recognise its daemon after
a restart (PID, the GPUs it serves, the cap mode it holds, the compute modes to restore).

Written atomically. A write that fails (a full or read-only file system) never fails what the daemon was doing:
it is logged once, and the latest state is written again on the next change or when the publisher retries.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from mpsagent.host import os_reason, write_atomically
from mpsagent.logs import get_logger
from mpsagent.mps.paths import PRIVATE_FILE_MODE

log = get_logger(__name__)

STATE_FILE = "daemon.json"


class DaemonState(msgspec.Struct, rename="camel", kw_only=True):
    pid: int
    visible_devices: str
    mode: str
    original_compute_modes: dict[str, int] = msgspec.field(default_factory=dict)


# The latest state of each resource directory whose write failed, kept until a write succeeds (the daemon
# supervisors write, the publisher retries; all on the agent's one event loop).
_unwritten: dict[Path, DaemonState] = {}


def read_state(directory: Path) -> DaemonState | None:
    try:
        return msgspec.json.decode((directory / STATE_FILE).read_bytes(), type=DaemonState)
    except (OSError, msgspec.DecodeError):
        return None


def write_state(directory: Path, state: DaemonState) -> bool:
    """True when written; a failure is logged when it begins and when it ends, never raised."""
    path = directory / STATE_FILE
    try:
        write_atomically(
            path, msgspec.json.encode(state), PRIVATE_FILE_MODE, what="the daemon state file", durable=True
        )
    except OSError as exc:
        if directory not in _unwritten:
            log.error(  # noqa: TRY400 (no traceback for a known failure)
                "daemon state not written",
                path=str(path),
                reason=os_reason(exc),
                hint="the daemon keeps running with its caps; the agent retries until the write succeeds",
            )
        _unwritten[directory] = state
        return False
    if _unwritten.pop(directory, None) is not None:
        log.info("daemon state written again", path=str(path))
    return True


def retry_unwritten_states() -> None:
    for directory, state in list(_unwritten.items()):
        write_state(directory, state)


def remove_state(directory: Path) -> None:
    """Logs a failure, never raises (called while the agent stops)."""
    _unwritten.pop(directory, None)
    try:
        (directory / STATE_FILE).unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("daemon state not removed", path=str(directory / STATE_FILE), reason=os_reason(exc))
