"""docs/architecture.md tells the story of the tree as it is: every path and module it names exists (and every
attribute it names of one), and every module of the agent is named in it; and the tests keep its rules for them: no
test module imports another (what two share is in `mpsagent_testing`), `mpsagent_testing` imports only the agent's
public names, and neither tests/ nor bench/ changes sys.path to import something."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpsagent_testing.repo import ROOT

DOC = ROOT / "docs" / "architecture.md"
AGENT = ROOT / "mpsagent"
TESTING = ROOT / "mpsagent_testing"
TESTS = ROOT / "tests"
BENCH = ROOT / "bench"
SYS_PATH_CHANGES = {"insert", "append", "extend", "remove", "pop", "clear"}
FILE_NAME = re.compile(r".*\.(sock|json|yaml|md|py)")
"""A file's name, which looks like a module."""
API_GROUP = re.compile(r"[a-z.]+\.k8s\.io/.*")
"""An API group and version, which looks like a path."""
PACKAGES = sorted(p.name for p in AGENT.iterdir() if (p / "__init__.py").exists() and not p.name.startswith("_"))
QUOTED = re.compile(r"`([^`\s]+)`")
PATH = re.compile(r"(?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*")
DOTTED = re.compile(r"(?:mpsagent\.)?([a-z_]+)\.([a-z_]+)((?:\.[A-Za-z_]+)*)(?:\(\))?")


def quoted() -> list[str]:
    return QUOTED.findall(DOC.read_text())


def test_every_path_it_names_exists() -> None:
    missing = []
    for token in quoted():
        if not PATH.fullmatch(token) or "<" in token or token.startswith("/") or API_GROUP.fullmatch(token):
            continue
        path = token.rstrip("/")
        if not any((base / path).exists() for base in (AGENT, TESTING, ROOT)):
            missing.append(token)
    assert missing == [], f"docs/architecture.md names paths that are not in the tree: {missing}"


def test_every_module_and_attribute_it_names_exists() -> None:
    missing = []
    for token in quoted():
        match = DOTTED.fullmatch(token)
        if match is None or match[1] not in PACKAGES or FILE_NAME.fullmatch(token):
            continue
        package, module, rest = match[1], match[2], match[3]
        name = f"mpsagent.{package}.{module}"
        try:
            found: object = importlib.import_module(name)
        except ModuleNotFoundError:
            missing.append(token)
            continue
        for part in rest.split(".")[1:]:
            if not hasattr(found, part):
                missing.append(token)
                break
            found = getattr(found, part)
    assert missing == [], f"docs/architecture.md names modules or attributes that do not exist: {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_of_the_agent_is_named(package: str) -> None:
    text = DOC.read_text()
    names = set(quoted())
    unnamed = [
        module.stem
        for module in sorted((AGENT / package).glob("*.py"))
        if module.stem != "__init__"
        and not {module.stem, f"{package}/{module.name}", f"{package}.{module.stem}"} & names
        and not re.search(rf"`{package}\.{module.stem}[.`(]", text)
    ]
    assert unnamed == [], f"docs/architecture.md does not name these modules of {package}/: {unnamed}"


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, the module named) of every import in a Python file; a relative import's name starts with its dots."""
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, "." * node.level + (node.module or "")


def test_no_test_module_imports_another() -> None:
    files = sorted(TESTS.rglob("*.py"))
    test_modules = {"tests", *(path.stem for path in files)}
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in files
        for line, name in imports(path)
        if name.startswith(".") or name.split(".")[0] in test_modules
    ]
    assert found == [], f"test modules import other test modules (move what they share to mpsagent_testing): {found}"


def test_the_test_support_imports_only_the_agent_s_public_names() -> None:
    found = []
    for path in sorted(TESTING.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mpsagent":
                named = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                named = [alias.name for alias in node.names if alias.name.split(".")[0] == "mpsagent"]
            else:
                continue
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                for name in named
                if any(part.startswith("_") for part in name.split("."))
            ]
    assert found == [], f"mpsagent_testing imports private names of the agent (give them a public name): {found}"


def is_sys_path(node: ast.expr) -> bool:
    """`sys.path`, or an item or slice of it."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys"


def changes_sys_path(node: ast.AST) -> bool:
    """`sys.path.insert(...)` and the other changing methods, and an assignment to or deletion of it or its items."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in SYS_PATH_CHANGES and is_sys_path(node.func.value)
    if isinstance(node, ast.Assign | ast.Delete):
        return any(map(is_sys_path, node.targets))
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return is_sys_path(node.target)
    return False


