#!/usr/bin/env python3
"""The hardware check: proves on a real GPU what the test suite cannot (see docs/hardware-check.md).

It starts the agent as a real process (GPUs through NVML) against the test suite's fake kubelet and fake
pod-resources server, makes grants through `Allocate`, reads the MPS control daemon's defaults (the ceilings)
back, runs CUDA clients that allocate GPU memory under each grant's environment, stops the agent, and writes
`DIR/hardware-check.json` and `DIR/hardware-check.md` (a table to paste into docs/hardware-check.md). The agent
is started once per configuration:
- main (`grants: equal`, GPU 0 as 4 replicas): 1 replica is capped at 1/4 (50 % fails, 20 % fits), all 4 are
  the whole GPU (50 % fits);
- proportional (`grants: proportional`, 4 replicas): 2 of 4 are half the GPU: 45 % fits, 55 % fails, also with
  the cap variables unset (the daemon's ceiling holds);
- units (`memoryUnit: 8Gi`): 2 units are 16 GiB: 15 GiB fits, 17 GiB fails;
- two GPUs (only with 2 or more): a container granted the whole GPU 0 of a resource on GPUs 0 and 1; its client,
  without CUDA_VISIBLE_DEVICES, lists the devices it sees through MPS and allocates 1 GiB on GPU 1. Recorded, not
  judged: on the host no container runtime hides GPU 1's device node.
Exit status: 0 when every check that ran passed, 1 otherwise, 2 on bad usage.

On the GPU node, as root, from the repository root (about a minute; needs the NVIDIA driver, which brings
`nvidia-smi`, `nvidia-cuda-mps-control` and `libcuda.so.1`; nothing else CUDA is needed):

    python3 -m venv /tmp/hwc-venv
    /tmp/hwc-venv/bin/pip install -e . grpcio grpcio-tools      # or -e '.[test]'
    /tmp/hwc-venv/bin/python scripts/hardware_check.py --out /tmp/hwc-out

No network there? Build the wheel folder build/hwc-wheels on a machine with network and bring it along; then
`pip install --no-index --find-links build/hwc-wheels mpsagent grpcio grpcio-tools` instead (docs/hardware-check.md
has both commands, and a fallback for a Python without pip; with the wheels, run it with the repository first on
`PYTHONPATH`). The agent it starts runs the checkout's mpsagent either way: the repository goes first on its
PYTHONPATH. The fakes come from the test support package `mpsagent_testing`, which the install brings.

Without a GPU (what tests/tools/test_hardware_check.py runs; every CUDA and compute-mode step is reported
"skipped (no GPU)"):

    .venv/bin/python scripts/hardware_check.py --dry-run-snapshot NODE.json --out /tmp/hwc-out

The CUDA client is this same file run with `--probe BYTES`; it uses only the standard library and the driver API
in `libcuda.so.1` (ctypes) by default, or PyTorch / CuPy with `--probe-backend torch|cupy|auto`, and
`--probe-python` picks the interpreter that has them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

RESOURCE = "nvidia.com/gpu"
UNIT_RESOURCE = "nvidia.com/gpu-mem"
REPLICAS = 4
MIB = 1024 * 1024
GIB = 1024 * MIB
UNIT_GIB = 8
UNITS_GRANTED = 2
PROBE_PREFIX = "HWC-PROBE "
WORK_MARKER_ENV = "MPSAGENT_HWC_WORK_DIR"
SKIPPED_NO_GPU = "skipped (no GPU)"
SKIPPED_ONE_GPU = "skipped (needs 2 GPUs)"
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
ANSWER_CHECK = "get_default_active_thread_percentage"
"""Ends every control session the check sends: it always prints, so a session that printed nothing went unanswered."""
CONTROL_RETRY_S = 3.0
OBSERVED_METRICS = ("mpsagent_mps_clients", "mpsagent_container_gpu_memory_bytes", "mpsagent_daemon_cap_mode")


def _config(*, grants: str | None, name: str, devices: str, size: str) -> str:
    """One resource on `devices`; `size` is its `replicas: N` or `memoryUnit: Q`; no `grants`: the default."""
    grants_line = f"\n    grants: {grants}" if grants else ""
    return f"""version: v1
sharing:
  mps:
    failRequestsGreaterThanOne: false{grants_line}
    resources:
    - name: {name}
      devices: {devices}
      {size}
