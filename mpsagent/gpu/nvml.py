"""The NVML adapter: the only importer of pynvml. Its calls block, so the agent runs them off the event loop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pynvml

from mpsagent.devices import Gpu, GpuUuid, NodeGpus
from mpsagent.errors import GpuDiscoveryError
from mpsagent.gpu.port import ComputeMode

_T = TypeVar("_T")


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's `00000000:18:00.0` as sysfs names it: `0000:18:00.0`, lowercase."""
    domain, _, rest = nvml_bus_id.lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest else nvml_bus_id.lower()


def read_numa_node(sysfs_root: Path, nvml_bus_id: str) -> int | None:
    try:
        node = int((sysfs_root / "bus/pci/devices" / sysfs_bus_id(nvml_bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


class NvmlGpuSource:
    """GPUs and compute modes through NVML; every call holds NVML initialised only for its own duration."""

    manages_compute_mode = True

    def __init__(self, sysfs_root: Path = Path("/sys")) -> None:
        self._sysfs = sysfs_root
        self._lock = threading.Lock()

    @contextmanager
    def _session(self) -> Iterator[None]:
        with self._lock:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                raise GpuDiscoveryError(
                    f"NVML could not be initialised ({exc}); is the NVIDIA driver loaded? "
                    "Use --node-snapshot to dry-run without one"
                ) from exc
            try:
                yield
            finally:
                pynvml.nvmlShutdown()

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        with self._session():
            try:
                return fn()
            except pynvml.NVMLError as exc:
                raise GpuDiscoveryError(f"NVML failed to {what}: {exc}") from exc

    def discover(self) -> NodeGpus:
        return self._call("list the GPUs", self._discover)

    def _discover(self) -> NodeGpus:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
            try:
                mig_enabled = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError_NotSupported:
                mig_enabled = False
            gpus.append(
                Gpu(
                    uuid=GpuUuid(pynvml.nvmlDeviceGetUUID(handle)),
                    index=index,
                    name=pynvml.nvmlDeviceGetName(handle),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    compute_capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
                    pci_bus_id=bus_id,
                    numa_node=read_numa_node(self._sysfs, bus_id),
                    mig_enabled=mig_enabled,
                )
            )
        if not gpus:
            raise GpuDiscoveryError("NVML reports no GPUs on this node")
        return NodeGpus(driver_version=pynvml.nvmlSystemGetDriverVersion(), gpus=tuple(gpus), source="NVML")

    def compute_mode(self, uuid: GpuUuid) -> ComputeMode:
        return self._call(
            f"read the compute mode of {uuid}",
            lambda: ComputeMode(pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid))),
        )

    def set_compute_mode(self, uuid: GpuUuid, mode: ComputeMode) -> None:
        self._call(
            f"set the compute mode of {uuid} to {mode.name}",
            lambda: pynvml.nvmlDeviceSetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid), int(mode)),
        )
