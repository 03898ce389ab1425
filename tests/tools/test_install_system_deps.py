"""scripts/install-system-deps.sh's Go: on a PATH with no Go 1.21 or newer (Debian 12's own is 1.19) it enables
bookworm-backports and installs golang-1.23-go with the rest, and with one it does neither. The script runs for real
on a PATH of stubs: an apt-get that records what it was asked, an `id` that says root, a `go` of a chosen version,
and apt's sources in a copy (APT_ETC); nothing is installed."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpsagent_testing.repo import ROOT

SCRIPT = ROOT / "scripts" / "install-system-deps.sh"
TOOLS = ("sed", "grep", "head")
"""The commands the script uses besides the stubs, linked from the machine into the test's PATH: nothing else of the
machine's PATH (its Go included) is on it."""

# Debian 12's own deb822 source, on a mirror of the machine's own, as the bookworm images ship it.
DEB822 = """Types: deb
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
ONE_LINE = """deb http://mirror.example/debian bookworm main
deb http://mirror.example/debian-security bookworm-security main
"""


@dataclass
class Machine:
    """A fresh Debian 12 as the script sees it: apt's sources, and a PATH of stubs."""

    apt: Path
    bin: Path
    asked: Path

    def go(self, version: str) -> None:
        go = self.bin / "go"
        go.write_text(f'#!/bin/sh\n[ "$1" = version ] && echo "go version {version} linux/amd64"\n')
        go.chmod(0o755)

    def install(self) -> list[str]:
        """Run the script; what apt-get was asked, one call a line."""
        done = subprocess.run(
            ["/bin/sh", str(SCRIPT)],
            env={"PATH": str(self.bin), "APT_ETC": str(self.apt)},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return self.asked.read_text().splitlines()

    def sources(self) -> dict[str, str]:
        return {path.name: path.read_text() for path in sorted((self.apt / "sources.list.d").iterdir())}


def machine(tmp_path: Path, sources: dict[str, str]) -> Machine:
    apt, bin_dir, asked = tmp_path / "etc-apt", tmp_path / "bin", tmp_path / "apt-get.asked"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in sources.items():
        (apt / name).write_text(text)
    bin_dir.mkdir()
    for name, text in {"apt-get": f'#!/bin/sh\necho "$*" >>{asked}\n', "id": "#!/bin/sh\necho 0\n"}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(next(p for d in ("/bin", "/usr/bin") if (p := Path(d) / tool).is_file()))
    return Machine(apt=apt, bin=bin_dir, asked=asked)


@pytest.fixture
def deb822_machine(tmp_path: Path) -> Machine:
    return machine(tmp_path, {"sources.list.d/debian.sources": DEB822})


def installed(asked: list[str]) -> list[str]:
    (install,) = [line for line in asked if line.startswith("install ")]
    return install.split()


@pytest.mark.parametrize("go", [None, "go1.19.8"], ids=["no go", "Debian 12's go 1.19"])
def test_without_a_go_1_21_it_enables_bookworm_backports_and_installs_golang_1_23(
    deb822_machine: Machine, go: str | None
) -> None:
    if go:
        deb822_machine.go(go)
    asked = deb822_machine.install()
    assert asked[0] == "update -q"
    assert "golang-1.23-go" in installed(asked)
    assert "etcd-server" in installed(asked)  # with the rest, in the one install
    assert deb822_machine.sources()["bookworm-backports.sources"] == (
        "Types: deb\n"
        "URIs: http://mirror.example/debian\n"
        "Suites: bookworm-backports\n"
        "Components: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )


def test_with_a_go_1_21_or_newer_on_path_it_adds_neither_backports_nor_go(deb822_machine: Machine) -> None:
    deb822_machine.go("go1.23.5")
    asked = deb822_machine.install()
    assert not [name for name in installed(asked) if name.startswith("golang")]
    assert sorted(deb822_machine.sources()) == ["debian.sources"]


def test_a_one_line_sources_list_gets_a_one_line_backports_source(tmp_path: Path) -> None:
    one_line = machine(tmp_path, {"sources.list": ONE_LINE})
    assert "golang-1.23-go" in installed(one_line.install())
    assert one_line.sources() == {
        "bookworm-backports.list": "deb http://mirror.example/debian bookworm-backports main\n"
    }


def test_with_bookworm_backports_already_listed_it_adds_no_source(tmp_path: Path) -> None:
    listed = machine(
        tmp_path, {"sources.list": ONE_LINE + "deb http://mirror.example/debian bookworm-backports main\n"}
    )
    assert "golang-1.23-go" in installed(listed.install())
    assert listed.sources() == {}


def test_run_twice_on_a_fresh_machine_it_writes_the_backports_source_once(deb822_machine: Machine) -> None:
    deb822_machine.install()
    first = deb822_machine.sources()
    deb822_machine.install()
    assert deb822_machine.sources() == first
    assert sorted(first) == ["bookworm-backports.sources", "debian.sources"]
