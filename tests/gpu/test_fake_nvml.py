"""The fake libnvidia-ml.so.1 (mpsagent_testing/nvml) drives the real pynvml without a GPU."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from mpsagent_testing.cgroups import PodCgroup
from mpsagent_testing.nvml.build import build_fake_nvml, fake_nvml_env
from mpsagent_testing.nvml.control import (
    EVENT_DOUBLE_BIT_ECC_ERROR,
    EVENT_PSTATE,
    EVENT_XID_CRITICAL_ERROR,
    FakeNvmlDriver,
)
from mpsagent_testing.repo import BUILD

SUBPROCESS_TIMEOUT_S = 30

H100 = {
    "uuid": "GPU-11111111-2222-3333-4444-555555555555",
    "name": "NVIDIA H100 80GB HBM3",
    "memoryTotal": 85520809984,
    "major": 9,
    "minor": 0,
    "pciBusId": "00000000:18:00.0",
    "migMode": 0,
    "computeMode": 0,
    "lost": False,
}
A100 = {
    "uuid": "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
    "name": "NVIDIA A100-SXM4-40GB",
    "memoryTotal": 42949672960,
    "major": 8,
    "minor": 0,
    "pciBusId": "00000000:AF:00.0",
    "migMode": 1,
    "computeMode": 2,
}
CONFIG = {"driverVersion": "550.54.15", "gpus": [H100, A100]}
LIMIT_MAX = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX

# Every snippet starts with this: emit() prints the result, error() runs a call and names its NVMLError,
# event() flattens what nvmlEventSetWait returns, handles(n) initializes and gives the first n handles,
# set_limits() / get_limits() call the per-cgroup memory limits (nameSpace: a str, or None for NULL) and give
# the error, or [softLimit, hardLimit, currentUsed].
PRELUDE = textwrap.dedent(
    """
    import json
    import pynvml

    def emit(value):
        print(json.dumps(value), flush=True)

    def error(fn, *args):
        try:
            fn(*args)
        except pynvml.NVMLError as exc:
            return [type(exc).__name__, exc.value, str(exc)]
        return None

    def event(ev):
        # An nvmlEventData_t as [UUID through its device handle, type, data, GPU/compute instance].
        return [pynvml.nvmlDeviceGetUUID(ev.device), ev.eventType, ev.eventData, ev.gpuInstanceId,
                ev.computeInstanceId]

    def handles(count):
        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def set_limits(h, namespace, soft, hard):
        ns = namespace.encode() if isinstance(namespace, str) else namespace
        return error(pynvml.nvmlDeviceSetMemoryLimits_v1, h, pynvml.c_nvmlSetMemoryLimits_v1_t(ns, soft, hard))

    def get_limits(h, namespace):
        limits = pynvml.c_nvmlGetMemoryLimits_v1_t(namespace.encode() if isinstance(namespace, str) else namespace)
        failed = error(pynvml.nvmlDeviceGetMemoryLimits_v1, h, limits)
        return failed or [limits.softLimit, limits.hardLimit, limits.currentUsed]
    """
)


class FakeNvml:
    """Runs pynvml snippets in fresh interpreters against the fake library."""

    def __init__(self, library: Path, workdir: Path) -> None:
        self.library = library
        self.config_path = workdir / "nvml-config.json"
        self.state_path = workdir / "nvml-state.json"
        self.events_path = workdir / "nvml-events.jsonl"
        self.driver = FakeNvmlDriver(self.state_path, self.events_path)
        self.last_stderr = ""

    def _env(self, config: dict[str, Any] | str, shared_state: bool = True) -> dict[str, str]:
        self.config_path.write_text(config if isinstance(config, str) else json.dumps(config))
        state = self.state_path if shared_state else None
        return fake_nvml_env(self.library, self.config_path, state, events=self.events_path)

    def run(self, config: dict[str, Any] | str, code: str, shared_state: bool = True) -> Any:
        """Write config (a dict, or raw text), run PRELUDE + code, return what it emit()ted.

        Without ``shared_state`` the snippet has no FAKE_NVML_STATE: what it changes stays in its process.
        """
        proc = subprocess.run(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            env=self._env(config, shared_state),
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
            check=False,
        )
        self.last_stderr = proc.stderr
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout) if proc.stdout.strip() else None

    @contextlib.contextmanager
    def start(self, config: dict[str, Any], code: str) -> Iterator[Child]:
        """Run PRELUDE + code in the background, to talk to it step by step (see Child)."""
        # SIGALRM's default action ends a stuck child, which unblocks Child.recv's readline.
        prelude = PRELUDE + f"import signal, sys\nsignal.alarm({SUBPROCESS_TIMEOUT_S})\n"
        prelude += "def proceed():\n    assert sys.stdin.readline() == 'go\\n'\n"
        proc = subprocess.Popen(
            [sys.executable, "-c", prelude + textwrap.dedent(code)],
            env=self._env(config),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            yield Child(proc)
            assert proc.stdin is not None
            proc.stdin.close()
            assert proc.wait(timeout=SUBPROCESS_TIMEOUT_S) == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=SUBPROCESS_TIMEOUT_S)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


class Child:
    """A background snippet: recv() is its next emit(), go() lets its next proceed() return."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def recv(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=SUBPROCESS_TIMEOUT_S)
            pytest.fail(f"child exited with {code}: {self.proc.stderr.read() if self.proc.stderr else ''}")
        return json.loads(line)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


@pytest.fixture(scope="session")
def fake_nvml_lib() -> Path:
    return build_fake_nvml(BUILD)


@pytest.fixture
def nvml(fake_nvml_lib: Path, tmp_path: Path) -> FakeNvml:
    return FakeNvml(fake_nvml_lib, tmp_path)


def test_build_is_skipped_when_library_is_fresh(fake_nvml_lib: Path) -> None:
    assert fake_nvml_lib == BUILD / "libnvidia-ml.so.1"
    before = fake_nvml_lib.stat().st_mtime_ns
    assert build_fake_nvml(BUILD) == fake_nvml_lib
    assert fake_nvml_lib.stat().st_mtime_ns == before


