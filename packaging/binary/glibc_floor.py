"""Prints the oldest glibc that a one-file `mpsagent` runs on: the highest GLIBC_x.y symbol version that the
bootloader or any binary bundled in it (libpython, extension modules, libssl, ...) needs, found with `objdump -T`.
Also checks that every shared library the bundle needs and does not carry is part of glibc, or the C++ runtime
(libstdc++, libgcc_s) that every distribution has and the bundle leaves out on purpose.

    .venv/bin/python packaging/binary/glibc_floor.py dist/mpsagent
    2.35 (libpython3.11.so.1.0)

Exits 1 when the bundle needs a library that is neither bundled nor glibc's. Needs PyInstaller (to read the
bundle) and binutils (objdump).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from PyInstaller.archive.readers import CArchiveReader

GLIBC_LIBRARIES = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libutil.so.1"}
# Left out of the bundle on purpose (mpsagent.spec): every distribution carries its own C++ runtime.
SYSTEM_CPP_RUNTIME = {"libstdc++.so.6", "libgcc_s.so.1"}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def elf_members(executable: Path) -> dict[str, bytes]:
    """The bootloader itself and every ELF file (shared library, extension module) in the bundle."""
    archive = CArchiveReader(str(executable))
    members = {"(bootloader)": executable.read_bytes()}
    for name in archive.toc:
        if name.endswith(".pyz"):
            continue
        data = archive.extract(name)
        if data and data[:4] == b"\x7fELF":
            members[name] = data
    return members


def _objdump(flag: str, data: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".so") as scratch:
        scratch.write(data)
        scratch.flush()
        done = subprocess.run(["objdump", flag, scratch.name], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def floors(members: dict[str, bytes]) -> dict[str, str]:
    """Per member, the highest GLIBC_ symbol version it needs (members needing none left out)."""
    found = {}
    for name, data in members.items():
        versions = re.findall(r"\bGLIBC_(\d+\.\d+(?:\.\d+)?)\b", _objdump("-T", data))
        if versions:
            found[name] = max(versions, key=_version)
    return found


def foreign_libraries(members: dict[str, bytes]) -> set[str]:
    """Shared libraries needed by some member that are neither bundled nor glibc's nor the system's C++ runtime."""
    needed: set[str] = set()
    for data in members.values():
        needed |= set(re.findall(r"NEEDED\s+(\S+)", _objdump("-p", data)))
    carried = {Path(name).name for name in members}
    return {n for n in needed - carried - GLIBC_LIBRARIES - SYSTEM_CPP_RUNTIME if not n.startswith("ld-linux")}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} ONE-FILE-EXECUTABLE", file=sys.stderr)
        return 2
    members = elf_members(Path(argv[1]))
    per_member = floors(members)
    floor = max(per_member.values(), key=_version)
    print(f"{floor} ({', '.join(sorted(n for n, v in per_member.items() if v == floor))})")
    foreign = foreign_libraries(members)
    if foreign:
        print(f"needs libraries that are neither bundled nor glibc's: {', '.join(sorted(foreign))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
