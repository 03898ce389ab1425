"""The advertised replicas of one resource, their health, and a generation counter ListAndWatch waits on.

Health has several independent sources (the MPS daemon for the whole resource, NVML per GPU), each with its reason;
a replica is Healthy only while no source holds it unhealthy, and while the node's accounting does not withhold it
(a free replica whose share no longer fits beside the claims on its GPU: `accounting.withheld_replicas`). Every
change bumps the generation, so a watcher that compares generations never misses a wake-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpsagent.base.changes import Changes
from mpsagent.base.devices import GpuUuid, Health, ReplicaId, gpu_of
from mpsagent.domain.accounting import Withheld
from mpsagent.domain.plan import ResourcePlan


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvertisedDevice:
    replica_id: ReplicaId
    health: Health
    numa_node: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class InventorySnapshot:
    generation: int
    devices: tuple[AdvertisedDevice, ...]


class Inventory:
    """Must be used from the event loop's thread (threads hand changes over with anyio.from_thread)."""

    def __init__(self, resource: ResourcePlan, *, daemon_ready: bool = False) -> None:
        self._resource = resource
        self._gpu_problems: dict[GpuUuid, dict[str, str]] = {gpu.uuid: {} for gpu in resource.gpus}
        self._resource_problems: dict[str, str] = {} if daemon_ready else {"mps daemon": "its MPS daemon is not up"}
        self._withheld: dict[GpuUuid, Withheld] = {}
        self._changes = Changes()
        self._snapshot: InventorySnapshot | None = None
        """The last snapshot taken, reused while the generation is its own (every change bumps it)."""

    @property
    def generation(self) -> int:
        return self._changes.count

    def has_gpu(self, uuid: GpuUuid) -> bool:
        return uuid in self._gpu_problems

    def gpu_health(self, uuid: GpuUuid) -> Health:
        return Health.UNHEALTHY if self._gpu_problems[uuid] or self._resource_problems else Health.HEALTHY

    def problem(self, uuid: GpuUuid) -> str | None:
        """Why the GPU is unhealthy now, in words (None: healthy): a new grant or claim on it is refused."""
        reasons = [*self._gpu_problems[uuid].values(), *self._resource_problems.values()]
        return "; ".join(reasons) if reasons else None

    def withheld(self) -> tuple[Withheld, ...]:
        """The GPUs whose free replicas are withheld now, how many and why."""
        return tuple(self._withheld.values())

    def snapshot(self) -> InventorySnapshot:
        if self._snapshot is None or self._snapshot.generation != self._changes.count:
            self._snapshot = self._take_snapshot()
        return self._snapshot

    def _take_snapshot(self) -> InventorySnapshot:
        health = {gpu.uuid: self.gpu_health(gpu.uuid) for gpu in self._resource.gpus}
        numa = {gpu.uuid: gpu.numa_node for gpu in self._resource.gpus}
        withheld = set(self._withheld_ids())
        devices = tuple(
            AdvertisedDevice(
                replica_id=replica,
                health=Health.UNHEALTHY if replica in withheld else health[gpu],
                numa_node=numa[gpu],
            )
            for replica, gpu in ((r, gpu_of(r)) for r in self._resource.device_ids)
        )
        return InventorySnapshot(generation=self._changes.count, devices=devices)

    def _withheld_ids(self) -> list[ReplicaId]:
        """The IDs withheld: each GPU's last free IDs (so that the lowest stay offered, as they were)."""
        return [replica for held in self._withheld.values() for replica in held.replica_ids]

    def set_resource_problem(self, source: str, present: bool, reason: str = "") -> bool:
        """Mark (or clear) a problem that makes every replica of the resource Unhealthy; True when it changed."""
        return self._update(self._resource_problems, source, present, reason or source)

    def set_gpu_problem(self, uuid: GpuUuid, source: str, present: bool, reason: str = "") -> bool:
        """Mark (or clear) a problem that makes every replica of one GPU Unhealthy; True when it changed."""
        return self._update(self._gpu_problems[uuid], source, present, reason or source)

    def set_withheld(self, withheld: Sequence[Withheld]) -> bool:
        """The free replicas the node's accounting withholds now (replacing the earlier set); True when it changed."""
        new = {held.uuid: held for held in withheld}
        if new == self._withheld:
            return False
        self._withheld = new
        self._bump()
        return True

    def _update(self, problems: dict[str, str], source: str, present: bool, reason: str) -> bool:
        if (problems.get(source) == reason) if present else (source not in problems):
            return False
        if present:
            problems[source] = reason
        else:
            del problems[source]
        self._bump()
        return True

    def _bump(self) -> None:
        self._changes.changed()

    async def wait_changed(self, since: int) -> int:
        """Wait until the generation differs from `since`; returns the new generation."""
        return await self._changes.wait(since)
