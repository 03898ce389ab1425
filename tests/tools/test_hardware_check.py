"""scripts/hardware_check.py without a GPU: the dry run (node snapshot, CUDA skipped), the CUDA client against a
fake libcuda.so.1, and the whole hardware path against fakes of NVML, nvidia-smi and libcuda, so that the one run
on a lent GPU does not fail on a bug this machine could have found. Needs the real nvidia-cuda-mps-control."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpsagent_testing.node import small_node
from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.processes import processes_using
from mpsagent_testing.repo import ROOT

SCRIPT = ROOT / "scripts" / "hardware_check.py"
GIB = 1024**3
HWC_GPU = "GPU-0000c0de-0000-0000-0000-000000000000"
HWC_GPU_1 = "GPU-0000c0de-0000-0000-0000-000000000001"

if shutil.which("nvidia-cuda-mps-control") is None:
    if os.environ.get("CI"):
        raise RuntimeError("nvidia-cuda-mps-control is missing in CI: scripts/install-system-deps.sh installs it")
    pytest.skip("nvidia-cuda-mps-control not installed (run scripts/install-system-deps.sh)", allow_module_level=True)

# A stand-in for the driver's libcuda.so.1 with the calls the probe makes. FAKE_CUDA_DEVICES devices (1 unless
# set; CUDA_VISIBLE_DEVICES, when set, counts its entries instead). Like a client under MPS, it may allocate on
# device d no more than the smaller of its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for d and the control daemon's
# default limit for d (asked of the real nvidia-cuda-mps-control through CUDA_MPS_PIPE_DIRECTORY).
FAKE_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
static int context_tokens[8], retained[8];
static size_t allocated;
static const CUdeviceptr BASE = 0x7f0000000000ull;
static size_t total(void) {
    const char *s = getenv("FAKE_CUDA_TOTAL_BYTES");
    return s ? strtoull(s, NULL, 10) : (size_t)16 << 30;
}
static int count(void) {
    const char *visible = getenv("CUDA_VISIBLE_DEVICES"), *devices = getenv("FAKE_CUDA_DEVICES");
    int n = devices ? atoi(devices) : 1;
    if (visible) {
        int listed = *visible ? 1 : 0;
        for (const char *c = visible; *c; c++) listed += *c == ',';
        if (listed < n) n = listed;
    }
    return n < 8 ? n : 8;
}
static size_t parse_size(const char *text) {  /* "4096M", "4G", "4096" */
    char *end;
    unsigned long long n = strtoull(text, &end, 10);
    if (end == text) return (size_t)-1;
    if (*end == 'G') return (size_t)n << 30;
    if (*end == 'M') return (size_t)n << 20;
    if (*end == 'K') return (size_t)n << 10;
    return (size_t)n;
}
static size_t parse_limit(const char *text, int device) {  /* "4G" (every device) or "0=4096M,1=2G" */
    if (!strchr(text, '=')) return parse_size(text);
    for (const char *entry = text; entry; entry = strchr(entry, ',') ? strchr(entry, ',') + 1 : NULL)
        if (atoi(entry) == device) return parse_size(strchr(entry, '=') + 1);
    return (size_t)-1;
}
static size_t limit(int device) {
    size_t result = (size_t)-1;
    const char *own = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    if (own) result = parse_limit(own, device);
    if (getenv("CUDA_MPS_PIPE_DIRECTORY")) {
        char command[96];
        snprintf(command, sizeof command,
                 "echo get_default_device_pinned_mem_limit %d | nvidia-cuda-mps-control", device);
        FILE *f = popen(command, "r");
        char line[128] = {0};
        if (f) {
            if (fgets(line, sizeof line, f)) {
                size_t daemon = parse_size(line);
                if (daemon < result) result = daemon;
            }
            pclose(f);
        }
    }
    return result;
}
static int current = -1;
CUresult cuInit(unsigned int flags) { return flags == 0 ? 0 : 1; }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = count(); return 0; }
static CUresult known(CUdevice d) { return d < 0 || d >= count() ? 101 : 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { *d = ordinal; return known(ordinal); }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { snprintf(name, len, "Fake GPU"); return known(d); }
CUresult cuDeviceGetUuid(char *uuid, CUdevice d) { memset(uuid, 0, 16); uuid[15] = (char)d; return known(d); }
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { *bytes = total(); return known(d); }
CUresult cuDeviceGetAttribute(int *v, int attribute, CUdevice d) { *v = attribute == 16 ? 40 : 0; return known(d); }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    if (known(d)) return 101;
    *c = &context_tokens[d]; retained[d]++; return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { if (known(d)) return 101; retained[d]--; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) {
    for (int d = 0; d < 8; d++) if (c == &context_tokens[d]) { current = d; return 0; }
    return 201;
}
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetInfo_v2(size_t *free, size_t *t) {
    if (current < 0) return 201;
    *t = total(); *free = limit(current) < *t ? limit(current) : *t; return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    if (current < 0 || !retained[current]) return 201;
    if (n > limit(current) || n > total()) return 2;
    *p = BASE; allocated = n; return 0;
}
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char c, size_t n) { return p == BASE && n == allocated ? 0 : 1; }
CUresult cuMemFree_v2(CUdeviceptr p) { return p == BASE ? 0 : 1; }
CUresult cuGetErrorName(CUresult e, const char **s) {
    *s = e == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_SOMETHING_ELSE"; return 0;
}
"""

