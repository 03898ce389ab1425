"""GPU health as NVML reports it over time: when a GPU fails, and when it may count as healthy again.

Plain decisions on plain data. A GPU fails on a critical Xid, on NVML reporting it lost, or when NVML cannot be
asked at all; it recovers once it has answered normally and no failure has been seen for the quiet period (the
NVIDIA device plugin never recovers a device).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mpsagent.base.devices import GpuUuid


@dataclass(kw_only=True, slots=True)
class _Failure:
    reason: str
    last_seen: float


class GpuHealthTracker:
    """Times are monotonic seconds."""

    def __init__(self, uuids: Iterable[GpuUuid], recovery_s: float) -> None:
        self._uuids = tuple(uuids)
        self._recovery_s = recovery_s
        self._failures: dict[GpuUuid, _Failure] = {}

    @property
    def uuids(self) -> tuple[GpuUuid, ...]:
        return self._uuids

    def fail(self, uuid: GpuUuid, reason: str, now: float) -> bool:
        """Record a failure; True when the GPU was healthy until now."""
        failure = self._failures.get(uuid)
        if failure is None:
            self._failures[uuid] = _Failure(reason=reason, last_seen=now)
            return True
        failure.reason, failure.last_seen = reason, now
        return False

    def answered(self, uuid: GpuUuid, now: float) -> bool:
        """Record a normal answer; True when this ends the GPU's quiet period and it is healthy again."""
        failure = self._failures.get(uuid)
        if failure is None or now - failure.last_seen < self._recovery_s:
            return False
        del self._failures[uuid]
        return True

    def reason(self, uuid: GpuUuid) -> str | None:
        failure = self._failures.get(uuid)
        return failure.reason if failure else None

    def unhealthy(self) -> dict[GpuUuid, str]:
        return {uuid: failure.reason for uuid, failure in self._failures.items()}
