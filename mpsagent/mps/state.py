"""The daemon state file `<mps-root>/<resource>/daemon.json`: what the agent needs to recognise its daemon after
a restart (PID, the GPUs it serves, the ceilings it holds, whether it runs one server for every user, the compute
modes to restore).

Written atomically. A write that fails (a full or read-only file system) never fails what the daemon was doing:
it is logged once, kept, and written again by the next write or by `retry()`, which the file's owner (the daemon
supervisor, or the daemon host's keeper) calls every liveness round. A record that does not read (cut short, edited
by hand, a value out of range, not a regular file) is damage: said once per episode (`damage` keeps it for
`--status`), and `retry()` rewrites it from the latest good record while the daemon it names lives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import FileRefusedError
from mpsagent.base.host import (
    PID_MAX_LIMIT,
    os_reason,
    pid_alive,
    read_regular_file,
    write_atomically,
)
from mpsagent.base.logs import get_logger
from mpsagent.domain.shares import Ceilings, ShareModel
from mpsagent.mps.daemon_status import ceiling_mode
from mpsagent.mps.paths import PRIVATE_FILE_MODE

log = get_logger(__name__)

STATE_FILE = "daemon.json"
MAX_STATE_BYTES = 64 * 1024
"""Far above any real record (a few hundred bytes for eight GPUs), far below what hurts to read."""
DAMAGE_HINT = (
    "the daemon host (or the agent that owns the daemon) rewrites it from the daemon it finds; "
    "see docs/troubleshooting.md (a damaged daemon.json)"
)

Pid = Annotated[int, msgspec.Meta(ge=2, le=PID_MAX_LIMIT)]
Percentage = Annotated[int, msgspec.Meta(ge=1, le=100)]
MiB = Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]
ComputeModeValue = Annotated[int, msgspec.Meta(ge=0, le=3)]
"""nvmlComputeMode_t: DEFAULT, EXCLUSIVE_THREAD, PROHIBITED, EXCLUSIVE_PROCESS."""


class RecordedCeilings(msgspec.Struct, rename="camel", kw_only=True):
    thread_percentage: Percentage
    memory_mib: Annotated[list[MiB], msgspec.Meta(max_length=1024)]


class DaemonState(msgspec.Struct, rename="camel", kw_only=True):
    pid: Pid
    visible_devices: Annotated[str, msgspec.Meta(max_length=4096)]
    mode: str
    """The ceiling mode (`daemon_status.ceiling_mode`): what agents before ceilings read."""
    ceilings: RecordedCeilings | None = None
    """The ceilings it holds; None: recorded by an agent before ceilings (its `mode` says what it held)."""
    multi_user: bool | None = None
    """Whether it was started with `-M`; None: recorded by an agent that did not know."""
    original_compute_modes: Annotated[dict[str, ComputeModeValue], msgspec.Meta(max_length=1024)] = msgspec.field(
        default_factory=dict
    )


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
        mode=ceiling_mode(ceilings, shares.full_hardware()),
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
        self._known: DaemonState | None = None
        """The latest good record, written or read here: what a damaged or removed file is rewritten from."""
        self._damaged_episodes = FailureEpisodes(
            log,
            failed="daemon state damaged",
            level="warning",
            again="daemon state readable again",
            hint=DAMAGE_HINT,
            reason_key="problem",
        )
        self._unwritten_episodes = FailureEpisodes(
            log,
            failed="daemon state not written",
            again="daemon state written again",
            hint="the daemon keeps running with its caps; the write is retried every liveness round",
        )

    @property
    def damage(self) -> tuple[float, str] | None:
        """Since when (wall clock) and what is wrong with the file; None while it reads, or there is none."""
        return self._damaged_episodes.current

    def read(self) -> DaemonState | None:
        """The recorded state; None when there is none, or it is damaged (said once per episode, kept in
        `damage`)."""
        try:
            data = read_regular_file(
                self.path, max_bytes=MAX_STATE_BYTES, what="the daemon state file", follow_symlinks=False
            )
            state = msgspec.json.decode(data, type=DaemonState)
        except FileNotFoundError:
            self._readable()
            return None
        except FileRefusedError as exc:
            self._damaged(exc.problem)
            return None
        except OSError as exc:
            self._damaged(f"cannot be read ({os_reason(exc)})")
            return None
        except msgspec.DecodeError as exc:
            self._damaged(f"does not decode: {exc}")
            return None
        self._readable()
        self._known = state
        return state

    def _damaged(self, problem: str) -> None:
        self._damaged_episodes.failed(problem, path=str(self.path))

    def _readable(self) -> None:
        self._damaged_episodes.works(path=str(self.path))

    def write(self, state: DaemonState) -> bool:
        """True when written; a failure is logged when it begins and when it ends, never raised.

        Atomic, not durable (no fsync): the record describes a running daemon, and no power cut leaves that daemon
        running, so a record lost with one describes nothing anyway; a crash of the agent loses nothing the kernel
        holds. (An fsync here cost a DRA prepare 1 to 3 ms on a disk, in the event loop.)"""
        try:
            write_atomically(self.path, msgspec.json.encode(state), PRIVATE_FILE_MODE, what="the daemon state file")
        except OSError as exc:
            self._unwritten_episodes.failed(os_reason(exc), path=str(self.path))
            self._unwritten = state
            return False
        self._known = state
        self._damaged_episodes.forget()
        self._unwritten = None
        self._unwritten_episodes.works(path=str(self.path))
        return True

    def retry(self) -> None:
        """Write the latest state again if its write failed; rewrite the latest good record when the file is
        damaged or gone while the daemon it names lives (a daemon quit, or one that died, is not recorded again)."""
        if self._unwritten is not None:
            self.write(self._unwritten)
            return
        known = self._known
        if self.read() is not None or known is None or not pid_alive(known.pid):
            return
        if self.write(known):
            log.info("daemon state rewritten", path=str(self.path), pid=known.pid)

    def remove(self) -> None:
        """Logs a failure, never raises (called while stopping)."""
        self._unwritten = None
        self._known = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("daemon state not removed", path=str(self.path), reason=os_reason(exc))
