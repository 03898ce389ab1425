"""Run by the image build (packaging/container/Dockerfile) with the image's interpreter: puts pure-Python modules
into compressed zip archives that Python imports from (zipimport), with their bytecode, so that every module the
image holds has bytecode, in less room than the sources alone take as files.

    compact_python.py stdlib      the standard library's modules, as bytecode only, -> /usr/lib/python311.zip (first
                                  on Python's default sys.path); lib-dynload's extension modules and the few data
                                  files stay files
    compact_python.py venv VENV   VENV's top-level modules and packages with no extension module, sources, bytecode
                                  and data, -> VENV/lib/pythonX.Y/site-packages.zip, which a .pth file puts on
                                  sys.path; the agent, packages with extension modules, namespace packages and the
                                  .dist-info metadata stay files, compiled in place (__pycache__)

The bytecode in the archives is "unchecked-hash" (PEP 552): Python does not compare it with a source. zipimport
reads a .pyc before its .py; a traceback through a dependency reads the .py from the archive (linecache asks the
module's loader), as does inspect.getsource (anyio's lazy imports read their own module's source)."""

from __future__ import annotations

import compileall
import importlib.util
import marshal
import py_compile
import sys
import sysconfig
import zipfile
from pathlib import Path

COMPRESSION = zipfile.ZIP_DEFLATED
# What stays a file in site-packages: the agent itself (its sources and bytecode where tracebacks and pip expect
# them), and whatever a zip archive cannot hold.
KEEP_AS_FILES = {"mpsagent"}


def add_module(archive: zipfile.ZipFile, source: Path, name: str, *, with_source: bool) -> None:
    """The bytecode of source as `name`c in the archive, and source itself as `name` if with_source."""
    text = source.read_bytes()
    code = compile(text, f"{archive.filename}/{name}", "exec", dont_inherit=True)
    pyc = bytearray(importlib.util.MAGIC_NUMBER)
    pyc += (0b01).to_bytes(4, "little")  # hash-based, unchecked
    pyc += importlib.util.source_hash(text)
    pyc += marshal.dumps(code)
    if with_source:
        archive.write(source, name)
    archive.writestr(zipfile.ZipInfo(name + "c", date_time=(2026, 1, 1, 0, 0, 0)), bytes(pyc), COMPRESSION, 9)


def archive_tree(root: Path, paths: list[Path], zip_path: Path, *, with_sources: bool, data: bool) -> None:
    """paths (modules or packages under root) into zip_path: each .py as its bytecode (and the source if
    with_sources), and other files as they are if data; what went into the archive is removed, then empty folders."""
    files = sorted(p for path in paths for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    files = [file for file in files if file.suffix == ".py" or data]
    with zipfile.ZipFile(zip_path, "w", COMPRESSION, compresslevel=9) as archive:
        for file in files:
            name = file.relative_to(root).as_posix()
            if file.suffix == ".py":
                add_module(archive, file, name, with_source=with_sources)
            else:
                archive.write(file, name)
    for file in files:
        file.unlink()
    for path in paths:
        for folder in sorted((p for p in [path, *path.rglob("*")] if p.is_dir()), reverse=True):
            if not any(folder.iterdir()):
                folder.rmdir()
    modules = sum(file.suffix == ".py" for file in files)
    print(f"{zip_path}: {modules} modules, {len(files) - modules} other files, {zip_path.stat().st_size / 1e6:.1f} MB")


def stdlib() -> None:
    root = Path(sysconfig.get_path("stdlib"))
    zip_path = root.parent / f"python{sys.version_info.major}{sys.version_info.minor}.zip"
    assert str(zip_path) in sys.path, f"{zip_path} is not on sys.path: {sys.path}"
    keep = {"lib-dynload", "site-packages", "dist-packages", "__pycache__"}
    paths = [p for p in root.iterdir() if p.name not in keep and (p.is_dir() or p.suffix == ".py")]
    archive_tree(root, paths, zip_path, with_sources=False, data=False)


def without_extensions(path: Path) -> bool:
    """A top-level module, or a regular package with no extension module: its data files, if any, are read through
    importlib.resources, which reads zip archives too (tzdata's time zones)."""
    if path.is_file():
        return path.suffix == ".py"
    files = [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return (path / "__init__.py").is_file() and not any(p.suffix == ".so" for p in files)


def venv(prefix: Path) -> None:
    (site,) = prefix.glob("lib/python*/site-packages")
    zip_path = site.parent / "site-packages.zip"
    moved = [p for p in sorted(site.iterdir()) if p.name not in KEEP_AS_FILES and without_extensions(p)]
    archive_tree(site, moved, zip_path, with_sources=True, data=True)
    (site / "site-packages-zip.pth").write_text(f"{zip_path}\n")
    # The rest (the agent, packages with extension modules or data files) is compiled where it is.
    assert compileall.compile_dir(site, quiet=1, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


if __name__ == "__main__":
    if sys.argv[1:] == ["stdlib"]:
        stdlib()
    elif sys.argv[1:2] == ["venv"] and len(sys.argv) == 3:
        venv(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
