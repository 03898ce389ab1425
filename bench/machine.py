"""Where the numbers came from: CPU, cores, kernel, OS, Python, the gRPC libraries, the MPS binary, the load."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mpsagent", "grpclib", "betterproto2", "grpcio", "anyio", "structlog", "h2")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _mps_package() -> str:
    if shutil.which("dpkg-query") is None:
        return "unknown"
    result = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}", "nvidia-cuda-mps"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or "unknown"


def _git(*args: str) -> str:
    try:
        result = subprocess.run(["git", *args], capture_output=True, text=True, check=False, cwd=ROOT, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def source_info() -> dict[str, Any]:
    """The agent's code that was measured: the commit, and the files under mpsagent/ changed since."""
    changed = _git("status", "--porcelain", "--", "mpsagent")
    return {"commit": _git("rev-parse", "HEAD"), "mpsagent_changes": changed.splitlines() if changed else []}


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "kernel": platform.release(),
        "os": _os_name(),
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in PACKAGES},
        "mps_control": shutil.which("nvidia-cuda-mps-control") or "not found",
        "mps_package": _mps_package(),
        "load_average_start": list(os.getloadavg()),
    }