# A stand-in for nvidia-smi: the compute mode comes from the fake NVML's shared state, as the real one's does
# from the driver.
FAKE_NVIDIA_SMI = """#!{python}
import json, os, sys
MODES = ["Default", "Exclusive_Thread", "Prohibited", "Exclusive_Process"]
state_path = os.environ["FAKE_NVML_STATE"]
config = json.load(open(os.environ["FAKE_NVML_CONFIG"]))
gpu = config["gpus"][0]
try:
    state = json.load(open(state_path))
except OSError:
    state = {{}}
mode = state.get("computeModes", {{}}).get(gpu["uuid"], gpu.get("computeMode", 0))
args = sys.argv[1:]
if args[:1] == ["pmon"]:  # its -c is a count of samples; this GPU's processes ran no kernel: no sample
    print("# gpu         pid   type     sm    mem    enc    dec    command")
    print("# Idx           #    C/G      %      %      %      %    name")
    print("    0          -     -      -      -      -      -    -")
    sys.exit(0)
if "-c" in args:
    wanted = args[args.index("-c") + 1].upper()
    names = [m.upper() for m in MODES]
    state.setdefault("computeModes", {{}})[gpu["uuid"]] = names.index(wanted)
    json.dump(state, open(state_path, "w"))
    print("Compute mode set")
    sys.exit(0)
for arg in args:
    if arg.startswith("--query-gpu="):
        values = {{"name": gpu["name"], "memory.total": f"{{gpu['memoryTotal'] // 2**20}} MiB",
                  "memory.used": "0 MiB", "compute_mode": MODES[mode]}}
        print(", ".join(values[f] for f in arg.split("=", 1)[1].split(",")))
        sys.exit(0)
    if arg.startswith("--query-compute-apps="):
        sys.exit(0)
sys.exit(f"fake nvidia-smi: unexpected arguments {{args}}")
"""


def run_script(
    out: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
        env=env,
        check=False,
    )
    report_path = out / "hardware-check.json"
    assert report_path.exists(), done.stdout + done.stderr
    return done, json.loads(report_path.read_text())


def results(report: dict) -> dict[str, str]:
    return {check["id"]: check["result"] for check in report["checks"]}


def observed(report: dict, check_id: str) -> str:
    return next(c["observed"] for c in report["checks"] if c["id"] == check_id)


