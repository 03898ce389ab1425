"""The compute modes of one resource's GPUs while its MPS daemon serves them: EXCLUSIVE_PROCESS (set through NVML
before the daemon starts), each GPU's mode from before remembered (and recorded in `daemon.json`, so that an agent
that adopts the daemon still knows it) and restored when the daemon is quit. The daemon supervisor owns one."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import anyio
from structlog.typing import FilteringBoundLogger

from mpsagent.base.devices import GpuUuid
from mpsagent.base.errors import GpuDiscoveryError
from mpsagent.gpu.port import ComputeMode, GpuSource


class ComputeModes:
    def __init__(self, gpus: GpuSource, uuids: Sequence[GpuUuid], log: FilteringBoundLogger) -> None:
        self._gpus = gpus
        self._uuids = uuids
        self._log = log
        self._original: dict[str, int] = {}

    @property
    def original(self) -> dict[str, int]:
        """Each GPU's compute mode from before the agent set it (by UUID), for the daemon's record."""
        return self._original

    def adopt(self, recorded: Mapping[str, int] | None) -> None:
        """The modes an adopted daemon's record names (kept from before its start), where it names any."""
        if recorded:
            self._original = dict(recorded)

    async def take(self, read_recorded: Callable[[], Mapping[str, int] | None]) -> None:
        """Set every GPU to EXCLUSIVE_PROCESS, remembering its mode from before: the one the daemon's record names
        (`read_recorded`, read only when the modes are managed: an earlier agent set the current one), else the
        current one."""
        if not self._gpus.manages_compute_mode:
            self._log.info("compute mode not managed", reason="GPUs come from a node snapshot")
            return
        recorded = read_recorded()
        for uuid in self._uuids:
            current = await anyio.to_thread.run_sync(self._gpus.compute_mode, uuid)
            earlier = recorded.get(uuid) if recorded else None
            self._original[uuid] = earlier if earlier is not None else int(current)
            if current is not ComputeMode.EXCLUSIVE_PROCESS:
                await anyio.to_thread.run_sync(self._gpus.set_compute_mode, uuid, ComputeMode.EXCLUSIVE_PROCESS)
                self._log.info("compute mode set", gpu=uuid, mode="EXCLUSIVE_PROCESS", was=current.name)

    async def restore(self) -> None:
        """Give every GPU its mode from before back (each failure logged, none raised)."""
        for uuid, mode in self._original.items():
            try:
                await anyio.to_thread.run_sync(self._gpus.set_compute_mode, GpuUuid(uuid), ComputeMode(mode))
            except GpuDiscoveryError as exc:
                self._log.error("compute mode not restored", gpu=uuid, reason=str(exc))
            else:
                self._log.info("compute mode restored", gpu=uuid, mode=ComputeMode(mode).name)