def test_inventory_through_real_pynvml(nvml: FakeNvml, fake_nvml_lib: Path) -> None:
    out = nvml.run(
        CONFIG,
        """
        pynvml.nvmlInit()
        maps = [line.split()[-1] for line in open("/proc/self/maps") if "libnvidia-ml" in line]
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            mem2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            gpus.append({
                "uuid": uuid,
                "name": pynvml.nvmlDeviceGetName(h),
                "index": pynvml.nvmlDeviceGetIndex(h),
                "minor": pynvml.nvmlDeviceGetMinorNumber(h),
                "byUuid": pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)),
                "mem": [mem.total, mem.free, mem.used],
                "mem2": [mem2.total, mem2.reserved, mem2.free, mem2.used],
                "cc": list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                "busId": pci.busId,
                "busIdLegacy": pci.busIdLegacy,
                "pci": [pci.domain, pci.bus, pci.device, pci.pciDeviceId],
                "mig": pynvml.nvmlDeviceGetMigMode(h),
                "computeMode": pynvml.nvmlDeviceGetComputeMode(h),
                "procs": pynvml.nvmlDeviceGetComputeRunningProcesses(h),
                "procs_v2": pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h),
            })
        emit({
            "maps": maps,
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "nvml": pynvml.nvmlSystemGetNVMLVersion(),
            "cuda": pynvml.nvmlSystemGetCudaDriverVersion(),
            "cuda_v2": pynvml.nvmlSystemGetCudaDriverVersion_v2(),
            "gpus": gpus,
        })
        pynvml.nvmlShutdown()
        """,
    )
    assert out["maps"], "pynvml did not load any libnvidia-ml"
    assert {Path(p) for p in out["maps"]} == {fake_nvml_lib.resolve()}
    assert out["driver"] == "550.54.15"
    assert out["nvml"] == "12.550.54.15"
    assert out["cuda"] == out["cuda_v2"] == 12040
    h100, a100 = out["gpus"]
    assert h100 == {
        "uuid": H100["uuid"],
        "name": "NVIDIA H100 80GB HBM3",
        "index": 0,
        "minor": 0,
        "byUuid": 0,
        "mem": [85520809984, 85520809984, 0],
        "mem2": [85520809984, 0, 85520809984, 0],
        "cc": [9, 0],
        "busId": "00000000:18:00.0",
        "busIdLegacy": "0000:18:00.0",
        "pci": [0, 0x18, 0, 0x233010DE],
        "mig": [0, 0],
        "computeMode": 0,
        "procs": [],
        "procs_v2": [],
    }
    assert a100["uuid"] == A100["uuid"]
    assert a100["index"] == a100["byUuid"] == 1
    assert a100["cc"] == [8, 0]
    assert a100["busId"] == "00000000:AF:00.0"
    assert a100["mig"] == [1, 1]
    assert a100["computeMode"] == 2


