"""The status document's types: what status.json holds, `--status` prints, and `/metrics` and `/readyz` read.

Built by `status` from the agent's live state, published by `publisher`; camelCase on the wire. A field that an
older agent did not write has a default, so that `--status` reads that agent's file; a field without one is one
every agent wrote. Where a new field goes: into the Struct here (with a default), filled in
`status.status_document`, rendered in `status.render_status_text`, pinned in tests/golden/status.json.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple, cast

import msgspec

CapMode = Literal["full", "capped"]

# Bounds on what `--status` reads back (the file may have been edited, or be another program's): a value outside
# them is a one-line error naming the file and the field, not a traceback, a huge number or a negative count. A PID
# that names no process the agent can have (-1, 1, above pid_max) reads, and is shown as not running.
Pid = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class GpuBound(NamedTuple):
    """A GPU's ceilings and escape bound, as the status document holds them (see docs/cap-model.md)."""

    ordinal: int
    live_grants: int
    memory_ceiling_mib: int
    memory_mib: int
    thread_ceiling: int
    memory_escape_mib: int
    thread_escape: int


class GpuStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """One GPU of a resource; the ceilings and escape bound are absent in an older agent's file."""

    replicas: Count
    healthy: Count
    ordinal: Count | None = None
    live_grants: Count | None = None
    memory_ceiling_mib: Count | None = msgspec.field(default=None, name="memoryCeilingMiB")
    memory_mib: Count | None = msgspec.field(default=None, name="memoryMiB")
    thread_ceiling: Count | None = None
    memory_escape_mib: Count | None = msgspec.field(default=None, name="memoryEscapeMiB")
    thread_escape: Count | None = None

    def bound(self) -> GpuBound | None:
        """The ceilings and escape bound, when the file holds them all."""
        values = (
            self.ordinal,
            self.live_grants,
            self.memory_ceiling_mib,
            self.memory_mib,
            self.thread_ceiling,
            self.memory_escape_mib,
            self.thread_escape,
        )
        return None if None in values else GpuBound(*cast("tuple[int, ...]", values))


class CeilingsStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    thread_percentage: Count
    memory_mib: tuple[Count, ...] = msgspec.field(name="memoryMiB")


class CapTamperEvent(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    at: str
    found: str


class FrontEndFailure(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    at: str
    reason: str


class RecordDamage(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What is wrong with the daemon's record (`daemon.json`), since when: the daemon cannot be adopted from it."""

    at: str
    path: str
    problem: str


class DaemonBusy(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Another control session keeps the daemon busy, since when: it lives (nothing is killed), and a cap switch
    waits for it, boundedly, then fails."""

    at: str
    reason: str


class DaemonStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pid: Pid | None = None
    up: bool
    cap_mode: CapMode | None = None
    ceilings: CeilingsStatus | None = None
    """What the daemon is known to hold; None while they are being set, or after a change failed."""
    restarts: Count = 0
    restart_attempts: Count = 0
    multi_user: bool | None = None
    """None: not known (a daemon adopted from an older agent)."""
    cap_tamper: Count = 0
    last_cap_tamper: CapTamperEvent | None = None
    front_end_failure: FrontEndFailure | None = None
    record_damage: RecordDamage | None = None
    busy: DaemonBusy | None = None
    busy_episodes: Count = 0


class LedgerStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    allocated: dict[str, Count] = {}
    """Grants made by Allocate, by kind (full, capped)."""
    adopted: Count = 0
    superseded: Count = 0
    released: Count = 0
    live: dict[str, Count] = {}


class GrantStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    grant_id: Count = msgspec.field(name="id")
    kind: str
    share: str | None = None
    container: str | None = None
    adopted: bool = False
    granted_at: str
    unlisted_since: str | None = None
    device_ids: tuple[str, ...]


class ResourceStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    name: str
    registered: bool = False
    registrations: Count = 0
    registration_failures: Count = 0
    replicas: Count = 0
    healthy: Count = 0
    gpus: dict[str, GpuStatus] = {}
    daemon: DaemonStatus
    ledger: LedgerStatus = LedgerStatus()
    grants: tuple[GrantStatus, ...] = ()


class PodResourcesStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    socket: str | None = None
    available: bool
    answers: Count = 0
    failures: Count = 0


class StatusDocument(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What status.json holds, `--status` prints, and metrics and `/readyz` read."""

    version: str
    pid: Pid | None = None
    tasks: Count = 0
    pod_resources: PodResourcesStatus
    unhealthy_gpus: dict[str, str] = {}
    resources: tuple[ResourceStatus, ...]
    written_at: str | None = None
    """Set by write_status."""
