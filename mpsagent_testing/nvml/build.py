"""Build the fake NVML (fake_nvml.c) into a ``libnvidia-ml.so.1`` that the real pynvml can load."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nvml.c")
SONAME = "libnvidia-ml.so.1"
CFLAGS = ("-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-Wl,-soname,{SONAME}")
LIBS = ("-lpthread",)


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile fake_nvml.c into ``out_dir/libnvidia-ml.so.1`` unless that is newer; return its path.

    The compiler is ``$CC`` or ``gcc``. The library is written to a temporary name and renamed,
    so concurrent test workers never load a half-written file.
    """
    out_dir = Path(out_dir)
    target = out_dir / SONAME
    inputs = (SOURCE, Path(__file__))
    newest_input = max(p.stat().st_mtime_ns for p in inputs)
    if target.exists() and target.stat().st_mtime_ns > newest_input:
        return target

    compiler = os.environ.get("CC") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("building the fake NVML needs gcc (or $CC) on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{SONAME}.{os.getpid()}.tmp"
    cmd = [compiler, *CFLAGS, "-o", str(tmp), str(SOURCE), *LIBS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling the fake NVML failed:\n{' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, target)
    return target


def fake_nvml_env(
    library: Path,
    config: Path,
    state: Path | None = None,
    base: dict[str, str] | None = None,
    events: Path | None = None,
) -> dict[str, str]:
    """Environment for a subprocess whose pynvml should load the fake ``library``.

    ``config`` becomes FAKE_NVML_CONFIG; ``state`` (shared driver state: compute modes, lost GPUs,
    processes) FAKE_NVML_STATE and ``events`` (JSON lines that event sets read) FAKE_NVML_EVENTS.
    Either is removed from the environment when None. See fake_nvml.c and control.py.
    """
    env = dict(os.environ if base is None else base)
    lib_dir = str(Path(library).parent)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib_dir, env.get("LD_LIBRARY_PATH")) if p)
    env["FAKE_NVML_CONFIG"] = str(config)
    for name, path in (("FAKE_NVML_STATE", state), ("FAKE_NVML_EVENTS", events)):
        if path is None:
            env.pop(name, None)
        else:
            env[name] = str(path)
    return env