def test_set_compute_mode_is_seen_by_another_process(nvml: FakeNvml) -> None:
    first = nvml.run(
        CONFIG,
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        emit(pynvml.nvmlDeviceGetComputeMode(h))
        """,
    )
    assert first == 3
    state = json.loads((nvml.state_path).read_text())
    assert state == {"computeModes": {H100["uuid"]: 3, A100["uuid"]: 2}}

    second = nvml.run(
        CONFIG,
        """
        pynvml.nvmlInit()
        emit([pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)])
        """,
    )
    assert second == [3, 2]


def test_compute_mode_change_reaches_an_already_initialized_process(nvml: FakeNvml) -> None:
    # The state file plays the driver: changes written after nvmlInit are seen by the next query.
    out = nvml.run(
        CONFIG,
        f"""
        import pathlib
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(1)
        before = pynvml.nvmlDeviceGetComputeMode(h)
        other_process = {{"computeModes": {{{A100["uuid"]!r}: 0, "GPU-not-on-this-node": 3}}}}
        pathlib.Path({str(nvml.state_path)!r}).write_text(json.dumps(other_process))
        after = pynvml.nvmlDeviceGetComputeMode(h)
        pynvml.nvmlDeviceSetComputeMode(pynvml.nvmlDeviceGetHandleByIndex(0), 2)
        emit([before, after])
        """,
    )
    assert out == [2, 0]
    assert json.loads(nvml.state_path.read_text())["computeModes"] == {
        H100["uuid"]: 2,
        A100["uuid"]: 0,
        "GPU-not-on-this-node": 3,
    }


def test_set_compute_mode_errors(nvml: FakeNvml) -> None:
    config = {"gpus": [H100, {**A100, "setComputeModeError": 4}]}
    out = nvml.run(
        config,
        """
        pynvml.nvmlInit()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        emit([
            error(pynvml.nvmlDeviceSetComputeMode, h0, 4),
            error(pynvml.nvmlDeviceSetComputeMode, h1, 0),
            pynvml.nvmlDeviceGetComputeMode(h0),
            pynvml.nvmlDeviceGetComputeMode(h1),
        ])
        """,
    )
    assert out[0][:2] == ["NVMLError_InvalidArgument", 2]
    assert out[1][:2] == ["NVMLError_NoPermission", 4]
    assert out[2:] == [0, 2]


def test_init_error_raises_driver_not_loaded(nvml: FakeNvml) -> None:
    out = nvml.run(
        {**CONFIG, "initError": 9},
        """
        emit([error(pynvml.nvmlInit), error(pynvml.nvmlDeviceGetCount)])
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_DriverNotLoaded:
            pass
        """,
    )
    assert out[0] == ["NVMLError_DriverNotLoaded", 9, "Driver Not Loaded"]
    assert out[1][:2] == ["NVMLError_Uninitialized", 1]


def test_lost_gpu(nvml: FakeNvml) -> None:
    out = nvml.run(
        {"gpus": [{**H100, "lost": True}, A100]},
        """
        pynvml.nvmlInit()
        lost = pynvml.nvmlDeviceGetHandleByIndex(0)
        emit({
            "count": pynvml.nvmlDeviceGetCount(),
            "uuid": pynvml.nvmlDeviceGetUUID(lost),
            "mem": error(pynvml.nvmlDeviceGetMemoryInfo, lost),
            "name": error(pynvml.nvmlDeviceGetName, lost),
            "mode": error(pynvml.nvmlDeviceGetComputeMode, lost),
            "set": error(pynvml.nvmlDeviceSetComputeMode, lost, 3),
            "other": pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1)).total,
        })
        try:
            pynvml.nvmlDeviceGetMemoryInfo(lost)
        except pynvml.NVMLError_GpuIsLost:
            pass
        """,
    )
    assert out["count"] == 2
    assert out["uuid"] == H100["uuid"]
    for call in ("mem", "name", "mode", "set"):
        assert out[call] == ["NVMLError_GpuIsLost", 15, "GPU is lost"], call
    assert out["other"] == A100["memoryTotal"]


def test_mig_not_supported(nvml: FakeNvml) -> None:
    out = nvml.run(
        {"gpus": [{**H100, "migMode": -1}]},
        """
        pynvml.nvmlInit()
        emit(error(pynvml.nvmlDeviceGetMigMode, pynvml.nvmlDeviceGetHandleByIndex(0)))
        """,
    )
    assert out[:2] == ["NVMLError_NotSupported", 3]


def test_argument_and_lifecycle_errors(nvml: FakeNvml) -> None:
    out = nvml.run(
        CONFIG,
        """
        pynvml.nvmlInit()
        pynvml.nvmlInit()  # reference counted, like the real library
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        results = {
            "badIndex": error(pynvml.nvmlDeviceGetHandleByIndex, 2),
            "badUuid": error(pynvml.nvmlDeviceGetHandleByUUID, "GPU-nope"),
            "memVersion": error(pynvml.nvmlDeviceGetMemoryInfo, h, 1),
        }
        pynvml.nvmlShutdown()
        results["afterOneShutdown"] = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        results["afterShutdown"] = error(pynvml.nvmlDeviceGetCount)
        results["staleHandle"] = error(pynvml.nvmlDeviceGetName, h)
        results["shutdownTwice"] = error(pynvml.nvmlShutdown)
        emit(results)
        """,
    )
    assert out["badIndex"][:2] == ["NVMLError_InvalidArgument", 2]
    assert out["badUuid"][:2] == ["NVMLError_NotFound", 6]
    # pynvml has no text for this code, so str() comes from the fake's nvmlErrorString.
    assert out["memVersion"] == ["NVMLError_ArgumentVersionMismatch", 25, "Argument version mismatch"]
    assert out["afterOneShutdown"] == 2
    for key in ("afterShutdown", "staleHandle", "shutdownTwice"):
        assert out[key][:2] == ["NVMLError_Uninitialized", 1], key


def test_symbols_pynvml_does_not_wrap(nvml: FakeNvml) -> None:
    # Older or unversioned entry points, called straight through ctypes as C callers would.
    out = nvml.run(
        CONFIG,
        """
        import ctypes
        pynvml.nvmlInit()
        lib = pynvml.nvmlLib
        count, handle = ctypes.c_uint(), pynvml.c_nvmlDevice_t()
        legacy = pynvml.nvmlPciInfo_v2_t()
        small = ctypes.create_string_buffer(8)
        emit({
            "init": [lib.nvmlInit(), lib.nvmlInit_v2()],
            "count": [lib.nvmlDeviceGetCount(ctypes.byref(count)), count.value],
            "handle": lib.nvmlDeviceGetHandleByIndex(1, ctypes.byref(handle)),
            "pci_v2": [lib.nvmlDeviceGetPciInfo_v2(handle, ctypes.byref(legacy)), legacy.busId, legacy.bus],
            "pci_v1": lib.nvmlDeviceGetPciInfo(handle, ctypes.byref(legacy)),
            "procs": [lib.nvmlDeviceGetComputeRunningProcesses(handle, ctypes.byref(count), None), count.value],
            "smallUuid": lib.nvmlDeviceGetUUID(handle, small, 8),
            "nullOut": lib.nvmlDeviceGetCount_v2(None),
            "types": [type(v).__name__ for v in (
                pynvml.nvmlSystemGetDriverVersion(),
                pynvml.nvmlDeviceGetUUID(handle),
                pynvml.nvmlDeviceGetName(handle),
                pynvml.nvmlDeviceGetPciInfo(handle).busId,
            )],
        })
        """,
    )
    assert out == {
        "init": [0, 0],
        "count": [0, 2],
        "handle": 0,
        "pci_v2": [0, "0000:AF:00.0", 0xAF],
        "pci_v1": 0,
        "procs": [0, 0],
        "smallUuid": 7,
        "nullOut": 2,
        "types": ["str", "str", "str", "str"],
    }


def test_config_is_reread_on_every_init(nvml: FakeNvml) -> None:
    out = nvml.run(
        CONFIG,
        f"""
        import pathlib
        pynvml.nvmlInit()
        before = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        pathlib.Path({str(nvml.config_path)!r}).write_text(json.dumps({{"gpus": [{{}}]}}))
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        emit([before, pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetName(h)])
        """,
    )
    assert out == [2, 1, "GPU-00000000-0000-0000-0000-000000000000", "NVIDIA Fake GPU"]


@pytest.mark.parametrize(
    "config",
    [
        {"gpus": [{"uuid": 5}]},
        {"gpus": [{"pciBusId": "not-a-bus-id"}]},
        {"gpus": [H100, H100]},
        {"gpus": [{}] * 65},
        {"memoryLimits": "yes"},
        {"cgroupLayout": "v1"},
        {"cgroupRoot": "sys/fs/cgroup"},
        {"gpus": [{"processUtilizationError": -1}]},
    ],
    ids=[
        "wrong-type",
        "bad-bus-id",
        "duplicate-uuid",
        "too-many-gpus",
        "memory-limits-not-bool",
        "unknown-cgroup-layout",
        "relative-cgroup-root",
        "negative-utilization-error",
    ],
)
def test_bad_config_fails_init_loudly(nvml: FakeNvml, config: dict[str, Any]) -> None:
    out = nvml.run(config, "emit(error(pynvml.nvmlInit))")
    assert out[:2] == ["NVMLError_Unknown", 999]
    assert "fake_nvml:" in nvml.last_stderr


def test_malformed_json_fails_init_loudly(nvml: FakeNvml) -> None:
    assert nvml.run('{"gpus": [}', "emit(error(pynvml.nvmlInit))")[:2] == ["NVMLError_Unknown", 999]
    assert "invalid JSON" in nvml.last_stderr


# ------------------------------------------------------------------------------------------------
# Events (FAKE_NVML_EVENTS), lost GPUs and running processes (FAKE_NVML_STATE) at run time
# ------------------------------------------------------------------------------------------------

NO_INSTANCE = 0xFFFFFFFF


def test_events_reach_only_their_set_devices_and_types(nvml: FakeNvml) -> None:
    nvml.driver.emit_xid(H100["uuid"], 13)  # before the set exists: never delivered
    code = """
        import time
        pynvml.nvmlInit()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        supported = [pynvml.nvmlDeviceGetSupportedEventTypes(h) for h in (h0, h1)]
        s = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(
            h0, pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError, s
        )
        emit(supported)
        proceed()
        got = [event(pynvml.nvmlEventSetWait(s, 5000)), event(pynvml.nvmlEventSetWait_v2(s, 5000))]
        t0 = time.monotonic()
        timeout = error(pynvml.nvmlEventSetWait, s, 100)
        emit({"events": got, "timeout": timeout, "waited": time.monotonic() - t0})
        pynvml.nvmlEventSetFree(s)
        emit(error(pynvml.nvmlEventSetWait, s, 0))
        """
    with nvml.start(CONFIG, code) as child:
        assert child.recv() == [0xF, 0xF]
        driver = nvml.driver
        driver.emit_xid(A100["uuid"], 31)  # device not registered to the set
        driver.emit_event(H100["uuid"], EVENT_PSTATE)  # type not registered
        driver.emit_xid("GPU-not-in-the-config", 48)
        driver.emit_xid(H100["uuid"], 79)
        driver.emit_event(H100["uuid"], EVENT_DOUBLE_BIT_ECC_ERROR, 7)
        child.go()
        out = child.recv()
        assert out["events"] == [
            [H100["uuid"], EVENT_XID_CRITICAL_ERROR, 79, NO_INSTANCE, NO_INSTANCE],
            [H100["uuid"], EVENT_DOUBLE_BIT_ECC_ERROR, 7, NO_INSTANCE, NO_INSTANCE],
        ]
        assert out["timeout"] == ["NVMLError_Timeout", 10, "Timeout"]
        assert 0.09 <= out["waited"] < 2
        assert child.recv()[:2] == ["NVMLError_InvalidArgument", 2]  # freed set


def test_wait_does_not_block_other_calls_nor_take_half_lines(nvml: FakeNvml) -> None:
    code = """
        import threading, time
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(1)
        s = pynvml.nvmlEventSetCreate()  # the events file does not exist yet
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, s)
        result = []
        waiter = threading.Thread(target=lambda: result.append(event(pynvml.nvmlEventSetWait(s, 10000))))
        waiter.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        for _ in range(20):
            pynvml.nvmlDeviceGetMemoryInfo(h)
        emit({"calls": time.monotonic() - t0, "waiting": waiter.is_alive()})
        waiter.join(10)
        emit(result)
        """
    with nvml.start(CONFIG, code) as child:
        first = child.recv()
        assert first["waiting"]
        assert first["calls"] < 1
        line = json.dumps({"uuid": A100["uuid"], "xid": 94}).encode() + b"\n"
        with nvml.events_path.open("ab", buffering=0) as f:
            f.write(line[:20])  # the waiter polls every 5 ms: it must leave this half line alone
            time.sleep(0.05)
            f.write(line[20:])
        assert child.recv() == [[A100["uuid"], EVENT_XID_CRITICAL_ERROR, 94, NO_INSTANCE, NO_INSTANCE]]


def test_failed_wait_is_reported_once_by_every_set(nvml: FakeNvml) -> None:
    config = {"gpus": [{**H100, "supportedEventTypes": 8}, {**A100, "registerEventsError": 17}]}
    code = """
        pynvml.nvmlInit()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        sets = [pynvml.nvmlEventSetCreate() for _ in range(2)]
        for s in sets:
            pynvml.nvmlDeviceRegisterEvents(h0, pynvml.nvmlEventTypeXidCriticalError, s)
        emit({
            "supported": pynvml.nvmlDeviceGetSupportedEventTypes(h0),
            "unsupported": error(pynvml.nvmlDeviceRegisterEvents, h0, pynvml.nvmlEventTypeDoubleBitEccError, sets[0]),
            "registerError": error(pynvml.nvmlDeviceRegisterEvents, h1, pynvml.nvmlEventTypeXidCriticalError, sets[0]),
        })
        proceed()
        emit([[error(pynvml.nvmlEventSetWait, s, 5000), event(pynvml.nvmlEventSetWait(s, 5000))] for s in sets])
        emit(error(pynvml.nvmlEventSetWait, sets[0], 20))
        """
    with nvml.start(config, code) as child:
        assert child.recv() == {
            "supported": EVENT_XID_CRITICAL_ERROR,
            "unsupported": ["NVMLError_NotSupported", 3, "Not Supported"],
            "registerError": ["NVMLError_OperatingSystem", 17, "The operating system has blocked the request."],
        }
        nvml.driver.fail_next_wait(999)
        nvml.driver.emit_xid(H100["uuid"], 48)
        child.go()
        xid48 = [H100["uuid"], EVENT_XID_CRITICAL_ERROR, 48, NO_INSTANCE, NO_INSTANCE]
        unknown = ["NVMLError_Unknown", 999, "Unknown Error"]
        assert child.recv() == [[unknown, xid48], [unknown, xid48]]
        assert child.recv()[:2] == ["NVMLError_Timeout", 10]


def test_gpu_lost_and_found_while_running(nvml: FakeNvml) -> None:
    code = """
        pynvml.nvmlInit()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        def snapshot():
            return {
                "mem": error(pynvml.nvmlDeviceGetMemoryInfo, h0),
                "procs": error(pynvml.nvmlDeviceGetComputeRunningProcesses, h0),
                "uuid": pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(h0))),
                "other": error(pynvml.nvmlDeviceGetMemoryInfo, h1),
            }
        for _ in range(3):
            emit(snapshot())
            proceed()
        """
    with nvml.start(CONFIG, code) as child:
        usable = {"mem": None, "procs": None, "uuid": H100["uuid"], "other": None}
        assert child.recv() == usable
        nvml.driver.lose(H100["uuid"])
        child.go()
        lost_error = ["NVMLError_GpuIsLost", 15, "GPU is lost"]
        assert child.recv() == {**usable, "mem": lost_error, "procs": lost_error}
        assert nvml.driver.lost() == [H100["uuid"]]
        nvml.driver.find(H100["uuid"])
        child.go()
        assert child.recv() == usable
        child.go()


def test_compute_mode_writes_keep_the_rest_of_the_state(nvml: FakeNvml) -> None:
    nvml.driver.lose(A100["uuid"])
    nvml.driver.set_processes(H100["uuid"], [(1234, 1 << 20)])
    nvml.driver.set_processes(H100["uuid"], [(1234, None)], mps=True)
    # Above 2**63 - 1: the fake must read and write back all 64 bits.
    limits = {"/sys/fs/cgroup/gone": {H100["uuid"]: {"soft": 1 << 63, "hard": LIMIT_MAX, "setAt": 1.5, "setBy": 7}}}
    with nvml.driver.update() as state:
        state["memoryLimits"] = limits
    out = nvml.run(
        CONFIG,
        """
        pynvml.nvmlInit()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        pynvml.nvmlDeviceSetComputeMode(h0, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        emit([pynvml.nvmlDeviceGetComputeMode(h0), error(pynvml.nvmlDeviceGetComputeMode, h1)])
        """,
    )
    assert out == [3, ["NVMLError_GpuIsLost", 15, "GPU is lost"]]
    assert nvml.driver.read() == {
        "computeModes": {H100["uuid"]: 3, A100["uuid"]: 2},
        "lost": [A100["uuid"]],
        "processes": {H100["uuid"]: [{"pid": 1234, "usedGpuMemory": 1 << 20}]},
        "mpsProcesses": {H100["uuid"]: [{"pid": 1234, "usedGpuMemory": None}]},
        "memoryLimits": limits,
    }


def test_running_processes_from_the_state(nvml: FakeNvml) -> None:
    driver = nvml.driver
    driver.set_processes(H100["uuid"], [(1234, 1 << 20), (5678, None)])
    driver.set_processes(H100["uuid"], [(4321, 3 << 30)], mps=True)
    code = """
        import ctypes
        pynvml.nvmlInit()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        lib = pynvml.nvmlLib

        def procs(fn, h):
            return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in fn(h)]

        def raw_v1(name):
            # The unversioned calls take the two-field nvmlProcessInfo_v1_t.
            class V1(ctypes.Structure):
                _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
            count = ctypes.c_uint(1)
            probe = [getattr(lib, name)(h0, ctypes.byref(count), None), count.value]
            infos = (V1 * 3)()
            count.value = 3
            rc = getattr(lib, name)(h0, ctypes.byref(count), infos)
            return probe + [rc, [[infos[i].pid, infos[i].usedGpuMemory] for i in range(count.value)]]

        def snapshot():
            return {
                "v3": procs(pynvml.nvmlDeviceGetComputeRunningProcesses, h0),
                "v2": procs(pynvml.nvmlDeviceGetComputeRunningProcesses_v2, h0),
                "mps_v3": procs(pynvml.nvmlDeviceGetMPSComputeRunningProcesses, h0),
                "mps_v2": procs(pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v2, h0),
                "other": [pynvml.nvmlDeviceGetComputeRunningProcesses(h1),
                          pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h1)],
                "v1": raw_v1("nvmlDeviceGetComputeRunningProcesses"),
                "mps_v1": raw_v1("nvmlDeviceGetMPSComputeRunningProcesses"),
            }
        emit(snapshot())
        proceed()
        emit(snapshot())
        """
    with nvml.start(CONFIG, code) as child:
        out = child.recv()
        # pynvml turns NVML_VALUE_NOT_AVAILABLE (null in the state) into None.
        compute = [[1234, 1 << 20, NO_INSTANCE, NO_INSTANCE], [5678, None, NO_INSTANCE, NO_INSTANCE]]
        mps = [[4321, 3 << 30, NO_INSTANCE, NO_INSTANCE]]
        assert out == {
            "v3": compute,
            "v2": compute,
            "mps_v3": mps,
            "mps_v2": mps,
            "other": [[], []],
            "v1": [7, 2, 0, [[1234, 1 << 20], [5678, 0xFFFFFFFFFFFFFFFF]]],
            "mps_v1": [2, 1, 0, [[4321, 3 << 30]]],  # enough room but no array
        }
        driver.set_processes(H100["uuid"], [])
        driver.set_processes(H100["uuid"], [(99, 0)], mps=True)
        child.go()
        out = child.recv()
        assert out["v3"] == out["v1"][3] == []
        assert out["mps_v3"] == [[99, 0, NO_INSTANCE, NO_INSTANCE]]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"lost": "GPU-not-a-list"}, '"lost" must be an array'),
        ({"memoryLimits": {"/sys/fs/cgroup/a": {H100["uuid"]: {"soft": -1, "hard": 1}}}}, '"memoryLimits"'),
        ({"memoryLimits": {"/sys/fs/cgroup/a": [H100["uuid"]]}}, '"memoryLimits"'),
        (
            {"processUtilization": {H100["uuid"]: [{"pid": 1, "smUtil": 101}]}},
            f'processUtilization[{H100["uuid"]}]: "smUtil" must be an integer in [0, 100]',
        ),
        ({"processUtilization": {H100["uuid"]: [{"smUtil": 5}]}}, 'every entry must be an object with a "pid"'),
    ],
    ids=["lost-not-a-list", "negative-limit", "limits-not-by-uuid", "utilization-over-100", "sample-without-pid"],
)
def test_bad_state_file_fails_loudly(nvml: FakeNvml, state: dict[str, Any], message: str) -> None:
    nvml.state_path.write_text(json.dumps(state))
    assert nvml.run(CONFIG, "emit(error(pynvml.nvmlInit))")[:2] == ["NVMLError_Unknown", 999]
    assert message in nvml.last_stderr


# ------------------------------------------------------------------------------------------------
# Per-process utilization (nvmlDeviceGetProcessUtilization, nvmlDeviceGetProcessesUtilizationInfo)
# ------------------------------------------------------------------------------------------------

IDLE = {"uuid": "GPU-77777777-8888-9999-aaaa-bbbbbbbbbbbb", "name": "NVIDIA H100 80GB HBM3", "migMode": 0}
NOT_FOUND = ["NVMLError_NotFound", 6, "Not Found"]
NOT_SUPPORTED = ["NVMLError_NotSupported", 3, "Not Supported"]

# Both entry points through pynvml, which asks for the count first (a NULL array) and raises what it gets unless that
# is INSUFFICIENT_SIZE. The snippet's samples(h, since) gives [[pid, smUtil, memUtil, timeStamp], ...] or the error.
UTILIZATION_CALLS = pytest.mark.parametrize(
    "call",
    [
        "nvmlDeviceGetProcessUtilization",
        pytest.param(
            "nvmlDeviceGetProcessesUtilizationInfo",
            marks=pytest.mark.skipif(
                not hasattr(pynvml, "nvmlDeviceGetProcessesUtilizationInfo"),
                reason="this nvidia-ml-py cannot call nvmlDeviceGetProcessesUtilizationInfo",
            ),
        ),
    ],
)
SAMPLES = textwrap.dedent(
    """
    def samples(h, since=0):
        try:
            return [[s.pid, s.smUtil, s.memUtil, s.timeStamp] for s in read(h, since)]
        except pynvml.NVMLError as exc:
            return [type(exc).__name__, exc.value, str(exc)]
    """
)


def utilization_snippet(call: str, code: str) -> str:
    """``code`` after a samples() that reads through pynvml's ``call``."""
    return f"read = pynvml.{call}\n" + SAMPLES + textwrap.dedent(code)


