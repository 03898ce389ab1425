"""The NVML adapter: the only importer of pynvml. Its calls block, so the agent runs them off the event loop."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pynvml

from mpsagent.base.devices import GPU_UUID_FORM, MAX_GPUS_PER_NODE, Gpu, GpuUuid, NodeGpus, is_gpu_uuid
from mpsagent.base.errors import GpuDiscoveryError, GpuHealthError, MemoryLimitError, shown
from mpsagent.base.procfs import cgroup2_place
from mpsagent.gpu.port import UTILIZATION_WINDOW_S, CgroupMemory, ComputeMode, GpuProcess, XidEvent

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


NO_LIMIT = 0xFFFFFFFFFFFFFFFF
"""NVML_DEVICE_MEMORY_LIMIT_MAX: the hard limit that means none."""
_SET_LIMITS = "nvmlDeviceSetMemoryLimits_v1"
_GET_LIMITS = "nvmlDeviceGetMemoryLimits_v1"
NO_CGROUP2 = "the node has no cgroup v2, which the driver's memory limits need"
MIG_ON = "MIG is on: the driver limits a cgroup's memory on whole GPUs only"


def own_cgroup2_directory(proc: Path = Path("/proc")) -> str | None:
    """This process's cgroup v2 directory (`/sys/fs/cgroup/...`): where the driver's memory limits are asked about
    at start; None without cgroup v2."""
    try:
        place = cgroup2_place("self", proc)
    except OSError:
        return None
    return None if place is None else place.directory


def _limits_function(name: str) -> Callable[..., None]:
    found: Callable[..., None] | None = getattr(pynvml, name, None)
    if found is None:  # an nvidia-ml-py older than 13.615
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    return found


def _read_limits(handle: object, cgroup: str) -> tuple[int, int, int]:
    """(soft, hard, used) bytes of the cgroup on the GPU; raises pynvml.NVMLError."""
    limits = pynvml.c_nvmlGetMemoryLimits_v1_t()
    limits.nameSpace = cgroup.encode()
    _limits_function(_GET_LIMITS)(handle, limits)
    return int(limits.softLimit), int(limits.hardLimit), int(limits.currentUsed)


def _memory_limits_unavailable(handle: object, mig_enabled: bool, probe: str | None, driver: str) -> str | None:
    """Why the driver cannot limit a cgroup's memory on this GPU; None when it can (it answers about `probe`, the
    agent's own cgroup)."""
    if mig_enabled:
        return MIG_ON
    if probe is None:
        return NO_CGROUP2
    try:
        _read_limits(handle, probe)
    except pynvml.NVMLError_NotFound:
        return None  # it limits cgroups, and has no entry for this one (the root cgroup, where a host agent runs)
    except pynvml.NVMLError_FunctionNotFound:
        return (
            f"driver {driver} has no per-cgroup memory limits (drivers from r615 have them, with nvidia-ml-py 13.615)"
        )
    except pynvml.NVMLError_NotSupported:
        return (
            "the driver does not limit memory per cgroup on this node: it needs cgroup v2 and the kernel's dmem "
            "controller (6.14 or newer) or its own misc backend"
        )
    except pynvml.NVMLError as exc:
        return f"NVML did not give the memory limits of {probe} ({exc})"
    return None


class NvmlMemoryLimits:
    """The driver's memory limits per cgroup, through NVML (r615+); each call initialises NVML for itself."""

    def set_hard_limit(self, uuid: GpuUuid, cgroup: str, hard_bytes: int) -> None:
        def call() -> None:
            limits = pynvml.c_nvmlSetMemoryLimits_v1_t()
            limits.nameSpace = cgroup.encode()
            limits.softLimit = 0
            limits.hardLimit = hard_bytes
            _limits_function(_SET_LIMITS)(_handle(uuid), limits)

        _limit_call(f"set the memory limit of {cgroup} on {uuid} to {hard_bytes} bytes", call)

    def read(self, uuid: GpuUuid, cgroup: str) -> CgroupMemory | None:
        def call() -> CgroupMemory | None:
            try:
                soft, hard, used = _read_limits(_handle(uuid), cgroup)
            except pynvml.NVMLError_NotFound:
                return None
            return CgroupMemory(hard_bytes=None if hard == NO_LIMIT else hard, soft_bytes=soft, used_bytes=used)

        return _limit_call(f"read the memory limit of {cgroup} on {uuid}", call)


def _handle(uuid: GpuUuid) -> object:
    return pynvml.nvmlDeviceGetHandleByUUID(uuid)


def _limit_call(what: str, fn: Callable[[], _T]) -> _T:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise MemoryLimitError(f"NVML could not be initialised to {what} ({exc})") from exc
    try:
        return fn()
    except pynvml.NVMLError as exc:
        raise MemoryLimitError(f"NVML failed to {what}: {exc}") from exc
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


# As the NVIDIA device plugin: subscribe to ECC events too, act on critical Xids only.
EVENT_MASK = (
    pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypeSingleBitEccError
)


