"""The daemon state file `<mps-root>/<resource>/daemon.json`: what the agent needs to recognise its daemon after
a restart (PID, the GPUs it serves, the ceilings it holds, whether it runs one server for every user, the compute
modes to restore).

Written atomically. A write that fails (a full or read-only file system) never fails what the daemon was doing:
it is logged once, kept, and written again by the next write or by `retry()`, which the file's owner (the daemon
supervisor, or the daemon host's keeper) calls every liveness round.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from mpsagent.host import os_reason, write_atomically
from mpsagent.logs import get_logger
from mpsagent.mps.paths import PRIVATE_FILE_MODE
from mpsagent.shares import Ceilings, ShareModel

log = get_logger(__name__)

STATE_FILE = "daemon.json"


class RecordedCeilings(msgspec.Struct, rename="camel", kw_only=True):
    thread_percentage: int
    memory_mib: list[int]


class DaemonState(msgspec.Struct, rename="camel", kw_only=True):
    pid: int
    visible_devices: str
    mode: str
    """`capped` when the ceilings are below the full hardware, else `full`: what agents before ceilings read."""
    ceilings: RecordedCeilings | None = None
    """The ceilings it holds; None: recorded by an agent before ceilings (its `mode` says what it held)."""
    multi_user: bool | None = None
    """Whether it was started with `-M`; None: recorded by an agent that did not know."""
    original_compute_modes: dict[str, int] = msgspec.field(default_factory=dict)


def daemon_state(
    *,
    pid: int,
    visible_devices: str,
    ceilings: Ceilings,
    shares: ShareModel,
    multi_user: bool | None,
    original_compute_modes: dict[str, int],
) -> DaemonState:
    return DaemonState(
        pid=pid,
        visible_devices=visible_devices,
        mode="full" if ceilings == shares.full_hardware() else "capped",
        ceilings=RecordedCeilings(thread_percentage=ceilings.thread_percentage, memory_mib=list(ceilings.memory_mib)),
        multi_user=multi_user,
        original_compute_modes=original_compute_modes,
    )


def recorded_ceilings(state: DaemonState, shares: ShareModel) -> Ceilings | None:
    """The ceilings a recorded daemon holds; from an older agent's `mode`: `full` is the full hardware, `capped`
    the smallest share (the only capped value it knew). None when the record fits no ceilings of this resource."""
    recorded = state.ceilings
    if recorded is not None:
        if len(recorded.memory_mib) != len(shares.gpus):
            return None
        return Ceilings(thread_percentage=recorded.thread_percentage, memory_mib=tuple(recorded.memory_mib))
    if state.mode == "full":
        return shares.full_hardware()
    if state.mode == "capped":
        return shares.smallest_caps()
    return None


class StateFile:
    """One resource's `daemon.json`, owned by whoever drives that resource's daemon."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / STATE_FILE
        self._unwritten: DaemonState | None = None

    def read(self) -> DaemonState | None:
        """The recorded state; None when there is none, or it cannot be read (a new daemon is then started)."""
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=DaemonState)
        except (OSError, msgspec.DecodeError):
            return None

    def write(self, state: DaemonState) -> bool:
        """True when written; a failure is logged when it begins and when it ends, never raised."""
        try:
            write_atomically(
                self.path, msgspec.json.encode(state), PRIVATE_FILE_MODE, what="the daemon state file", durable=True
            )
        except OSError as exc:
            if self._unwritten is None:
                log.error(  # noqa: TRY400 (no traceback for a known failure)
                    "daemon state not written",
                    path=str(self.path),
                    reason=os_reason(exc),
                    hint="the daemon keeps running with its caps; the write is retried every liveness round",
                )
            self._unwritten = state
            return False
        if self._unwritten is not None:
            self._unwritten = None
            log.info("daemon state written again", path=str(self.path))
        return True

    def retry(self) -> None:
        """Write the latest state again if its write failed."""
        if self._unwritten is not None:
            self.write(self._unwritten)

    def remove(self) -> None:
        """Logs a failure, never raises (called while stopping)."""
        self._unwritten = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("daemon state not removed", path=str(self.path), reason=os_reason(exc))
