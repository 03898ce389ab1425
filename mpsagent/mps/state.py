"""The daemon state file `<mps-root>/<resource>/daemon.json`: what the agent needs to recognise its daemon after
a restart (PID, the GPUs it serves, the cap mode it holds, whether it runs one server for every user, the compute
modes to restore). Written atomically."""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec

from mpsagent.host import write_atomically
from mpsagent.mps.paths import PRIVATE_FILE_MODE

STATE_FILE = "daemon.json"


class DaemonState(msgspec.Struct, rename="camel", kw_only=True):
    pid: int
    visible_devices: str
    mode: str
    multi_user: bool | None = None
    """Whether it was started with `-M`; None: recorded by an agent that did not know."""
    original_compute_modes: dict[str, int] = msgspec.field(default_factory=dict)


def read_state(directory: Path) -> DaemonState | None:
    try:
        return msgspec.json.decode((directory / STATE_FILE).read_bytes(), type=DaemonState)
    except (OSError, msgspec.DecodeError):
        return None


def write_state(directory: Path, state: DaemonState) -> None:
    write_atomically(directory / STATE_FILE, msgspec.json.encode(state), PRIVATE_FILE_MODE, durable=True)


def remove_state(directory: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / STATE_FILE).unlink()