class NvmlEventWatch:
    """Critical-Xid events of some GPUs; holds NVML initialised (it counts references) until closed."""

    def __init__(self, uuids: tuple[GpuUuid, ...]) -> None:
        self.registration_problems: dict[GpuUuid, str] = {}
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuHealthError(f"NVML could not be initialised to watch GPU events ({exc})") from exc
        try:
            self._set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise GpuHealthError(f"NVML could not create an event set ({exc})") from exc
        for uuid in uuids:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
                pynvml.nvmlDeviceRegisterEvents(handle, EVENT_MASK & supported, self._set)
            except pynvml.NVMLError as exc:
                self.registration_problems[uuid] = str(exc)

    def wait(self, timeout_ms: int) -> XidEvent | None:
        try:
            data = pynvml.nvmlEventSetWait(self._set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        except pynvml.NVMLError as exc:
            raise GpuHealthError(f"waiting for NVML events failed ({exc})") from exc
        if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
            return None
        try:
            uuid: GpuUuid | None = GpuUuid(pynvml.nvmlDeviceGetUUID(data.device))
        except pynvml.NVMLError:
            uuid = None
        return XidEvent(uuid=uuid, xid=int(data.eventData))

    def close(self) -> None:
        # Best effort: a failing driver is why a watch gets closed, and there is nothing more to do about it.
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlEventSetFree(self._set)
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


class NvmlGpuSource:
    """GPUs, compute modes and health through NVML; each call holds NVML initialised only for its own duration."""

    manages_compute_mode = True

    def __init__(self, sysfs_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> None:
        self._sysfs = sysfs_root
        self._proc = proc_root
        self._lock = threading.Lock()
        self.memory_limits = NvmlMemoryLimits()

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
        count = pynvml.nvmlDeviceGetCount()
        if count > MAX_GPUS_PER_NODE:
            raise GpuDiscoveryError(f"NVML reports {count} GPUs; mpsagent serves at most {MAX_GPUS_PER_NODE} per node")
        gpus = []
        driver = pynvml.nvmlSystemGetDriverVersion()
        probe = own_cgroup2_directory(self._proc)
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            if not is_gpu_uuid(uuid):
                raise GpuDiscoveryError(
                    f"NVML reports GPU {index} with uuid `{shown(uuid)}`, which is not an NVIDIA GPU UUID "
                    f"({GPU_UUID_FORM}); it is not handed to containers: check the driver"
                )
            bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
            try:
                mig_enabled = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError_NotSupported:
                mig_enabled = False
            gpus.append(
                Gpu(
                    uuid=GpuUuid(uuid),
                    index=index,
                    name=pynvml.nvmlDeviceGetName(handle),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    compute_capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
                    pci_bus_id=bus_id,
                    numa_node=read_numa_node(self._sysfs, bus_id),
                    mig_enabled=mig_enabled,
                    memory_limits_unavailable=_memory_limits_unavailable(handle, mig_enabled, probe, driver),
                )
            )
        if not gpus:
            raise GpuDiscoveryError("NVML reports no GPUs on this node")
        return NodeGpus(driver_version=driver, gpus=tuple(gpus), source="NVML")

    @property
    def health(self) -> NvmlGpuSource:
        return self

    def watch_events(self, uuids: tuple[GpuUuid, ...]) -> NvmlEventWatch:
        return NvmlEventWatch(uuids)

    def probe(self, uuid: GpuUuid) -> str | None:
        try:
            with self._session():
                pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid))
        except pynvml.NVMLError_GpuIsLost:
            return "NVML reports the GPU lost"
        except pynvml.NVMLError as exc:
            return f"NVML does not answer for it ({exc})"
        except GpuDiscoveryError as exc:
            return str(exc)
        return None

    def processes(self, uuid: GpuUuid) -> tuple[GpuProcess, ...]:
        def read() -> tuple[GpuProcess, ...]:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            sm = _sm_percents(handle)
            found = {
                p.pid: GpuProcess(pid=p.pid, used_bytes=p.usedGpuMemory, mps_client=False, sm_percent=_of(sm, p.pid))
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            }
            for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle):
                found[p.pid] = GpuProcess(
                    pid=p.pid, used_bytes=p.usedGpuMemory, mps_client=True, sm_percent=_of(sm, p.pid)
                )
            return tuple(found.values())

        return self._call(f"list the processes on {uuid}", read)

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


def _sm_percents(handle: object) -> dict[int, int] | None:
    """Each process's latest SM utilization sample of the window (none: idle); None where NVML does not sample
    processes, or failed to (the process list does not depend on it)."""
    since_us = int((time.time() - UTILIZATION_WINDOW_S) * 1_000_000)
    try:
        samples = pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except pynvml.NVMLError_NotFound:
        return {}  # no sample in the window: none of its processes ran a kernel
    except pynvml.NVMLError:
        return None
    latest: dict[int, tuple[int, int]] = {}
    for sample in samples:
        if sample.pid not in latest or sample.timeStamp > latest[sample.pid][0]:
            latest[sample.pid] = (sample.timeStamp, min(100, int(sample.smUtil)))
    return {pid: percent for pid, (_, percent) in latest.items()}


def _of(percents: dict[int, int] | None, pid: int) -> int | None:
    return None if percents is None else percents.get(pid, 0)