"""


@dataclass(frozen=True)
class AgentRun:
    """One start of the agent: its name in check IDs and log files, the resource it serves, its configuration."""

    name: str
    resource: str
    config: str


MAIN = AgentRun("main", RESOURCE, _config(grants=None, name="gpu", devices="[0]", size=f"replicas: {REPLICAS}"))
PROPORTIONAL = AgentRun(
    "proportional",
    RESOURCE,
    _config(grants="proportional", name="gpu", devices="[0]", size=f"replicas: {REPLICAS}"),
)
UNITS = AgentRun(
    "units",
    UNIT_RESOURCE,
    _config(grants="proportional", name="gpu-mem", devices="[0]", size=f"memoryUnit: {UNIT_GIB}Gi"),
)
TWO_GPUS = AgentRun(
    "two-gpus",
    RESOURCE,
    _config(grants="proportional", name="gpu", devices="[0, 1]", size=f"replicas: {REPLICAS}"),
)


# --- the CUDA client (`--probe`): standard library only, run in a child process ----------------------------


class CudaCallError(Exception):
    def __init__(self, function: str, code: int, name: str) -> None:
        super().__init__(f"{function} returned {name} ({code})")
        self.function = function
        self.code = code


class _DriverApi:
    """The few CUDA driver API calls the probe needs, through ctypes (CUresult is an int, CUdevice an int,
    CUdeviceptr an unsigned long long, sizes size_t, CUcontext a pointer)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        c_int, c_uint, c_size_t, c_void_p = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p
        ptr = ctypes.POINTER
        self._declare("cuInit", [c_uint])
        self._declare("cuDriverGetVersion", [ptr(c_int)])
        self._declare("cuDeviceGetCount", [ptr(c_int)])
        self._declare("cuDeviceGet", [ptr(c_int), c_int])
        self._declare("cuDeviceGetUuid", [ctypes.c_char_p, c_int])
        self._declare("cuDeviceGetName", [ctypes.c_char_p, c_int, c_int])
        self._declare("cuDeviceTotalMem_v2", [ptr(c_size_t), c_int])
        self._declare("cuDeviceGetAttribute", [ptr(c_int), c_int, c_int])
        self._declare("cuDevicePrimaryCtxRetain", [ptr(c_void_p), c_int])
        self._declare("cuCtxSetCurrent", [c_void_p])
        self._declare("cuCtxSynchronize", [])
        self._declare("cuMemGetInfo_v2", [ptr(c_size_t), ptr(c_size_t)])
        self._declare("cuMemAlloc_v2", [ptr(ctypes.c_ulonglong), c_size_t])
        self._declare("cuMemsetD8_v2", [ctypes.c_ulonglong, ctypes.c_ubyte, c_size_t])
        self._declare("cuMemFree_v2", [ctypes.c_ulonglong])
        self._declare("cuGetErrorName", [c_int, ptr(ctypes.c_char_p)])
        # cuDevicePrimaryCtxRelease is _v2 since CUDA 11; older drivers have only the plain name.
        self.release_name = (
            "cuDevicePrimaryCtxRelease_v2"
            if hasattr(self.lib, "cuDevicePrimaryCtxRelease_v2")
            else "cuDevicePrimaryCtxRelease"
        )
        self._declare(self.release_name, [c_int])

    def _declare(self, name: str, argtypes: list[Any]) -> None:
        function = getattr(self.lib, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
        return f"CUresult {code}"

    def call(self, name: str, *args: Any) -> None:
        code = int(getattr(self.lib, name)(*args))
        if code != 0:
            raise CudaCallError(name, code, self.error_name(code))


def _uuid_text(raw: bytes) -> str:
    hex_ = raw.hex()
    return f"GPU-{hex_[:8]}-{hex_[8:12]}-{hex_[12:16]}-{hex_[16:20]}-{hex_[20:32]}"


def _driver_devices(api: _DriverApi) -> list[dict[str, Any]]:
    """Every device this client sees (through MPS: the server's devices, as the client's environment filters them)."""
    count = ctypes.c_int()
    api.call("cuDeviceGetCount", ctypes.byref(count))
    devices = []
    for ordinal in range(count.value):
        device = ctypes.c_int()
        api.call("cuDeviceGet", ctypes.byref(device), ordinal)
        name = ctypes.create_string_buffer(256)
        api.call("cuDeviceGetName", name, 256, device)
        uuid = ctypes.create_string_buffer(16)
        api.call("cuDeviceGetUuid", uuid, device)
        devices.append({"ordinal": ordinal, "name": name.value.decode(errors="replace"), "uuid": _uuid_text(uuid.raw)})
    return devices


def _probe_driver(nbytes: int, ordinal: int, result: dict[str, Any]) -> Callable[[], None]:
    """Allocate `nbytes` with cuMemAlloc on device `ordinal`'s primary context; returns what frees it again."""
    try:
        api = _DriverApi()
    except (OSError, AttributeError) as exc:
        result["stage"] = "load"
        raise RuntimeError(f"libcuda.so.1 not usable: {exc}") from exc
    result["stage"] = "init"
    api.call("cuInit", 0)
    version = ctypes.c_int()
    api.call("cuDriverGetVersion", ctypes.byref(version))
    result["cudaDriverVersion"] = version.value
    result["stage"] = "device"
    result["devices"] = _driver_devices(api)
    device = ctypes.c_int()
    api.call("cuDeviceGet", ctypes.byref(device), ordinal)
    name = ctypes.create_string_buffer(256)
    api.call("cuDeviceGetName", name, 256, device)
    result["device"] = name.value.decode(errors="replace")
    total = ctypes.c_size_t()
    api.call("cuDeviceTotalMem_v2", ctypes.byref(total), device)
    result["total"] = total.value
    sm_count = ctypes.c_int()
    api.call("cuDeviceGetAttribute", ctypes.byref(sm_count), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)
    result["smCount"] = sm_count.value
    result["stage"] = "context"  # under MPS this is where the client connects to the server
    context = ctypes.c_void_p()
    api.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    api.call("cuCtxSetCurrent", context)
    free, total_in_context = ctypes.c_size_t(), ctypes.c_size_t()
    api.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total_in_context))
    result["memGetInfo"] = {"free": free.value, "total": total_in_context.value}
    result["stage"] = "alloc"
    pointer = ctypes.c_ulonglong()
    api.call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(nbytes))
    result["stage"] = "memset"  # touch every byte, so the allocation is really backed
    api.call("cuMemsetD8_v2", pointer, 0, ctypes.c_size_t(nbytes))
    api.call("cuCtxSynchronize")

    def free_it() -> None:
        api.lib.cuMemFree_v2(pointer)
        getattr(api.lib, api.release_name)(device)

    return free_it


def _probe_torch(nbytes: int, ordinal: int, result: dict[str, Any]) -> Callable[[], None]:
    result["stage"] = "load"
    import torch  # noqa: PLC0415 - optional, only in the child

    result["stage"] = "init"
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    devices = []
    for index in range(torch.cuda.device_count()):
        seen = torch.cuda.get_device_properties(index)
        devices.append({"ordinal": index, "name": seen.name, "uuid": f"GPU-{getattr(seen, 'uuid', '?')}"})
    result["devices"] = devices
    properties = torch.cuda.get_device_properties(ordinal)
    result.update(device=properties.name, total=properties.total_memory, smCount=properties.multi_processor_count)
    result["stage"] = "context"
    free, total = torch.cuda.mem_get_info(ordinal)
    result["memGetInfo"] = {"free": free, "total": total}
    result["stage"] = "alloc"
    tensor = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{ordinal}")
    result["stage"] = "memset"
    tensor.zero_()
    torch.cuda.synchronize()
    holder = [tensor]
    return holder.clear


def _probe_cupy(nbytes: int, ordinal: int, result: dict[str, Any]) -> Callable[[], None]:
    result["stage"] = "load"
    import cupy  # noqa: PLC0415 - optional, only in the child

    result["stage"] = "device"
    result["devices"] = [{"ordinal": i} for i in range(cupy.cuda.runtime.getDeviceCount())]
    device = cupy.cuda.Device(ordinal)
    device.use()
    result["smCount"] = device.attributes.get("MultiProcessorCount")
    result["stage"] = "context"
    free, total = device.mem_info
    result.update(total=total, memGetInfo={"free": free, "total": total})
    result["stage"] = "alloc"
    array = cupy.empty(nbytes, dtype=cupy.uint8)
    result["stage"] = "memset"
    array.fill(0)
    cupy.cuda.runtime.deviceSynchronize()
    holder = [array]
    return holder.clear


PROBES: dict[str, Callable[[int, int, dict[str, Any]], Callable[[], None]]] = {
    "driver": _probe_driver,
    "torch": _probe_torch,
    "cupy": _probe_cupy,
}


def _is_out_of_memory(exc: BaseException, stage: str) -> bool:
    if isinstance(exc, CudaCallError):
        return exc.code == CUDA_ERROR_OUT_OF_MEMORY and stage == "alloc"
    text = f"{type(exc).__name__} {exc}".lower()
    return stage == "alloc" and ("outofmemory" in text or "out of memory" in text)


def _hold_expired(*_: object) -> None:
    raise TimeoutError("held long enough")


def probe_main(nbytes: int, ordinal: int, backend: str, hold_s: float) -> int:
    """Print one line `HWC-PROBE {"ok": ..., "error": ..., "bytes": n, "total": ...}`; with `hold_s`, keep the
    allocation (and the MPS connection) until stdin closes or `hold_s` passes, so the parent can look at it."""
    result: dict[str, Any] = {"backend": backend, "ok": False, "oom": False, "error": None, "stage": "start"}
    result.update(bytes=nbytes, ordinal=ordinal, total=None, device=None, devices=None, smCount=None, memGetInfo=None)
    release: Callable[[], None] | None = None
    try:
        release = PROBES[backend](nbytes, ordinal, result)
        result["ok"] = True
        result["stage"] = "done"
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["oom"] = _is_out_of_memory(exc, str(result["stage"]))
    print(PROBE_PREFIX + json.dumps(result), flush=True)
    if hold_s > 0:
        signal.signal(signal.SIGALRM, _hold_expired)
        signal.alarm(max(1, int(hold_s)))
        with contextlib.suppress(OSError, TimeoutError):
            sys.stdin.read()  # the parent closes stdin when it has looked
        signal.alarm(0)
    if release is not None:
        with contextlib.suppress(Exception):
            release()
    return 0


# --- the report ------------------------------------------------------------------------------------------------


@dataclass
class Check:
    id: str
    step: str
    expected: str
    observed: str
    result: str  # pass, FAIL, info, or skipped (...)