PHASES = ("start", "capped", "full", "proportional", "units")
DAEMON_CHECKS = [f"daemon-{what}-{phase}" for what in ("threads", "memory") for phase in PHASES]
PROBES = ["probe-a", "probe-b", "probe-c", "probe-d", "probe-e", "probe-f", "probe-g", "probe-h", "probe-i"]
AGENT_RUNS = ("registered", "agent-exit", "daemon-quit")


def test_dry_run_switches_the_daemon_and_skips_what_needs_a_gpu(short_dir: Path) -> None:
    out = short_dir / "out"
    started = time.monotonic()
    done, report = run_script(
        out,
        "--dry-run-snapshot",
        str(small_node(short_dir / "node.json", gpus=1, memory_bytes=140 * GIB)),
        env={**os.environ, "HWC_TEST_MARKER": str(short_dir)},
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert elapsed < 60
    assert report["passed"] is True
    assert (out / "hardware-check.md").read_text().count("| pass |") >= 10
    assert "| # | step | expected | observed | result |" in done.stdout
    status = results(report)
    assert all(status[c] == "pass" for c in DAEMON_CHECKS)
    # equal: 1/4 then all; proportional: 2/4 is half; memory units: 2 of 17 units of 8 GiB are 16 GiB; each capped
    # limit the exact share (the daemon prints whole GiB, rounded down).
    assert [observed(report, f"daemon-threads-{p}") for p in PHASES] == ["100.0", "25.0", "100.0", "50.0", "11.0"]
    assert [observed(report, f"daemon-memory-{p}") for p in PHASES] == ["140G", "35G", "140G", "70G", "16G"]
    assert json.loads(observed(report, "proportional-envs"))["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=71680M"
    assert json.loads(observed(report, "units-envs"))["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M"
    assert all(status[p] == "skipped (no GPU)" for p in PROBES)
    assert status["other-gpu"] == "skipped (needs 2 GPUs)" and "registered-two-gpus" not in status
    assert report["facts"]["plan"]["ceilings"]["untilGrantsKnown"] == [  # --once's ceilings, read as they are now
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 35840M",
    ]
    for check in ("compute-mode-before", "compute-mode-serving", "compute-mode-restored"):
        assert status[check] == "skipped (no GPU)"
    passing = ["capped-envs", "full-envs", "proportional-envs", "units-envs", "nothing-left"]
    passing += [f"{check}{run}" for check in AGENT_RUNS for run in ("", "-proportional", "-units")]
    passing += ["control-log-format", "control-log-tamper", "control-log-refused"]
    for check in passing:
        assert status[check] == "pass", check
    # The daemon's log as the agent reads it: Debian's 535 daemon takes user 65534's command (driver 580 refuses it).
    assert observed(report, "control-log-format").endswith("accepted; not understood: none")
    assert observed(report, "control-log-refused") == "accepted; tamper count 2.0"
    assert (out / "agent.log").exists()
    work = Path(report["facts"]["workDir"])
    assert not work.exists()
    assert processes_using(short_dir) == [] and processes_using(work) == []


def build_fake_libcuda(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "fake_cuda.c"
    source.write_text(FAKE_LIBCUDA)
    target = directory / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(target), str(source)],
        check=True,
        timeout=60,
    )
    return directory


def probe(nbytes: int, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--probe", str(nbytes)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("HWC-PROBE "))
    return json.loads(line.removeprefix("HWC-PROBE "))


def test_driver_probe_reports_out_of_memory_and_success_through_ctypes(short_dir: Path) -> None:
    lib = build_fake_libcuda(short_dir / "cuda")
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib), "FAKE_CUDA_TOTAL_BYTES": str(140 * GIB)}
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "0=35840M"
    refused = probe(70 * GIB, env)  # past 4 GiB: size_t must travel whole through ctypes
    assert refused | {"error": None} == refused | {
        "ok": False,
        "oom": True,
        "stage": "alloc",
        "total": 140 * GIB,
        "bytes": 70 * GIB,
        "smCount": 40,
        "device": "Fake GPU",
        "error": None,
    }
    assert "CUDA_ERROR_OUT_OF_MEMORY" in refused["error"]
    assert refused["devices"] == [
        {"ordinal": 0, "name": "Fake GPU", "uuid": "GPU-00000000-0000-0000-0000-000000000000"}
    ]
    granted = probe(28 * GIB, env)
    assert granted["ok"] is True and granted["error"] is None and granted["stage"] == "done"
    assert granted["memGetInfo"] == {"free": 35840 * 2**20, "total": 140 * GIB}
    missing = probe(1, {**os.environ, "LD_LIBRARY_PATH": str(short_dir / "nowhere")})
    if missing["stage"] == "load":  # this machine has no libcuda.so.1 of its own
        assert missing["ok"] is False and missing["oom"] is False and "libcuda.so.1" in missing["error"]


def test_hardware_path_against_fake_nvml_nvidia_smi_and_libcuda(short_dir: Path, fake_nvml_library: Path) -> None:
    """Everything the GPU run does, with NVML, nvidia-smi and libcuda faked and the real MPS control daemon."""
    lib = build_fake_libcuda(short_dir / "cuda")
    nvml_config = short_dir / "nvml.json"
    gpu = {"uuid": HWC_GPU, "name": "Fake H200", "memoryTotal": 140 * GIB, "major": 9, "minor": 0}
    nvml_config.write_text(json.dumps({"gpus": [gpu, gpu | {"uuid": HWC_GPU_1}]}))
    state = short_dir / "nvml-state.json"
    bin_dir = short_dir / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI.format(python=sys.executable))
    smi.chmod(0o755)
    env = fake_nvml_env(fake_nvml_library, nvml_config, state)
    env["LD_LIBRARY_PATH"] = f"{lib}{os.pathsep}{env['LD_LIBRARY_PATH']}"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["FAKE_CUDA_TOTAL_BYTES"] = str(140 * GIB)
    env["FAKE_CUDA_DEVICES"] = "2"
    env["HWC_TEST_MARKER"] = str(short_dir)

    out = short_dir / "out"
    done, report = run_script(out, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout  # each row's command answered as the real one does, none failing
    status = results(report)
    assert all(status[p] == "pass" for p in PROBES), done.stdout
    assert status["compute-mode-serving"] == "pass" and status["compute-mode-restored"] == "pass"
    assert observed(report, "compute-mode-serving") == "Exclusive_Process"
    assert observed(report, "daemon-memory-capped") == "35G"  # 35840M
    assert "failed at alloc: CudaCallError: cuMemAlloc_v2 returned CUDA_ERROR_OUT_OF_MEMORY" in observed(
        report, "probe-b"
    )
    assert report["facts"]["probe-d"]["ok"] is True
    # 2 of 4 under grants: proportional: 45 % fits under the 71680M ceiling, 55 % does not, nor without the variables.
    assert observed(report, "daemon-memory-proportional") == "70G"
    assert [report["facts"][p]["ok"] for p in ("probe-e", "probe-f", "probe-g")] == [True, False, False]
    # 2 units of 8Gi (16384M): 15 GiB fits, 17 GiB does not.
    assert observed(report, "daemon-memory-units") == "16G"
    assert [report["facts"][p]["ok"] for p in ("probe-h", "probe-i")] == [True, False]
    # Two GPUs: what a client holding GPU 0 sees is recorded (the stand-in hides nothing, as the host does not).
    assert status["other-gpu"] == "info" and status["two-gpus-envs"] == "pass"
    assert observed(report, "other-gpu").startswith("2 device(s) seen: 0: GPU-00000000-0000-0000-0000-000000000000; 1:")
    assert observed(report, "other-gpu").endswith("allocated 1 GiB on device 1")
    assert report["facts"]["other-gpu"]["ordinal"] == 1
    assert json.loads(state.read_text())["computeModes"] == {HWC_GPU: 0, HWC_GPU_1: 0}  # both back to Default
    assert processes_using(short_dir) == [] and processes_using(Path(report["facts"]["workDir"])) == []