def now_us() -> int:
    return time.time_ns() // 1000


@UTILIZATION_CALLS
def test_process_utilization_samples_follow_the_state(nvml: FakeNvml, call: str) -> None:
    driver = nvml.driver
    driver.set_process_utilization(H100["uuid"], [(1234, 40), (5678, 0)])
    code = """
        h0, h1 = handles(2)
        emit([samples(h0), samples(h1)])
        proceed()
        emit([samples(h0), samples(h1)])
        """
    before = now_us()
    with nvml.start({"gpus": [H100, IDLE]}, utilization_snippet(call, code)) as child:
        busy, idle = child.recv()
        after = now_us()
        assert [sample[:3] for sample in busy] == [[1234, 40, 0], [5678, 0, 0]]
        # Set without a timeStamp: stamped at the call, so every read sees them as new.
        assert all(before <= sample[3] <= after for sample in busy), (before, busy, after)
        assert idle == NOT_FOUND  # no samples is an error, not an empty list
        driver.set_process_utilization(H100["uuid"], [])
        driver.set_process_utilization(IDLE["uuid"], [(99, 100)])
        child.go()
        busy, idle = child.recv()
        assert busy == NOT_FOUND
        assert [sample[:3] for sample in idle] == [[99, 100, 0]]
    assert driver.read()["processUtilization"] == {IDLE["uuid"]: [{"pid": 99, "smUtil": 100}]}


