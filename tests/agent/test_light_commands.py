"""`--status` and `--once` are what an operator types on a busy node: they read a file or print a plan, and load
none of the agent's wire libraries (gRPC, the protobuf runtimes, the API server's client and its HTTP stack).
Measured as Python reports it, by the modules `-X importtime` lists."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpsagent_testing.repo import EXAMPLES, H100_NODE, ROOT

GOLDEN_STATUS = ROOT / "tests" / "documents" / "golden" / "status.json"
WIRE_LIBRARIES = ("grpclib", "google.protobuf", "betterproto2", "lightkube", "httpx", "httpx2", "h2", "pynvml")


def modules_loaded(*args: str) -> set[str]:
    """The modules `python -m mpsagent ARGS` imported, from `-X importtime` (it exits 0)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mpsagent", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split("|") for line in done.stderr.splitlines() if line.startswith("import time:")]
    return {parts[-1].strip() for parts in lines if len(parts) == 3}


def wire_libraries(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == lib or m.startswith(lib + ".") for lib in WIRE_LIBRARIES))


def test_the_module_list_is_read_as_python_writes_it() -> None:
    """The check below would pass on nothing: the list holds what the command does import."""
    loaded = modules_loaded("--version")
    assert {"mpsagent", "mpsagent.cli", "argparse"} <= loaded


def test_status_loads_no_wire_library(tmp_path: Path) -> None:
    shutil.copy(GOLDEN_STATUS, tmp_path / "status.json")
    assert wire_libraries(modules_loaded("--status", "--mps-root", str(tmp_path))) == []


@pytest.mark.parametrize("dra", ["off", "on"])
def test_once_loads_no_wire_library_even_printing_the_dra_slice(dra: str) -> None:
    loaded = modules_loaded(
        "--once",
        "--node-snapshot",
        str(H100_NODE),
        "--config-file",
        str(EXAMPLES / "config-mps.yaml"),
        "--dra",
        dra,
        "--node-name",
        "node-1",
    )
    if dra == "on":  # the slice it would publish is in the plan
        assert "mpsagent.dra.slice_object" in loaded
    assert wire_libraries(loaded) == []