@dataclass
class Report:
    mode: str
    started: float = field(default_factory=time.monotonic)
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, id_: str, step: str, expected: str, observed: object, ok: bool | None) -> Check:
        result = "info" if ok is None else ("pass" if ok else "FAIL")
        check = Check(id_, step, expected, _text(observed), result)
        self.checks.append(check)
        say(f"{result:>7}  {step}: {check.observed}")
        return check

    def skip(self, id_: str, step: str, expected: str, why: str = SKIPPED_NO_GPU) -> None:
        self.checks.append(Check(id_, step, expected, "", why))
        say(f"{'skipped':>7}  {step}: {why}")

    @property
    def passed(self) -> bool:
        ran = [c for c in self.checks if c.result in ("pass", "FAIL")]
        return bool(ran) and all(c.result == "pass" for c in ran)

    def markdown(self) -> str:
        lines = [
            f"Mode: {self.mode}; {self.facts.get('summary', '')}".rstrip("; "),
            "",
            "| # | step | expected | observed | result |",
            "|---|---|---|---|---|",
        ]
        for number, check in enumerate(self.checks, 1):
            cells = [str(number), check.step, check.expected, check.observed, check.result]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        verdict = "every check that ran passed" if self.passed else "SOME CHECKS FAILED"
        lines += ["", f"Result: {verdict} ({time.monotonic() - self.started:.1f} s)."]
        return "\n".join(lines) + "\n"

    def write(self, out: Path) -> None:
        document = {
            "mode": self.mode,
            "passed": self.passed,
            "runtimeSeconds": round(time.monotonic() - self.started, 1),
            "facts": self.facts,
            "checks": [asdict(c) for c in self.checks],
        }
        (out / "hardware-check.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
        (out / "hardware-check.md").write_text(self.markdown())


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>") or " "


_T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[hwc {time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# --- helpers ---------------------------------------------------------------------------------------------------


def memory_read_back(mib: int) -> str:
    """How the control daemon prints a pinned-memory limit (the agent's own rule, from mpsagent.mps.commands)."""
    from mpsagent.mps.commands import memory_read_back as rule  # noqa: PLC0415 - the CUDA client needs no mpsagent

    return rule(mib)


def wait_until(condition: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def run_text(argv: list[str], timeout: float = 30, env: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"<{type(exc).__name__}: {exc}>"
    return done.returncode, (done.stdout.strip() or done.stderr.strip())


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"<{path} not readable>"


class Interrupted(BaseException):
    """SIGTERM (e.g. a timeout around the whole run): unwind through every `finally`, so cleanup runs."""


def _on_sigterm(*_: object) -> None:
    raise Interrupted("SIGTERM")


# --- the run ---------------------------------------------------------------------------------------------------


class HardwareCheck:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry_run = args.dry_run_snapshot is not None
        self.report = Report(mode="dry run (node snapshot, no GPU)" if self.dry_run else "hardware")
        self.work = Path(tempfile.mkdtemp(prefix="hwc-", dir="/tmp"))
        self.work.chmod(0o711)  # another user reaches the pipe directory through it, as a client container does
        self.mps_root = self.work / "mps"
        self.run = MAIN
        self.runs: list[AgentRun] = []
        self.mps_control = shutil.which("nvidia-cuda-mps-control") or "nvidia-cuda-mps-control"
        self.agent: subprocess.Popen[bytes] | None = None
        self.kubelet: Any = None
        self.pod_resources: Any = None
        self.plugin: Any = None
        self.children: list[subprocess.Popen[bytes]] = []
        self.plugins_before: list[Any] = []
        self.daemon_pid: int | None = None
        self.server_pids: set[int] = set()
        self.compute_mode_before: str | None = None
        self.backend = "driver"
        self.deadline = time.monotonic() + args.budget_seconds
        self.report.facts["workDir"] = str(self.work)
        self.report.facts["host"] = platform.node()
        self.report.facts["python"] = sys.version.split()[0]

    @property
    def pipe(self) -> Path:
        return self.mps_root / self.run.resource / "pipe"

    @property
    def agent_log(self) -> Path:
        return self.work / _log_name("agent", self.run)

    # -- the steps ----------------------------------------------------------------------------------------------

    def execute(self) -> None:
        self.preflight()
        plan = self.plan()
        gpu = next(g for g in plan["gpus"] if g["index"] == 0)
        self.report.facts.update(gpu=gpu, driverVersion=plan.get("driverVersion"))
        self.report.facts["summary"] = (
            f"{gpu['name']} ({gpu['memoryBytes'] / 1024**3:.1f} GiB), driver {plan.get('driverVersion')}, "
            f"mpsagent from {ROOT}"
        )
        self.start_fakes()
        self.main_run(gpu)
        self.proportional_run(gpu)
        self.memory_unit_run(gpu)
        self.two_gpu_run(sorted(plan["gpus"], key=lambda g: int(g["index"])))
        self.finish()

    def main_run(self, gpu: dict[str, Any]) -> None:
        """`grants: equal` (the default): one replica is capped at 1/4, all four are the whole GPU."""
        full_mib = gpu["memoryBytes"] // MIB
        capped_mib = gpu["memoryBytes"] // REPLICAS // MIB  # the NVIDIA plugin's figure
        ids = self.start_run(MAIN, REPLICAS)
        self.compute_mode("compute-mode-serving", "compute mode while the agent serves", "Exclusive_Process")
        self.daemon_reads("start", "no grant yet", "100.0", memory_read_back(full_mib))

        # A capped grant: one replica.
        envs = self.allocate(ids[:1], "capped", "main")
        expected_capped = {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // REPLICAS),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={capped_mib}M",
            "CUDA_MPS_PIPE_DIRECTORY": f"/mps/{RESOURCE}/pipe",
            "NVIDIA_VISIBLE_DEVICES": gpu["uuid"],
        }
        self.report.add(
            "capped-envs",
            "Allocate 1 replica: the container's environment",
            _text(expected_capped),
            envs,
            envs == expected_capped,
        )
        self.daemon_reads("capped", "after the capped Allocate", f"{100 / REPLICAS:.1f}", memory_read_back(capped_mib))
        self.cap_mode_metric("capped")
        self.control_log_checks(capped_mib)
        half, fifth = gpu["memoryBytes"] // 2, gpu["memoryBytes"] // 5
        self.probe("probe-a", "capped client allocates 50 %", envs, half, expect_ok=False)
        self.probe(
            "probe-b", "capped client without its cap variables allocates 50 %", _uncapped(envs), half, expect_ok=False
        )
        self.probe("probe-c", "capped client allocates 20 %", envs, fifth, expect_ok=True, observe="capped")
        # The environment's old shape: an entry for an ordinal the client cannot see (it sees GPU 0 only). On driver
        # 615 NVIDIA measured every pinned limit dropped by it; the daemon's ceiling must still hold the client.
        unseen = {**envs, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={capped_mib}M,1={capped_mib}M"}
        self.probe(
            "probe-unseen-ordinal",
            "capped client whose CUDA_MPS_PINNED_DEVICE_MEM_LIMIT names an ordinal it cannot see allocates 50 %",
            unseen,
            half,
            expect_ok=False,
        )
        self.driver_limit_checks(gpu, envs, capped_mib)

        # The capped container ends (the kubelet lists it no more), then a full grant: every replica.
        self.pod_resources.set_containers()
        envs = self.allocate(ids, "full", "main")
        expected_full = {"CUDA_MPS_PIPE_DIRECTORY": f"/mps/{RESOURCE}/pipe", "NVIDIA_VISIBLE_DEVICES": gpu["uuid"]}
        self.report.add(
            "full-envs",
            f"Allocate all {REPLICAS} replicas: the container's environment (no caps)",
            _text(expected_full),
            envs,
            envs == expected_full,
        )
        self.daemon_reads("full", "after the full Allocate", "100.0", memory_read_back(full_mib))
        self.cap_mode_metric("full")
        if self.server_pids:  # started while capped: the agent must have raised it to the full hardware
            self.server_values("server-values-after-full-allocate", "running MPS server after the full Allocate")
        self.probe("probe-d", "full-grant client allocates 50 %", envs, half, expect_ok=True, observe="full")
        self.stop_agent()

    def proportional_run(self, gpu: dict[str, Any]) -> None:
        """`grants: proportional`: 2 of 4 replicas are half the GPU, and the daemon's ceiling holds half."""
        ids = self.start_run(PROPORTIONAL, REPLICAS)
        half_mib = gpu["memoryBytes"] * 2 // REPLICAS // MIB
        envs = self.allocate(ids[:2], "proportional", "main")
        expected = {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={half_mib}M",
            "CUDA_MPS_PIPE_DIRECTORY": f"/mps/{RESOURCE}/pipe",
            "NVIDIA_VISIBLE_DEVICES": gpu["uuid"],
        }
        self.report.add(
            "proportional-envs",
            f"grants: proportional, Allocate 2 of {REPLICAS} replicas: the container's environment",
            _text(expected),
            envs,
            envs == expected,
        )
        self.daemon_reads("proportional", "after the 2/4 Allocate (the ceilings)", "50.0", memory_read_back(half_mib))
        memory = gpu["memoryBytes"]
        self.probe("probe-e", "2/4 client allocates 45 %", envs, memory * 45 // 100, expect_ok=True)
        self.probe("probe-f", "2/4 client allocates 55 %", envs, memory * 55 // 100, expect_ok=False)
        self.probe(
            "probe-g",
            "2/4 client without its cap variables allocates 55 %",
            _uncapped(envs),
            memory * 55 // 100,
            expect_ok=False,
        )
        self.stop_agent()

    def memory_unit_run(self, gpu: dict[str, Any]) -> None:
        """A memory-unit resource: 2 units of 8Gi are exactly 16 GiB, whatever the GPU."""
        units = gpu["memoryBytes"] // (UNIT_GIB * GIB)
        if units < UNITS_GRANTED + 1:
            self.report.skip("units-envs", "memory units: Allocate 2 units", "", f"skipped (GPU has {units} units)")
            return
        ids = self.start_run(UNITS, units)
        granted_mib = UNITS_GRANTED * UNIT_GIB * 1024
        envs = self.allocate(ids[:UNITS_GRANTED], "units", "main")
        expected = {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, 100 * UNITS_GRANTED // units)),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={granted_mib}M",
            "CUDA_MPS_PIPE_DIRECTORY": f"/mps/{UNIT_RESOURCE}/pipe",
            "NVIDIA_VISIBLE_DEVICES": gpu["uuid"],
        }
        self.report.add(
            "units-envs",
            f"memoryUnit {UNIT_GIB}Gi, Allocate {UNITS_GRANTED} of {units} units: the container's environment",
            _text(expected),
            envs,
            envs == expected,
        )
        self.daemon_reads(
            "units",
            f"after the {UNITS_GRANTED}-unit Allocate (the ceilings)",
            f"{max(1, 100 * UNITS_GRANTED // units):.1f}",
            memory_read_back(granted_mib),
        )
        self.probe("probe-h", f"{UNITS_GRANTED}-unit client allocates", envs, 15 * GIB, expect_ok=True)
        self.probe("probe-i", f"{UNITS_GRANTED}-unit client allocates", envs, 17 * GIB, expect_ok=False)
        self.stop_agent()

    def two_gpu_run(self, gpus: list[dict[str, Any]]) -> None:
        """A container holding GPU 0 whole, on a daemon that serves GPUs 0 and 1: what its client sees through MPS,
        and whether it can allocate on GPU 1. Recorded, not judged: on the host no container runtime hides the
        other GPU's device node, so this is what MPS alone allows."""
        step = "client holding GPU 0 (whole) sees through MPS, allocates 1 GiB on the GPU it does not hold"
        if len(gpus) < 2:
            self.report.skip("other-gpu", step, "recorded", SKIPPED_ONE_GPU)
            return
        ids = self.start_run(TWO_GPUS, 2 * REPLICAS)
        held = [i for i in ids if i.startswith(gpus[0]["uuid"] + "::")]
        envs = self.allocate(held, "two-gpus", "main")
        whole_gpu0 = {"CUDA_MPS_PIPE_DIRECTORY": f"/mps/{RESOURCE}/pipe", "NVIDIA_VISIBLE_DEVICES": gpus[0]["uuid"]}
        self.report.add(
            "two-gpus-envs",
            f"GPUs 0 and 1, Allocate the {REPLICAS} replicas of GPU 0: the container's environment (no caps)",
            _text(whole_gpu0),
            envs,
            envs == whole_gpu0,
        )
        whole_gpu1 = memory_read_back(gpus[1]["memoryBytes"] // MIB)
        self.daemon_reads("two-gpus", "after the GPU 0 Allocate (no grant holds GPU 1)", "100.0", whole_gpu1, ordinal=1)
        expected = f"recorded (GPU 1 is {gpus[1]['uuid']})"
        if self.dry_run:
            self.report.skip("other-gpu", step, expected)
        else:

            def record(result: dict[str, Any]) -> bool:
                self.report.add("other-gpu", step, expected, _other_gpu_seen(result), None)
                return True

            self.run_probe("other-gpu", step, expected, envs, GIB, judge=record, ordinal=1, visible=None)
        self.stop_agent()

    def start_run(self, run: AgentRun, expected_ids: int) -> list[str]:
        """Start the agent with `run`'s configuration (the kubelet lists no container yet) until it registers."""
        self.run = run
        self.runs.append(run)
        self.daemon_pid = None
        self.pod_resources.set_containers()
        (self.work / _log_name("config", run, ".yaml")).write_text(run.config)
        self.start_agent()
        self.wait_registered()
        ids = sorted(device[0] for device in self.plugin.latest())
        self.report.add(
            _check_id("registered", run),
            f"agent registers and lists the device IDs ({run.name})",
            f"{expected_ids} IDs of {run.resource}",
            f"{len(ids)} IDs: {', '.join(ids)}",
            len(ids) == expected_ids,
        )
        return ids

    def finish(self) -> None:
        from mpsagent_testing.processes import processes_using  # noqa: PLC0415 - the CUDA client runs on any Python

        if self.dry_run:
            self.report.skip("compute-mode-restored", "compute mode after the agent stopped", "Default")
        else:
            before = self.compute_mode_before or "Default"
            self.compute_mode("compute-mode-restored", "compute mode after the agent stopped", before)
        wait_until(lambda: not processes_using(self.work), 10)
        left = processes_using(self.work)
        self.report.add(
            "nothing-left",
            "no process of this run is left (agent, daemon, servers, clients)",
            "none",
            f"PIDs {left}" if left else "none",
            not left,
        )

    def preflight(self) -> None:
        if self.dry_run:
            self.report.skip("compute-mode-before", "compute mode before the agent starts", "Default")
            return
        code, text = run_text(
            ["nvidia-smi", "-i", "0", "--query-gpu=name,memory.total,memory.used,compute_mode", "--format=csv,noheader"]
        )
        self.report.add("nvidia-smi", "nvidia-smi sees GPU 0", "name, memory, compute mode", text, code == 0)
        self.compute_mode_before = self.read_compute_mode()
        self.report.add(
            "compute-mode-before", "compute mode before the agent starts", "Default", self.compute_mode_before, None
        )
        if self.args.probe_backend == "auto":
            for candidate in ("torch", "cupy"):
                check = f"import importlib.util,sys; sys.exit(importlib.util.find_spec('{candidate}') is None)"
                if run_text([self.args.probe_python, "-c", check], timeout=60)[0] == 0:
                    self.backend = candidate
                    break
        else:
            self.backend = self.args.probe_backend
        self.report.add(
            "probe-backend",
            "CUDA client used for the probes",
            "driver (ctypes, libcuda.so.1) unless asked otherwise",
            f"{self.backend} with {self.args.probe_python}",
            None,
        )

    def common_args(self) -> list[str]:
        gpus = ["--node-snapshot", str(self.args.dry_run_snapshot)] if self.dry_run else []
        return [
            "--config-file",
            str(self.work / _log_name("config", self.run, ".yaml")),
            "--mps-root",
            str(self.mps_root),
            "--nfd-features-file",
            "",
            *gpus,
        ]

    def agent_env(self) -> dict[str, str]:
        python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        # The marker lets the cleanup find the agent and everything it started (the daemon inherits it).
        return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path, WORK_MARKER_ENV: str(self.work)}

    def plan(self) -> dict[str, Any]:
        (self.work / _log_name("config", MAIN, ".yaml")).write_text(MAIN.config)
        argv = [sys.executable, "-m", "mpsagent", "--once", "--output", "json", *self.common_args()]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, cwd=ROOT, env=self.agent_env(), check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"`mpsagent --once` failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        plan: dict[str, Any] = json.loads(done.stdout)
        resource = plan["resources"][0]
        self.report.facts["plan"] = {"ceilings": resource.get("ceilings"), "computeMode": resource.get("computeMode")}
        return plan

    def start_fakes(self) -> None:
        from mpsagent_testing.kubelet.fake import FakeKubelet  # noqa: PLC0415 - needs grpcio (the test extra)
        from mpsagent_testing.kubelet.podresources import FakePodResources  # noqa: PLC0415

        (self.work / "dp").mkdir()
        self.pod_resources = FakePodResources(self.work / "pr" / "kubelet.sock").start()
        self.kubelet = FakeKubelet(self.work / "dp" / "kubelet.sock").start()

    def start_agent(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "mpsagent",
            *self.common_args(),
            "--kubelet-socket",
            str(self.kubelet.socket_path),
            "--pod-resources-socket",
            str(self.pod_resources.socket_path),
            "--mps-on-exit",
            "quit",
            "--log-format",
            "json",
            "--metrics-address",
            "127.0.0.1:0",
        ]
        say("starting the agent: " + " ".join(argv[1:]))
        self.plugins_before = list(self.kubelet.plugins)
        with self.agent_log.open("wb") as log:
            self.agent = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=self.agent_env(),
                start_new_session=True,
            )

    def log_events(self) -> Iterator[dict[str, Any]]:
        try:
            text = self.agent_log.read_text(errors="replace")
        except OSError:
            return
        for line in text.splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    yield json.loads(line)

    def wait_registered(self) -> None:
        assert self.agent is not None
        earlier = len(self.plugins_before)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.agent.poll() is not None:
                raise RuntimeError(
                    f"the agent exited {self.agent.returncode} before registering:\n{tail(self.agent_log)}"
                )
            # Only this start's registration: an earlier agent may have served the same resource.
            plugins = list(self.kubelet.plugins)[earlier:]
            matching = [p for p in plugins if p.request.resource_name == self.run.resource and p.updates]
            if matching:
                self.plugin = matching[-1]
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"the agent did not register within 60 s:\n{tail(self.agent_log)}")
        with contextlib.suppress(OSError, ValueError, KeyError):
            self.daemon_pid = int(json.loads((self.mps_root / self.run.resource / "daemon.json").read_text())["pid"])
        self.report.facts[_check_id("daemonPid", self.run)] = self.daemon_pid

    def allocate(self, ids: list[str], pod: str, container: str) -> dict[str, str]:
        from mpsagent_testing.kubelet.podresources import ListedContainer  # noqa: PLC0415
        from mpsagent_testing.kubelet.stubs import dp_pb2  # noqa: PLC0415

        request = dp_pb2.AllocateRequest(container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=ids)])
        response = self.plugin.stub.Allocate(request, timeout=30).container_responses[0]
        envs = dict(response.envs)
        mounts = [{"container": m.container_path, "host": m.host_path} for m in response.mounts]
        self.report.facts[f"allocate-{pod}"] = {"ids": ids, "envs": envs, "mounts": mounts}
        # As the kubelet does once the pod runs: pod-resources lists the container with its devices.
        self.pod_resources.set_containers(ListedContainer("hwc", pod, container, self.run.resource, tuple(ids)))
        return envs

    def control(self, command: str, user: int | None = None) -> str:
        """One command to the resource's control daemon, as an operator would send it (`echo ... | ...`), or as
        another `user` (a client container's); its reply. A session the daemon closes unanswered (the agent's own
        session is open) is sent again, as an operator would: each session ends with a `get_` that always prints,
        so an answered one is known, and that line is not part of the reply."""
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe)}
        deadline = time.monotonic() + CONTROL_RETRY_S
        while True:
            try:
                done = subprocess.run(
                    [self.mps_control],
                    input=f"{command}\n{ANSWER_CHECK}\n",
                    capture_output=True,
                    text=True,
                    timeout=10,
                    env=env,
                    check=False,
                    user=user,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"<{type(exc).__name__}: {exc}>"
            reply = done.stdout.strip() or done.stderr.strip()
            if (reply and "Cannot send command" not in reply) or time.monotonic() >= deadline:
                return reply.rpartition("\n")[0].strip()
            time.sleep(0.1)

    def daemon_reads(self, phase: str, when: str, threads: str, memory: str, ordinal: int = 0) -> None:
        observed = self.control("get_default_active_thread_percentage")
        self.report.add(
            f"daemon-threads-{phase}",
            f"daemon default thread percentage, {when}",
            threads,
            observed,
            observed == threads,
        )
        observed = self.control(f"get_default_device_pinned_mem_limit {ordinal}")
        self.report.add(
            f"daemon-memory-{phase}",
            f"daemon default pinned memory limit of GPU {ordinal}, {when}",
            memory,
            observed,
            observed == memory,
        )

    # --- the daemon's control.log, as the agent's ceiling watch reads it ------------------------------------

    @property
    def control_log(self) -> Path:
        return self.mps_root / self.run.resource / "log" / "control.log"

    def control_log_checks(self, capped_mib: int) -> None:
        """The driver writes the lines the agent's ceiling watch knows: the agent's own commands read as accepted, no
        line not understood; a root tenant's change within one GiB restored within 1 s; a non-root user's command
        refused (driver 580) and not counted, or (Debian's 535 build, which refuses no user) restored and counted."""
        from mpsagent.mps.control_log import ControlLogReader, Outcome, UnknownLine, Verdict  # noqa: PLC0415

        def verdicts() -> list[Verdict | UnknownLine]:
            reader = ControlLogReader()
            lines = self.control_log.read_text(errors="replace").splitlines()
            return [v for line in lines for v in reader.feed(line)] + list(reader.settle())

        found = verdicts()
        accepted = [v for v in found if isinstance(v, Verdict) and v.outcome is Outcome.ACCEPTED]
        unknown = [v.line for v in found if isinstance(v, UnknownLine)]
        self.report.add(
            "control-log-format",
            "the daemon's control.log read by the agent's parser (the agent's own ceiling commands so far)",
            "every ceiling command accepted, no line not understood",
            f"{len(accepted)} accepted; not understood: {unknown or 'none'}",
            bool(accepted) and not unknown,
        )
        lowered = f"set_default_device_pinned_mem_limit 0 {capped_mib - 100}M"
        self.control(lowered)
        from mpsagent_testing.mps.daemon import restored_after  # noqa: PLC0415

        restore = f"set_default_device_pinned_mem_limit 0 {capped_mib}M"
        took = wait_until(lambda: restored_after(self.control_log, lowered, restore), 5)
        counted = wait_until(lambda: self.tamper_count("control_log") == 1, 3)
        self.report.add(
            "control-log-tamper",
            f"root lowers the ceiling by 100 MiB (`{lowered}`): seen in control.log and restored",
            f"the agent's `{restore}` within 1 s; counted once",
            f"restored after {took:.3f} s; counted: {counted}" if took is not None else "not restored within 5 s",
            took is not None and took <= 1.0 and bool(counted),
        )
        refused_command = "set_default_active_thread_percentage 77"
        self.control(refused_command, user=65534)
        wait_until(lambda: any(_text_of(v) == refused_command for v in verdicts()), 5)
        outcome = next((v.outcome for v in verdicts() if _text_of(v) == refused_command), None)
        if outcome is Outcome.ACCEPTED:  # counted once the watch reads it and a publish shows it: waited for
            wait_until(lambda: self.tamper_count("control_log") == 2, 5)
        else:
            time.sleep(1.0)  # the watch's polls and a publish: a refused command must stay uncounted
        count = self.tamper_count("control_log")
        self.report.add(
            "control-log-refused",
            f"user 65534 sends `{refused_command}`",
            "refused (Insufficient privileges) and not counted; or, on a daemon that refuses no user (535), counted",
            f"{outcome.value if outcome else 'not in the log'}; tamper count {count}",
            (outcome is Outcome.REFUSED and count == 1) or (outcome is Outcome.ACCEPTED and count == 2),
        )

    def tamper_count(self, seen_by: str) -> float | None:
        wanted = f'mpsagent_cap_tamper_total{{resource="{self.run.resource}",seen_by="{seen_by}"}}'
        for line in self.metrics(("mpsagent_cap_tamper_total",)).splitlines():
            if line.startswith(wanted):
                return float(line.rsplit(" ", 1)[1])
        return None

    def compute_mode(self, id_: str, step: str, expected: str) -> None:
        if self.dry_run:
            self.report.skip(id_, step, expected)
            return
        observed = self.read_compute_mode()
        self.report.add(id_, step, expected, observed, observed == expected)

    def read_compute_mode(self) -> str:
        return run_text(["nvidia-smi", "-i", "0", "--query-gpu=compute_mode", "--format=csv,noheader"])[1]

    def observe(self, phase: str) -> None:
        """What the daemon, the agent's metrics and nvidia-smi show while a client holds its allocation."""
        servers = self.control("get_server_list")
        self.server_pids |= {int(token) for token in servers.split() if token.isdigit()}
        clients = {pid: self.control(f"get_client_list {pid}") for pid in sorted(self.server_pids)}
        self.report.add(
            f"servers-{phase}",
            f"MPS servers and their clients while the {phase} client runs",
            "a server listed, with the client's PID",
            {"get_server_list": servers, "get_client_list": clients},
            None,
        )
        self.server_values(f"server-values-{phase}", f"running MPS server while the {phase} client runs")
        self.control_connections(phase)
        self.report.add(
            f"metrics-{phase}",
            f"agent metrics while the {phase} client runs",
            "mpsagent_mps_clients counts it; container memory and SM utilization are empty outside pods; the client, a "
            "process on the host with no pod, is in mpsagent_stowaway_processes",
            self.metrics(),
            None,
        )
        if not self.dry_run:
            apps = run_text(
                ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"]
            )
            self.report.add(f"gpu-apps-{phase}", f"nvidia-smi compute apps, {phase} client running", "", apps[1], None)
            pmon = run_text(["nvidia-smi", "pmon", "-c", "1", "-s", "u"])
            self.report.add(
                f"process-sm-{phase}",
                f"per-process SM utilization (nvidia-smi pmon: NVML's process samples), {phase} client running",
                "the client's PID with its sm %; '-' where the GPU or MPS gives none (then the agent's per-container "
                "SM utilization stays empty)",
                pmon[1],
                None,
            )

    def driver_limit_checks(self, gpu: dict[str, Any], envs: dict[str, str], limit_mib: int) -> None:
        """On a driver that limits memory per cgroup: the agent's hook limits a container's cgroup to its share,
        which holds across two processes of that container (each allowed 60 % of it by MPS, both together not) and
        reads back through NVML. Elsewhere the check says who enforces memory (mps) and why, and skips them."""
        steps = {
            "driver-limit-two-processes": "a second client in the same cgroup allocates 60 % of the cgroup's limit",
            "driver-limit-readback": "the cgroup's limit and use read back through NVML",
        }
        if gpu.get("enforcement") != "driver":
            why = f"memory enforced by mps ({gpu.get('enforcementReason') or 'not asked'})"
            for id_, step in steps.items():
                self.report.skip(id_, step, "", why)
            return
        from mpsagent.base.cgroups import cgroup2_mount  # noqa: PLC0415 - the CUDA client needs no mpsagent
        from mpsagent.gpu.nvml import NvmlMemoryLimits  # noqa: PLC0415

        mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
        assert mount is not None  # the driver limits cgroup v2's
        cgroup = Path(mount) / f"mpsagent-hwc-{os.getpid()}"
        cgroup.mkdir()
        holder = subprocess.Popen(["sh", "-c", f"echo $$ > {cgroup / 'cgroup.procs'} && exec sleep 600"])
        try:
            wait_until(lambda: str(holder.pid) in (cgroup / "cgroup.procs").read_text(), 5)
            state = json.dumps({"ociVersion": "1.2.0", "id": "hwc", "status": "creating", "pid": holder.pid})
            hook = Path(sys.executable).parent / "mpsagent-cdi-hook"
            argv = [str(hook), "apply-memory-limits", "--records", str(self.work / "limits")]
            argv += ["--limit", f"{gpu['uuid']}={limit_mib}"]
            done = subprocess.run(argv, input=state, capture_output=True, text=True, timeout=60, check=False)
            self.report.add("driver-limit-hook", "the agent's hook limits a cgroup", "exit 0", done.stderr.strip()
                            or "exit 0", done.returncode == 0)  # fmt: skip
            share = limit_mib * MIB * 6 // 10

            def second(result: dict[str, Any]) -> bool:
                ok = bool(not result["ok"] and result["oom"])
                self.report.add("driver-limit-two-processes", steps["driver-limit-two-processes"],
                                "fails: out of memory (the first holds 60 %)", _probe_seen(result), ok)  # fmt: skip
                read = NvmlMemoryLimits().read(gpu["uuid"], str(cgroup))
                seen = None if read is None else (read.hard_bytes, read.used_bytes)
                held = read is not None and read.hard_bytes == limit_mib * MIB and read.used_bytes >= share
                self.report.add("driver-limit-readback", steps["driver-limit-readback"],
                                f"hard {limit_mib * MIB}, used at least {share}", seen, held)  # fmt: skip
                return ok

            def first(result: dict[str, Any]) -> bool:
                self.report.add("driver-limit-first", "a client in the cgroup allocates 60 % of its limit",
                                "succeeds", _probe_seen(result), bool(result["ok"]))  # fmt: skip
                self.run_probe("driver-limit-two-processes", steps["driver-limit-two-processes"], "", envs, share,
                               judge=second, cgroup=cgroup)  # fmt: skip
                return bool(result["ok"])

            self.run_probe("driver-limit-first", "first client", "", envs, share, judge=first, cgroup=cgroup)
        finally:
            holder.kill()
            holder.wait(10)
            wait_until(lambda: not (cgroup / "cgroup.procs").read_text().strip(), 10)
            with contextlib.suppress(OSError):
                cgroup.rmdir()

    def control_connections(self, phase: str) -> None:
        """The agent ends a connection to the control socket held past --control-hold-seconds by a process in a pod:
        a CUDA client must hold none for as long as it runs (it is handed to a server, and talks to that)."""
        from mpsagent.base import procfs  # noqa: PLC0415 - the CUDA client needs no mpsagent
        from mpsagent.mps import control_socket  # noqa: PLC0415

        if self.daemon_pid is None:
            return
        daemon = self.daemon_pid
        found = [
            c
            for c in control_socket.connections(daemon, self.pipe)
            if c.peer_pid is None or daemon not in {c.peer_pid, *procfs.ancestors(c.peer_pid)}
        ]
        self.report.add(
            f"control-connections-{phase}",
            f"connections to the daemon's control sockets from outside the daemon while the {phase} client runs",
            "none: a running client holds no control connection",
            [f"{c.socket} from PID {c.peer_pid}" for c in found] or "none",
            not found,
        )

    def server_values(self, id_: str, step: str) -> None:
        values = {}
        for pid in sorted(self.server_pids):
            values[str(pid)] = {
                "get_active_thread_percentage": self.control(f"get_active_thread_percentage {pid}"),
                "get_device_pinned_mem_limit 0": self.control(f"get_device_pinned_mem_limit {pid} 0"),
            }
        self.report.add(id_, step, "the grant's caps (capped: 25 %, full: 100 %)", values, None)

    def cap_mode_metric(self, phase: str) -> None:
        """The agent's own account of the daemon's mode (its status is rewritten within half a second)."""

        def current() -> str:
            lines = [line for line in self.metrics().splitlines() if line.startswith("mpsagent_daemon_cap_mode{")]
            return " ".join(line for line in lines if line.endswith(" 1.0")) or self.metrics()

        expected = f'mode="{phase}"'

        def matching() -> str | None:
            text = current()
            return text if expected in text else None

        seen = wait_until(matching, 3) or current()
        self.report.add(
            f"metric-cap-mode-{phase}",
            f"metric mpsagent_daemon_cap_mode after the {phase} Allocate",
            f"{expected} is 1",
            seen,
            expected in seen,
        )

    def metrics(self, wanted: tuple[str, ...] = OBSERVED_METRICS) -> str:
        address = next((e.get("address") for e in self.log_events() if e.get("event") == "http endpoint serving"), None)
        if address is None:
            return "<no `http endpoint serving` event in the agent's log>"
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError as exc:
            return f"<GET /metrics failed: {exc}>"
        lines = [line for line in text.splitlines() if line.startswith(wanted)]
        return "\n".join(lines) or f"<no {' / '.join(wanted)} samples>"

    def probe(
        self, id_: str, step: str, envs: dict[str, str], nbytes: int, *, expect_ok: bool, observe: str | None = None
    ) -> None:
        """A client with the grant's environment allocates `nbytes` on GPU 0: a pass when it succeeds, or fails with
        out-of-memory, as expected; with `observe`, the daemon and the agent are looked at while it holds."""
        expected = "succeeds" if expect_ok else "fails: out of memory"
        step = f"{step} ({nbytes / 1024**3:.1f} GiB)"
        if self.dry_run:
            self.report.skip(id_, step, expected)
            if observe:
                self.observe(observe)
            return

        def judge(result: dict[str, Any]) -> bool:
            ok = bool(result["ok"] if expect_ok else (not result["ok"] and result["oom"]))
            self.report.add(id_, step, expected, _probe_seen(result), ok)
            if observe:
                self.observe(observe)  # the client still holds its memory and its connection to the server
            return ok

        self.run_probe(id_, step, expected, envs, nbytes, judge=judge)

    def run_probe(
        self,
        id_: str,
        step: str,
        expected: str,
        envs: dict[str, str],
        nbytes: int,
        *,
        judge: Callable[[dict[str, Any]], bool],
        ordinal: int = 0,
        visible: str | None = "0",
        cgroup: Path | None = None,
    ) -> None:
        """Start a CUDA client with the grant's `envs` that allocates `nbytes` on device `ordinal` and holds them
        while `judge` reports its answer (False: keep its stderr and the MPS logs). `visible` is its
        CUDA_VISIBLE_DEVICES (None: unset, every device the MPS server offers); `cgroup` a cgroup v2 directory it
        runs in (a container's, as the driver's memory limit sees it)."""
        remaining = self.deadline - time.monotonic()
        if remaining < 10:
            self.report.add(id_, step, expected, "not run: the time budget (--budget-seconds) is spent", False)
            return
        env = {**os.environ, **envs}
        # No container here, so no mount: the client reaches the daemon through the host's pipe directory (the
        # one a container sees at /mps/<resource>/pipe), and shares the host's /dev/shm with the server.
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        for variable in ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
            if variable not in envs:
                env.pop(variable, None)
        timeout = min(self.args.probe_timeout, remaining)
        argv = [
            self.args.probe_python,
            str(Path(__file__).resolve()),
            "--probe",
            str(nbytes),
            "--probe-device",
            str(ordinal),
            "--probe-backend",
            self.backend,
            "--hold",
            str(timeout),
        ]
        if cgroup is not None:
            argv = ["sh", "-c", f'echo $$ > {cgroup / "cgroup.procs"} && exec "$@"', "sh", *argv]
        stderr_path = self.work / f"{id_}.stderr"
        with stderr_path.open("wb") as stderr:
            child = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                cwd=self.work,
                start_new_session=True,
            )
        self.children.append(child)
        try:
            result = self.read_probe_line(child, timeout)
            if result is None:
                observed = f"no answer within {timeout:.0f} s (killed); stderr: {tail(stderr_path, 10)}"
                self.report.add(id_, step, expected, observed, False)
                return
            self.report.facts[id_] = result
            ok = judge(result)
        finally:
            self.end_child(child)
        if not ok:
            self.report.facts[f"{id_}-stderr"] = tail(stderr_path, 20)
            self.report.facts[f"{id_}-mps-logs"] = {
                name: tail(self.mps_root / self.run.resource / "log" / name, 20)
                for name in ("control.log", "server.log")
            }

    def read_probe_line(self, child: subprocess.Popen[bytes], timeout: float) -> dict[str, Any] | None:
        assert child.stdout is not None
        deadline = time.monotonic() + timeout
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                    continue
                chunk = os.read(child.stdout.fileno(), 65536)
                if not chunk:
                    break
                buffer += chunk
                for raw in buffer.split(b"\n")[:-1]:  # whole lines only
                    line = raw.decode(errors="replace")
                    if line.startswith(PROBE_PREFIX):
                        parsed: dict[str, Any] = json.loads(line[len(PROBE_PREFIX) :])
                        return parsed
        return None

    def end_child(self, child: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(OSError):
            if child.stdin is not None:
                child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait(5)
        if child.stdout is not None:
            child.stdout.close()

    def stop_agent(self) -> None:
        from mpsagent_testing.processes import alive  # noqa: PLC0415 - the CUDA client runs on any Python

        assert self.agent is not None
        self.agent.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.agent.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        self.report.add(
            _check_id("agent-exit", self.run),
            f"SIGTERM: the agent stops ({self.run.name})",
            "exit status 0",
            f"exit status {code}",
            code == 0,
        )
        daemon_gone = self.daemon_pid is not None and wait_until(lambda: not alive(self.daemon_pid or 0), 10)
        servers_gone = wait_until(lambda: not any(alive(pid) for pid in self.server_pids), 10)
        record = self.mps_root / self.run.resource / "daemon.json"
        self.report.add(
            _check_id("daemon-quit", self.run),
            f"--mps-on-exit quit: the daemon (and its servers) quit ({self.run.name})",
            "daemon and servers gone, daemon.json removed",
            f"daemon {self.daemon_pid} {'gone' if daemon_gone else 'STILL RUNNING'}, "
            f"servers {sorted(self.server_pids)} {'gone' if servers_gone else 'STILL RUNNING'}, "
            f"daemon.json {'present' if record.exists() else 'removed'}",
            bool(daemon_gone and servers_gone and not record.exists()),
        )
        if code is None:
            self.children.append(self.agent)  # still running: the cleanup ends its process group
        self.agent = None

    # -- cleanup, on every exit path ----------------------------------------------------------------------------

    def cleanup(self) -> None:
        from mpsagent_testing.processes import alive, processes_using  # noqa: PLC0415 - the CUDA client runs on any Python

        for child in self.children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(5)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)  # --mps-on-exit quit: it quits the daemon, restores the mode
            try:
                self.agent.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.agent.pid, signal.SIGKILL)
                self.agent.wait(5)
        if self.pipe.exists() and (self.daemon_pid is None or alive(self.daemon_pid)):
            self.control("quit")  # the fallback: the daemon is in its own session, out of the agent's group
            if self.daemon_pid is not None:
                wait_until(lambda: not alive(self.daemon_pid or 0), 10)
        leftovers = processes_using(self.work)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if leftovers and not wait_until(lambda: not processes_using(self.work), 5):
            for pid in processes_using(self.work) + [p for p in self.server_pids if alive(p)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if leftovers:
            self.report.facts["cleanupKilled"] = leftovers
        if not self.dry_run and self.compute_mode_before and shutil.which("nvidia-smi"):
            now = self.read_compute_mode()
            if now != self.compute_mode_before:
                target = {"Default": "DEFAULT", "Exclusive_Process": "EXCLUSIVE_PROCESS", "Prohibited": "PROHIBITED"}
                restore = run_text(["nvidia-smi", "-i", "0", "-c", target.get(self.compute_mode_before, "DEFAULT")])
                self.report.facts["computeModeRestoredByCleanup"] = {"was": now, "nvidia-smi": restore}
        for fake in (self.kubelet, self.pod_resources):
            if fake is not None:
                with contextlib.suppress(Exception):
                    fake.stop()

    def keep_logs(self, out: Path) -> None:
        for run in self.runs:
            log = self.mps_root / run.resource / "log"
            for source, name in (
                (self.work / _log_name("agent", run), _log_name("agent", run)),
                (log / "control.log", _log_name("mps-control", run)),
                (log / "server.log", _log_name("mps-server", run)),
            ):
                with contextlib.suppress(OSError):
                    shutil.copyfile(source, out / name)
        if not self.args.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)


def _log_name(stem: str, run: AgentRun, suffix: str = ".log") -> str:
    return f"{stem}{suffix}" if run is MAIN else f"{stem}-{run.name}{suffix}"


def _check_id(stem: str, run: AgentRun) -> str:
    """The main run keeps the check IDs it always had; later runs add their name."""
    return stem if run is MAIN else f"{stem}-{run.name}"


def _text_of(verdict: object) -> str | None:
    command = getattr(verdict, "command", None)
    return None if command is None else str(command.text)


def _uncapped(envs: dict[str, str]) -> dict[str, str]:
    """A container's environment without its cap variables: what a container that unsets them runs with."""
    caps = ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    return {name: value for name, value in envs.items() if name not in caps}


def _probe_seen(result: dict[str, Any]) -> str:
    return (
        f"{'allocated' if result['ok'] else 'failed'}"
        + (f" at {result['stage']}: {result['error']}" if result["error"] else "")
        + f"; client sees total {_gib(result.get('total'))}, "
        + f"cuMemGetInfo {_mem_info(result.get('memGetInfo'))}, {result.get('smCount')} SMs"
    )


def _other_gpu_seen(result: dict[str, Any]) -> str:
    devices = result.get("devices") or []
    listed = "; ".join(f"{d.get('ordinal')}: {d.get('uuid', '?')}" for d in devices) or "none listed"
    allocated = "allocated 1 GiB on device 1" if result["ok"] else f"no allocation on device 1 ({result['error']})"
    return f"{len(devices)} device(s) seen: {listed}; {allocated}"


def _gib(value: object) -> str:
    return f"{value / 1024**3:.1f} GiB" if isinstance(value, int) else "?"


def _mem_info(value: object) -> str:
    if isinstance(value, dict):
        return f"free {_gib(value.get('free'))} / total {_gib(value.get('total'))}"
    return "?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, help="where hardware-check.json, hardware-check.md and the logs go")
    parser.add_argument(
        "--dry-run-snapshot", type=Path, help="no GPU: the agent reads this node snapshot, CUDA steps skip"
    )
    parser.add_argument(
        "--probe-backend",
        choices=["driver", "torch", "cupy", "auto"],
        default="driver",
        help="the CUDA client: driver API through ctypes (default), PyTorch, CuPy, or the first of "
        "torch, cupy, driver that --probe-python can import",
    )
    parser.add_argument("--probe-python", default=sys.executable, help="interpreter for the CUDA clients")
    parser.add_argument("--probe-timeout", type=float, default=45.0, help="seconds per CUDA client (killed after)")
    parser.add_argument("--budget-seconds", type=float, default=150.0, help="no CUDA client starts after this long")
    parser.add_argument("--keep-work", action="store_true", help="keep the /tmp/hwc-* work directory")
    parser.add_argument("--probe", type=int, metavar="BYTES", help=argparse.SUPPRESS)
    parser.add_argument("--probe-device", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--hold", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is None and args.out is None:
        parser.error("--out DIR is required")
    if args.probe_backend == "auto" and args.probe is not None:
        parser.error("--probe needs a concrete --probe-backend")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe is not None:
        return probe_main(args.probe, args.probe_device, args.probe_backend, args.hold)
    if args.dry_run_snapshot is not None and not args.dry_run_snapshot.is_file():
        print(f"hardware_check: error: no snapshot at {args.dry_run_snapshot}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    check = HardwareCheck(args)
    say(f"work directory {check.work}, mode: {check.report.mode}")
    try:
        try:
            check.execute()
        except (Exception, Interrupted, KeyboardInterrupt) as exc:
            check.report.add(
                "aborted", "the run stopped early", "runs to the end", f"{type(exc).__name__}: {exc}", False
            )
            check.report.facts["traceback"] = traceback.format_exc()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleanup is not interrupted a second time
            check.cleanup()
            check.keep_logs(args.out)
    finally:
        check.report.write(args.out)
    print(check.report.markdown())
    print(f"written: {args.out / 'hardware-check.md'} and {args.out / 'hardware-check.json'}")
    return 0 if check.report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