@UTILIZATION_CALLS
def test_process_utilization_gives_only_samples_newer_than_last_seen(nvml: FakeNvml, call: str) -> None:
    with nvml.driver.update() as state:
        state["processUtilization"] = {
            H100["uuid"]: [
                {"pid": 1, "smUtil": 10, "memUtil": 5, "timeStamp": 1000},
                {"pid": 2, "smUtil": 20, "memUtil": 15, "timeStamp": 2000},
            ]
        }
    code = """
        h, = handles(1)
        emit([samples(h, since) for since in (0, 999, 1000, 1999, 2000)])
        """
    out = nvml.run({"gpus": [H100]}, utilization_snippet(call, code))
    first, second = [1, 10, 5, 1000], [2, 20, 15, 2000]
    assert out == [[first, second], [first, second], [second], [second], NOT_FOUND]


@UTILIZATION_CALLS
def test_process_utilization_not_supported_or_lost(nvml: FakeNvml, call: str) -> None:
    # Samples are there for every GPU: the error comes from the GPU, not from an empty list.
    gpus = [{**H100, "processUtilizationError": 3}, A100, {**IDLE, "lost": True}]  # A100 is MIG-enabled
    for gpu in gpus:
        nvml.driver.set_process_utilization(gpu["uuid"], [(1234, 50)])
    out = nvml.run({"gpus": gpus}, utilization_snippet(call, "emit([samples(h) for h in handles(3)])"))
    assert out == [NOT_SUPPORTED, NOT_SUPPORTED, ["NVMLError_GpuIsLost", 15, "GPU is lost"]]


