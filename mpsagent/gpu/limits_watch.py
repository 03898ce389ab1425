"""The driver's memory limits on the containers the agent's hook limited: read back every probe interval through
NVML (off the event loop), set again when found changed, forgotten once the container's cgroup is gone (the driver
forgot its limit with it), and each container's limit and use (the driver's own count: no /proc scan) for the status
and the metrics.

The hook (`mpsagent-cdi-hook`) records each container it limited in the records directory (`<container id>.json`);
this watch reads those records and removes a record whose cgroup is gone. The supervisor owns it as one task.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec

from mpsagent.base.cgroups import pod_container
from mpsagent.base.devices import GpuUuid
from mpsagent.base.errors import MemoryLimitError
from mpsagent.base.host import read_regular_file
from mpsagent.base.logs import get_logger
from mpsagent.gpu.port import MemoryLimits

log = get_logger(__name__)

MAX_RECORDS = 4096
"""A node runs a few hundred containers at most; more records than this are not read."""
MAX_RECORD_BYTES = 64 * 1024
CHANGED_EVENT = "container memory limit changed behind the agent; restoring it"


class RecordedLimit(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    uuid: str
    hard_bytes: int


class ContainerRecord(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A container the hook limited, as it records it (`<records>/<container id>.json`): its cgroup v2 directory,
    its limits, when."""

    container_id: str
    pid: int
    cgroup: str
    limits: tuple[RecordedLimit, ...]
    set_at: str


class ContainerLimit(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One container's memory limit on one GPU, as the driver holds it, and what its processes use there."""

    container_id: str
    pod_uid: str | None = None
    """From the container's cgroup path, where the kubelet names it after the pod."""
    gpu: str
    cgroup: str
    limit_bytes: int
    used_bytes: int
    set_at: str


class ContainerLimitsWatch:
    def __init__(self, *, records: Path, driver: MemoryLimits, interval_s: float) -> None:
        self._records = records
        self._driver = driver
        self._interval = interval_s
        self.limits: tuple[ContainerLimit, ...] = ()
        """What the last round found, by container and GPU."""
        self.restored = 0

    async def run(self) -> None:
        """A round every interval, until cancelled."""
        while True:
            self.limits = await anyio.to_thread.run_sync(self.round)
            await anyio.sleep(self._interval)

    def round(self) -> tuple[ContainerLimit, ...]:
        """Read every recorded container's limits back (blocking): restore what changed, forget what is gone."""
        found: list[ContainerLimit] = []
        for path in self._record_files():
            record = self._read(path)
            if record is not None:
                found += self._check(path, record)
        return tuple(found)

    def _record_files(self) -> list[Path]:
        try:
            files = sorted(p for p in self._records.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("container memory limits not read", directory=str(self._records), reason=str(exc))
            return []
        return files[:MAX_RECORDS]

    def _read(self, path: Path) -> ContainerRecord | None:
        try:
            data = read_regular_file(path, max_bytes=MAX_RECORD_BYTES, what="the record", own=True)
            return msgspec.json.decode(data, type=ContainerRecord)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("container memory limit record not read", path=str(path), reason=str(exc))
            return None

    def _check(self, path: Path, record: ContainerRecord) -> list[ContainerLimit]:
        pod = pod_container(record.cgroup)
        found = []
        for limit in record.limits:
            uuid = GpuUuid(limit.uuid)
            try:
                held = self._driver.read(uuid, record.cgroup)
                if held is None:
                    path.unlink(missing_ok=True)
                    log.info("container memory limit released: its cgroup is gone", container=record.container_id)
                    return []
                if held.hard_bytes != limit.hard_bytes:
                    log.warning(
                        CHANGED_EVENT,
                        container=record.container_id,
                        gpu=uuid,
                        found=held.hard_bytes,
                        wanted=limit.hard_bytes,
                    )
                    self._driver.set_hard_limit(uuid, record.cgroup, limit.hard_bytes)
                    self.restored += 1
            except MemoryLimitError as exc:
                log.warning("container memory limit not read back", container=record.container_id, reason=str(exc))
                continue
            found.append(
                ContainerLimit(
                    container_id=record.container_id,
                    pod_uid=None if pod is None else pod.pod_uid,
                    gpu=uuid,
                    cgroup=record.cgroup,
                    limit_bytes=limit.hard_bytes,
                    used_bytes=held.used_bytes,
                    set_at=record.set_at,
                )
            )
        return found
