"""The daemon state file `<mps-root>/<resource>/daemon.json`: what the agent needs to recognise its daemon after
a restart (PID, the GPUs it serves, the cap mode it holds, the compute modes to restore). Written atomically."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

from mpsagent.mps.paths import PRIVATE_FILE_MODE

STATE_FILE = "daemon.json"


class DaemonState(msgspec.Struct, rename="camel", kw_only=True):
    pid: int
    visible_devices: str
    mode: str
    original_compute_modes: dict[str, int] = msgspec.field(default_factory=dict)


def read_state(directory: Path) -> DaemonState | None:
    try:
        return msgspec.json.decode((directory / STATE_FILE).read_bytes(), type=DaemonState)
    except (OSError, msgspec.DecodeError):
        return None


def write_state(directory: Path, state: DaemonState) -> None:
    target = directory / STATE_FILE
    temporary = directory / f".{STATE_FILE}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "wb") as file:
        file.write(msgspec.json.encode(state))
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, target)


def remove_state(directory: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / STATE_FILE).unlink()