def test_process_utilization_buffer_sizes_and_arguments(nvml: FakeNvml) -> None:
    # What pynvml does not exercise, called straight through ctypes: a buffer too small or too big, NULL count or
    # struct, a struct version the fake does not know.
    nvml.driver.set_process_utilization(H100["uuid"], [(1, 10), (2, 20), (3, 30)])
    code = """
        import ctypes
        h, = handles(1)
        lib = pynvml.nvmlLib
        since = ctypes.c_ulonglong(0)
        count = ctypes.c_uint()
        room = (pynvml.c_nvmlProcessUtilizationSample_t * 4)()

        def legacy(buffer, n):
            count.value = n
            return [lib.nvmlDeviceGetProcessUtilization(h, buffer, ctypes.byref(count), since), count.value]

        class Info(ctypes.Structure):  # nvmlProcessesUtilizationInfo_v1_t, whatever this pynvml has
            _fields_ = [("version", ctypes.c_uint), ("processSamplesCount", ctypes.c_uint),
                        ("lastSeenTimeStamp", ctypes.c_ulonglong), ("procUtilArray", ctypes.c_void_p)]

        info = Info((2 << 24) | ctypes.sizeof(Info), 0, 0, None)
        emit({
            "nullArray": legacy(None, 10),
            "small": legacy(room, 2),
            "roomy": legacy(room, 4) + [[room[i].pid, room[i].smUtil] for i in range(4)],
            "nullCount": lib.nvmlDeviceGetProcessUtilization(h, room, None, since),
            "nullInfo": lib.nvmlDeviceGetProcessesUtilizationInfo(h, None),
            "infoV2": [lib.nvmlDeviceGetProcessesUtilizationInfo(h, ctypes.byref(info)), info.processSamplesCount],
        })
        """
    assert nvml.run({"gpus": [H100]}, code) == {
        "nullArray": [7, 3],
        "small": [7, 3],
        "roomy": [0, 3, [1, 10], [2, 20], [3, 30], [0, 0]],  # the fourth slot is left alone
        "nullCount": 2,
        "nullInfo": 2,
        "infoV2": [25, 0],
    }


def test_set_process_utilization_refuses_a_percent_out_of_range(nvml: FakeNvml) -> None:
    nvml.driver.set_process_utilization(H100["uuid"], [(1, 10)])
    with pytest.raises(ValueError, match=r"smUtil of pid 2 on GPU-1111.* must be in \[0, 100\], not 101"):
        nvml.driver.set_process_utilization(H100["uuid"], [(2, 101)])
    assert nvml.driver.read()["processUtilization"] == {H100["uuid"]: [{"pid": 1, "smUtil": 10}]}


# ------------------------------------------------------------------------------------------------
# Per-cgroup memory limits (nvmlDevice{Set,Get}MemoryLimits_v1, driver r615 and later)
# ------------------------------------------------------------------------------------------------

needs_limits_in_pynvml = pytest.mark.skipif(
    not hasattr(pynvml, "nvmlDeviceSetMemoryLimits_v1"), reason="nvidia-ml-py before 13.615 cannot call them"
)
GIB = 1 << 30
PLAIN = {"uuid": "GPU-99999999-8888-7777-6666-555555555555", "name": "NVIDIA H100 80GB HBM3", "migMode": 0}
UNIFIED_V2 = Path("/sys/fs/cgroup/unified")  # the hybrid layout's cgroup v2 hierarchy, as on these machines


def limits_config(cgroup_root: Path | None, **keys: Any) -> dict[str, Any]:
    """A driver with memory limits, GPUs H100, A100 (MIG enabled) and PLAIN, cgroup v2 under ``cgroup_root``."""
    config = {"memoryLimits": True, "gpus": [H100, A100, PLAIN], **keys}
    if cgroup_root is not None:
        config["cgroupRoot"] = str(cgroup_root)
    return config


def cgroup_dirs(root: Path, *names: str) -> list[str]:
    """Directories ``root/<name>`` made for the fake to find (it only checks that they exist)."""
    for name in names:
        (root / name).mkdir(parents=True)
    return [str(root / name) for name in names]


HANDLES = "h0, mig, h2 = handles(3)\n"  # before a one-line snippet