def test_no_test_or_bench_module_changes_sys_path() -> None:
    """A module found through an edited sys.path is found by whichever module edits it first;
    `mpsagent_testing.packaging.script` loads the packaging's scripts from their files instead."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted([*TESTS.rglob("*.py"), *BENCH.rglob("*.py")])
        for node in ast.walk(ast.parse(path.read_bytes(), str(path)))
        if isinstance(node, ast.stmt | ast.expr) and changes_sys_path(node)
    ]
    assert found == [], f"these lines change sys.path: {found}"


# --- "Where a change goes": each entry's named files real, and the ones a change must touch named ---------------

CHANGE_ENTRY = re.compile(r"^- \*\*(.+?)\*\*(.*?)(?=^- \*\*|\Z)", re.S | re.M)
MODULES = {path.stem: path for path in AGENT.rglob("*.py") if "_proto" not in path.parts and path.stem != "__init__"}
UNIQUE_MODULES = {stem: path for stem, path in MODULES.items() if sum(p.stem == stem for p in AGENT.rglob("*.py")) == 1}


def change_entries() -> dict[str, str]:
    section = DOC.read_text().split("\n## Where a change goes\n", 1)[1].split("\n## ", 1)[0]
    return {match[1]: match[2] for match in CHANGE_ENTRY.finditer(section)}


def named_files(entry: str) -> tuple[set[Path], list[str]]:
    """The files an entry's quoted names point at (a path, `package.module`, `module.attribute` or a module's name),
    and the names that look like code but point at nothing (a module that is not there, an attribute it lacks)."""
    found: set[Path] = set()
    broken: list[str] = []
    for token in QUOTED.findall(entry):
        name = token.removesuffix("()")
        if "/" in name and not name.startswith(("-", "/")):
            path = next((base / name for base in (AGENT, ROOT) if (base / name).exists()), None)
            if path is None:
                broken.append(token)
            elif path.is_file() and path.is_relative_to(AGENT):
                found.add(path)
            continue
        parts = name.split(".")
        if not all(part.isidentifier() for part in parts):
            continue  # a flag, a file name, a message
        if parts[0] in PACKAGES and len(parts) > 1:
            module_path: Path | None = AGENT / parts[0] / f"{parts[1]}.py"
            attributes = parts[2:]
        elif parts[0] in UNIQUE_MODULES:
            module_path, attributes = UNIQUE_MODULES[parts[0]], parts[1:]
        elif len(parts) > 1 and parts[0].islower():
            if not _resolves(parts):
                broken.append(token)  # `module.attribute` of no module, the agent's or another's
            continue
        else:
            continue  # a class, a method, an RPC: named beside its module
        assert module_path is not None
        if not module_path.exists():
            broken.append(token)
            continue
        found.add(module_path)
        target: object = importlib.import_module(".".join(module_path.relative_to(ROOT).with_suffix("").parts))
        for attribute in attributes:
            if not hasattr(target, attribute):
                broken.append(token)
                break
            target = getattr(target, attribute)
    return found, broken


def _resolves(parts: list[str]) -> bool:
    """Whether `parts` name a module outside the agent (the standard library, a dependency) and its attributes."""
    try:
        target: object = importlib.import_module(parts[0])
    except ModuleNotFoundError:
        return False
    for attribute in parts[1:]:
        if not hasattr(target, attribute):
            return False
        target = getattr(target, attribute)
    return True


def files_using(*names: str) -> set[Path]:
    """The agent's modules that use any of these names (a name or an attribute, not only an import)."""
    using = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Name) and node.id in names) or (
                isinstance(node, ast.Attribute) and node.attr in names
            ):
                using.add(path)
                break
    return using


@pytest.mark.parametrize("entry", sorted(change_entries()))
def test_each_entry_of_where_a_change_goes_names_real_files(entry: str) -> None:
    found, broken = named_files(change_entries()[entry])
    assert broken == [], f"'{entry}' names what is not in the tree: {broken}"
    assert found, f"'{entry}' names no file of the agent"


@pytest.mark.parametrize(
    ("entry", "names"),
    [
        ("A new share kind", ("GrantKind",)),
        ("A new route", ("carry_out",)),
        ("A new enforcement layer", ("Enforcement", "MemoryLimitDevice")),
    ],
)
def test_an_entry_names_every_module_the_change_must_touch(entry: str, names: tuple[str, ...]) -> None:
    """A module that uses what the entry is about (the grant kind; the grant transaction every route carries out;
    the enforcement word and the memory-limit device) is one a change of that kind touches: the entry names it."""
    (text,) = [body for title, body in change_entries().items() if title.startswith(entry)]
    named, _ = named_files(text)
    unnamed = sorted(str(path.relative_to(ROOT)) for path in files_using(*names) - named)
    assert unnamed == [], f"'{entry}' in docs/architecture.md does not name: {unnamed}"