@needs_limits_in_pynvml
def test_memory_limits_are_read_back_kept_by_cgroup_and_gpu_and_cleared(nvml: FakeNvml, tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    ctr, other = cgroup_dirs(root, "kubepods/pod1/ctr", "kubepods/pod1/other")
    nvml.driver.set_processes(H100["uuid"], [(1234, GIB)])
    before = time.time()
    out = nvml.run(
        limits_config(root),
        f"""
        import os
        h0, mig, h2 = handles(3)
        emit({{
            "pid": os.getpid(),
            "set": [set_limits(h0, {ctr + "/"!r}, 4 * {GIB}, 8 * {GIB}), set_limits(h2, {ctr!r}, 0, 2 * {GIB})],
            "get": [get_limits(h0, {ctr!r}), get_limits(h2, {ctr + "/"!r}), get_limits(h0, {other!r})],
        }})
        """,
    )
    after = time.time()
    assert out["set"] == [None, None]
    assert out["get"] == [[4 * GIB, 8 * GIB, 0], [0, 2 * GIB, 0], [0, LIMIT_MAX, 0]]
    stored = nvml.driver.memory_limits()
    assert set(stored) == {ctr}  # the path without its trailing slash
    assert set(stored[ctr]) == {H100["uuid"], PLAIN["uuid"]}
    for uuid, soft, hard in ((H100["uuid"], 4 * GIB, 8 * GIB), (PLAIN["uuid"], 0, 2 * GIB)):
        limit = stored[ctr][uuid]
        assert before <= limit["setAt"] <= after
        assert limit == {"soft": soft, "hard": hard, "setAt": limit["setAt"], "setBy": out["pid"]}
    assert nvml.driver.memory_limit(ctr + "/", H100["uuid"]) == stored[ctr][H100["uuid"]]
    assert nvml.driver.memory_limit(other, H100["uuid"]) is None
    state = nvml.driver.read()
    assert state["processes"] == {H100["uuid"]: [{"pid": 1234, "usedGpuMemory": GIB}]}
    assert "computeModes" not in state  # a limit's write leaves the compute modes to the config

    out = nvml.run(
        limits_config(root),
        f"""
        h0, mig, h2 = handles(3)
        clear = pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX
        emit([set_limits(h0, {ctr!r}, 0, clear), get_limits(h0, {ctr!r}), get_limits(h2, {ctr!r}),
              set_limits(h2, {ctr!r}, 0, clear)])
        """,
    )
    assert out == [None, [0, LIMIT_MAX, 0], [0, 2 * GIB, 0], None]
    assert nvml.driver.memory_limits() == {}
    assert "memoryLimits" not in nvml.driver.read()


@needs_limits_in_pynvml
def test_memory_limits_are_seen_by_another_process(nvml: FakeNvml, tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (ctr,) = cgroup_dirs(root, "kubepods/pod1/ctr")
    code = HANDLES + f"emit(get_limits(h0, {ctr!r}))\nproceed()\nemit(get_limits(h0, {ctr!r}))\n"
    with nvml.start(limits_config(root), code) as child:
        assert child.recv() == [0, LIMIT_MAX, 0]
        # Above 2**63 - 1 on purpose: the state file carries all 64 bits.
        soft, hard = (1 << 63) + 1, LIMIT_MAX - 1
        assert nvml.run(limits_config(root), HANDLES + f"emit(set_limits(h0, {ctr!r}, {soft}, {hard}))") is None
        child.go()
        assert child.recv() == [soft, hard, 0]
    limit = nvml.driver.memory_limit(ctr, H100["uuid"])
    assert limit is not None
    assert [limit["soft"], limit["hard"]] == [soft, hard]


@needs_limits_in_pynvml
def test_removing_the_cgroup_clears_its_limits(nvml: FakeNvml, tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    ctr, other = cgroup_dirs(root, "kubepods/pod1/ctr", "kubepods/pod2/ctr")
    config = limits_config(root)
    code = HANDLES + f"emit([set_limits(h0, {ctr!r}, 0, {GIB}), set_limits(h0, {other!r}, 0, {GIB})])"
    assert nvml.run(config, code) == [None, None]
    assert set(nvml.driver.memory_limits()) == {ctr, other}

    Path(ctr).rmdir()
    # Any call that reads the limits drops those of a cgroup that is gone, whichever cgroup it asks about.
    assert nvml.run(config, HANDLES + f"emit(get_limits(h0, {other!r}))") == [0, GIB, 0]
    assert set(nvml.driver.memory_limits()) == {other}
    out = nvml.run(config, HANDLES + f"emit([get_limits(h0, {ctr!r}), set_limits(h0, {ctr!r}, 0, {GIB})])")
    assert out == [["NVMLError_NotFound", 6, "Not Found"]] * 2
    Path(ctr).mkdir()
    assert nvml.run(config, HANDLES + f"emit(get_limits(h0, {ctr!r}))") == [0, LIMIT_MAX, 0]


@needs_limits_in_pynvml
def test_memory_limit_errors_change_nothing(nvml: FakeNvml, tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    ctr, missing = str(root / "kubepods/pod1/ctr"), str(root / "kubepods/pod1/missing")
    cgroup_dirs(root, "kubepods/pod1/ctr")
    (root / "kubepods/pod1/memory.max").write_text("max\n")
    nvml.driver.lose(PLAIN["uuid"])
    bad_names = [None, "", "kubepods/pod1/ctr", "/" + "a" * 4095]  # PATH_MAX (4096) counts the NUL
    not_found = [
        str(tmp_path),  # exists, outside the cgroup root
        str(root),  # the root cgroup itself
        missing,
        str(root / "kubepods/pod1/memory.max"),  # not a directory
        str(root / "kubepods/../kubepods/pod1/ctr"),  # the fake takes paths as they are written
        "/" + "a" * 4094,
    ]
    out = nvml.run(
        limits_config(root),
        f"""
        h0, mig, h2 = handles(3)
        lib = pynvml.nvmlLib
        both = lambda h, ns: [set_limits(h, ns, 0, {GIB}), get_limits(h, ns)]
        results = {{
            "nullStruct": [lib.nvmlDeviceSetMemoryLimits_v1(h0, None), lib.nvmlDeviceGetMemoryLimits_v1(h0, None)],
            "badNames": [both(h0, ns) for ns in {bad_names!r}],
            "notFound": [both(h0, ns) for ns in {not_found!r}],
            "softAboveHard": set_limits(h0, {ctr!r}, 2 * {GIB}, {GIB}),
            "hardZero": set_limits(h0, {ctr!r}, 0, 0),
            "mig": both(mig, {ctr!r}),
            "lost": both(h2, {ctr!r}),
        }}
        pynvml.nvmlShutdown()
        results["uninitialized"] = both(h0, {ctr!r})
        emit(results)
        """,
    )
    invalid = ["NVMLError_InvalidArgument", 2, "Invalid Argument"]
    assert out["nullStruct"] == [2, 2]
    assert out["badNames"] == [[invalid, invalid]] * len(bad_names)
    assert out["notFound"] == [[["NVMLError_NotFound", 6, "Not Found"]] * 2] * len(not_found)
    assert out["softAboveHard"] == out["hardZero"] == invalid
    assert out["mig"] == [["NVMLError_NotSupported", 3, "Not Supported"]] * 2
    assert out["lost"] == [["NVMLError_GpuIsLost", 15, "GPU is lost"]] * 2
    assert [e[:2] for e in out["uninitialized"]] == [["NVMLError_Uninitialized", 1]] * 2
    assert nvml.driver.read() == {"lost": [PLAIN["uuid"]]}


@needs_limits_in_pynvml
def test_setting_a_memory_limit_needs_root_and_without_a_state_file_stays_in_the_process(
    nvml: FakeNvml, tmp_path: Path
) -> None:
    root = tmp_path / "cgroup"
    (ctr,) = cgroup_dirs(root, "kubepods/pod1/ctr")
    out = nvml.run(
        limits_config(root),
        f"""
        import os
        h0, mig, h2 = handles(3)
        was_root = os.geteuid() == 0
        if was_root:
            os.seteuid(65534)  # no state file to read: nothing else needs root's access to the test's files
        refused = set_limits(h0, {ctr!r}, 0, {GIB})
        if was_root:
            os.seteuid(0)
        emit({{"refused": refused, "unset": get_limits(h0, {ctr!r}), "set": set_limits(h0, {ctr!r}, 0, {GIB}),
              "readBack": get_limits(h0, {ctr!r})}})
        """,
        shared_state=False,
    )
    assert out == {
        "refused": ["NVMLError_NoPermission", 4, "Insufficient Permissions"],
        "unset": [0, LIMIT_MAX, 0],
        "set": None,
        "readBack": [0, GIB, 0],
    }
    assert not nvml.state_path.exists()
    assert nvml.run(limits_config(root), HANDLES + f"emit(get_limits(h0, {ctr!r}))", shared_state=False) == [
        0,
        LIMIT_MAX,
        0,
    ]


@needs_limits_in_pynvml
@pytest.mark.parametrize("config", [CONFIG, {**CONFIG, "memoryLimits": False}], ids=["default", "false"])
def test_memory_limits_are_function_not_found_before_driver_r615(nvml: FakeNvml, config: dict[str, Any]) -> None:
    out = nvml.run(
        config,
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        emit([set_limits(h, "/sys/fs/cgroup", 0, 1 << 30), get_limits(h, "/sys/fs/cgroup")])
        """,
    )
    assert [e[:2] for e in out] == [["NVMLError_FunctionNotFound", 13]] * 2


@needs_limits_in_pynvml
def test_the_cgroup_layout_says_where_cgroup_v2_is(nvml: FakeNvml, tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (ctr,) = cgroup_dirs(root, "kubepods/pod1/ctr")
    code = HANDLES + f"emit([set_limits(h0, {ctr!r}, 0, {GIB}), get_limits(h0, {ctr!r})])"
    # No cgroup v2 at all: not supported, whatever the directory.
    out = nvml.run(limits_config(root, cgroupLayout="legacy"), code)
    assert out == [["NVMLError_NotSupported", 3, "Not Supported"]] * 2
    # Pure cgroup v2 (the default): cgroups are below /sys/fs/cgroup, which the test's directory is not.
    out = nvml.run(limits_config(None), code)
    assert out == [["NVMLError_NotFound", 6, "Not Found"]] * 2


@pytest.fixture
def v2_cgroup() -> Iterator[PodCgroup]:
    """A real cgroup v2 directory under /sys/fs/cgroup/unified, removed afterwards."""
    if not (UNIFIED_V2 / "cgroup.procs").is_file():
        pytest.skip(f"no cgroup v2 hierarchy at {UNIFIED_V2} (the hybrid layout)")
    try:
        cgroup = PodCgroup(UNIFIED_V2)
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {UNIFIED_V2}: {exc}")
    try:
        yield cgroup
    finally:
        cgroup.remove()


@needs_limits_in_pynvml
def test_current_used_counts_the_processes_in_the_cgroup_and_below(nvml: FakeNvml, v2_cgroup: PodCgroup) -> None:
    ctr, pod = v2_cgroup.path, v2_cgroup.path.parent
    sibling = pod / "sibling"
    sibling.mkdir()
    sleepers: list[subprocess.Popen[bytes]] = []
    try:
        for cgroup in (ctr, ctr, pod, None):
            sleepers.append(subprocess.Popen(["sleep", str(SUBPROCESS_TIMEOUT_S)]))
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(f"{sleepers[-1].pid}\n")
        in_ctr, in_ctr_unknown, in_pod, gone = (p.pid for p in sleepers)
        sleepers[-1].kill()
        sleepers[-1].wait(timeout=SUBPROCESS_TIMEOUT_S)
        driver = nvml.driver
        driver.set_processes(
            H100["uuid"], [(in_ctr, GIB), (in_ctr_unknown, None), (os.getpid(), 2 * GIB), (gone, 5 * GIB)]
        )
        driver.set_processes(H100["uuid"], [(in_ctr, GIB), (in_pod, 3 * GIB)], mps=True)  # in_ctr counts once
        driver.set_processes(PLAIN["uuid"], [(in_ctr, 7 * GIB)])
        # The hybrid layout: cgroup v2 at /sys/fs/cgroup/unified, whatever /proc/<pid>/cgroup's "0::" line says.
        out = nvml.run(
            limits_config(None, cgroupLayout="hybrid"),
            f"""
            h0, mig, h2 = handles(3)
            emit({{
                "pod": get_limits(h0, {str(pod)!r}),
                "ctr": get_limits(h0, {str(ctr)!r}),
                "sibling": get_limits(h0, {str(sibling)!r}),
                "otherGpu": get_limits(h2, {str(pod)!r}),
                "set": set_limits(h0, {str(ctr)!r}, {GIB}, 2 * {GIB}),
                "limited": get_limits(h0, {str(ctr)!r}),
                "outsideRoot": get_limits(h0, "/sys/fs/cgroup"),
            }})
            """,
        )
        assert out == {
            "pod": [0, LIMIT_MAX, 4 * GIB],
            "ctr": [0, LIMIT_MAX, GIB],
            "sibling": [0, LIMIT_MAX, 0],
            "otherGpu": [0, LIMIT_MAX, 7 * GIB],
            "set": None,
            "limited": [GIB, 2 * GIB, GIB],
            "outsideRoot": ["NVMLError_NotFound", 6, "Not Found"],
        }
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait(timeout=SUBPROCESS_TIMEOUT_S)
        sibling.rmdir()
