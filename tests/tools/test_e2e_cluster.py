"""scripts/e2e-cluster's choice of Kubernetes release without building anything: each release in the table has a
wrapper module that builds exactly that release, `MPSAGENT_E2E_KUBERNETES` picks the release (and its own cache
folder, the tools' shared) for every process that reads the layout, one the node does not build is refused before
anything is made, and the build finds a Go 1.21 or newer where Debian puts its backported Go."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpsagent_testing.cluster import build, layout
from mpsagent_testing.cluster.wrapper_module import wrapper_go_mod
from mpsagent_testing.repo import ROOT


def _layout_seen_with(environ: dict[str, str]) -> dict[str, str]:
    """The release and cache folders a fresh process reads from the layout with `environ` added."""
    code = (
        "import json; from mpsagent_testing.cluster import layout as l; "
        "print(json.dumps({'version': l.KUBERNETES_VERSION, 'bin': str(l.BIN), 'tools': str(l.TOOLS_BIN), "
        "'images': str(l.IMAGES)}))"
    )
    env = {key: value for key, value in os.environ.items() if key != layout.VERSION_VARIABLE}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**env, **environ}, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout))


@pytest.mark.parametrize("version", layout.KUBERNETES_VERSIONS)
def test_each_release_s_wrapper_module_builds_that_release(version: str) -> None:
    module = build.wrapper_module(version)
    go_mod = (module / "go.mod").read_text()
    assert re.findall(r"^require k8s\.io/kubernetes (\S+)$", go_mod, re.MULTILINE) == [version]
    staging = re.findall(r"^\tk8s\.io/(\S+) => k8s\.io/\1 (\S+)$", go_mod, re.MULTILINE)
    assert len(staging) > 20
    assert {pinned for _, pinned in staging} == {version.replace("v1.", "v0.", 1)}
    assert f"k8s.io/kubernetes {version} h1:" in (module / "go.sum").read_text()
    tools = set(re.findall(r'_ "k8s\.io/kubernetes/cmd/([\w-]+)"', (module / "tools.go").read_text()))
    assert tools == set(layout.COMMANDS)


def test_the_default_is_the_newest_release_and_the_variable_picks_another_with_its_own_cache() -> None:
    assert layout.KUBERNETES_VERSIONS[0] == max(
        layout.KUBERNETES_VERSIONS, key=lambda v: tuple(int(n) for n in v[1:].split("."))
    )
    default = _layout_seen_with({})
    older = _layout_seen_with({layout.VERSION_VARIABLE: layout.KUBERNETES_VERSIONS[1]})
    assert default["version"] == layout.KUBERNETES_VERSIONS[0]
    assert older["version"] == layout.KUBERNETES_VERSIONS[1]
    assert default["bin"] != older["bin"]  # switching releases rebuilds neither's commands
    assert (default["tools"], default["images"]) == (older["tools"], older["images"])  # nor helm, containerd, images


def test_a_release_the_node_does_not_build_is_refused_naming_those_it_does() -> None:
    unknown = "v1.35.0"
    done = subprocess.run(
        [sys.executable, "-m", "mpsagent_testing.cluster", "build"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", layout.VERSION_VARIABLE: unknown},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"e2e-cluster build: MPSAGENT_E2E_KUBERNETES={unknown} is not a Kubernetes release the e2e node builds: "
        f"{', '.join(layout.KUBERNETES_VERSIONS)} (mpsagent_testing/cluster/layout.py)"
    )
    assert not (layout.CACHE_ROOT / unknown).exists()


def _fake_go(path: Path, version: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\n[ "$1" = version ] && echo "go version {version} linux/amd64"\n')
    path.chmod(0o755)
    return str(path)


def test_debian_s_backported_go_is_found_past_an_older_go_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path = _fake_go(tmp_path / "bin" / "go", "go1.19.8")  # Debian 12's golang-go
    debian_119 = _fake_go(tmp_path / "lib" / "go-1.19" / "bin" / "go", "go1.19.8")
    debian_123 = _fake_go(tmp_path / "lib" / "go-1.23" / "bin" / "go", "go1.23.5")  # golang-1.23-go, backports
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    candidates = build.go_candidates(usr_lib=tmp_path / "lib")
    assert candidates == [on_path, "/usr/local/go/bin/go", debian_123, debian_119]
    assert build.find_go([on_path, debian_123, debian_119]) == debian_123
    assert build.find_go([on_path, debian_119]) is None


RELEASE_GO_MOD = """module k8s.io/kubernetes

go 1.27.0

godebug default=go1.27

require k8s.io/api v0.0.0

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/code-generator => ./staging/src/k8s.io/code-generator
\tk8s.io/kubelet => ./staging/src/k8s.io/kubelet
\tk8s.io/sample-apiserver => ./staging/src/k8s.io/sample-apiserver
\tgithub.com/elsewhere/thing => github.com/elsewhere/thing v1.2.3
)
"""
"""What matters of a release's own go.mod: its Go version and which modules it replaces with its staging tree."""

FAKE_GO = """#!{python}
import json, os, pathlib, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GO_CALLS"], "a") as calls:
    calls.write(" ".join(args) + "\\n")
if args[:3] == ["mod", "download", "-json"]:
    print(json.dumps({{"Path": "k8s.io/kubernetes", "GoMod": os.environ["FAKE_GO_RELEASE_MOD"]}}))
elif args == ["mod", "tidy"]:
    if os.environ.get("FAKE_GO_TIDY_FAILS"):
        sys.exit("go: downloading k8s.io/api v0.38.0\\ngo: sigs.k8s.io/gone@v1.0.0: 403 Forbidden")
    required = pathlib.Path("go.mod").read_text().split("require k8s.io/kubernetes ")[1].split()[0]
    pathlib.Path("go.sum").write_text(f"k8s.io/kubernetes {{required}} h1:fake=\\n")
else:
    sys.exit(f"fake go: unexpected {{args}}")
"""


@pytest.fixture
def gomod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the wrapper modules' folder the build reads, and a go command that fetches a release's go.mod
    (RELEASE_GO_MOD) and tidies, recording its calls."""
    folder = tmp_path / "repo" / "cluster" / "gomod"
    (folder / "v1.37").mkdir(parents=True)
    for name in ("go.mod", "go.sum", "tools.go"):
        (folder / "v1.37" / name).write_bytes((build.GOMOD / "v1.37" / name).read_bytes())
    go = tmp_path / "go"
    go.write_text(FAKE_GO.format(python=sys.executable))
    go.chmod(0o755)
    (tmp_path / "release.mod").write_text(RELEASE_GO_MOD)
    monkeypatch.setenv("FAKE_GO_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("FAKE_GO_RELEASE_MOD", str(tmp_path / "release.mod"))
    monkeypatch.setattr(build, "GOMOD", folder)
    monkeypatch.setattr(build, "_go", lambda: str(go))
    return folder


def go_calls(gomod: Path) -> list[str]:
    calls = gomod.parents[2] / "calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_a_release_added_to_the_table_gets_its_wrapper_module_made_from_its_own_go_mod(
    gomod: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "KUBERNETES_VERSIONS", ("v1.38.0", *layout.KUBERNETES_VERSIONS))
    made = build.ensure_wrapper_module("v1.38.0", log=False)
    assert made == gomod / "v1.38"
    go_mod = (made / "go.mod").read_text()
    assert "\ngo 1.27.0\n" in go_mod  # the Go the release names
    assert re.findall(r"^require k8s\.io/kubernetes (\S+)$", go_mod, re.MULTILINE) == ["v1.38.0"]
    # Its staging modules at their release of the same patch; the generators and samples no command imports, and
    # what it replaces with other modules, left out.
    assert re.findall(r"^\t(\S+) => (\S+) (\S+)$", go_mod, re.MULTILINE) == [
        ("k8s.io/api", "k8s.io/api", "v0.38.0"),
        ("k8s.io/kubelet", "k8s.io/kubelet", "v0.38.0"),
    ]
    assert (made / "go.sum").read_text() == "k8s.io/kubernetes v1.38.0 h1:fake=\n"  # go mod tidy ran there
    assert (made / "tools.go").read_bytes() == (gomod / "v1.37" / "tools.go").read_bytes()
    assert go_calls(gomod) == ["mod download -json k8s.io/kubernetes@v1.38.0", "mod tidy"]
    assert sorted(p.name for p in gomod.iterdir()) == ["v1.37", "v1.38"]  # nothing made aside is left

    assert build.ensure_wrapper_module("v1.38.0", log=False) == made  # made once: the next build asks go nothing
    assert len(go_calls(gomod)) == 2


def test_a_new_patch_of_a_listed_release_remakes_its_wrapper_module_and_a_failure_leaves_the_old_one(
    gomod: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "KUBERNETES_VERSIONS", ("v1.37.3",))
    before = {name: (gomod / "v1.37" / name).read_bytes() for name in ("go.mod", "go.sum", "tools.go")}
    monkeypatch.setenv("FAKE_GO_TIDY_FAILS", "1")
    with pytest.raises(build.BuildError) as failed:
        build.ensure_wrapper_module("v1.37.3", log=False)
    assert "sigs.k8s.io/gone@v1.0.0: 403 Forbidden" in str(failed.value)
    assert "go: downloading" not in str(failed.value)  # go's progress left out of the tail
    assert {name: (gomod / "v1.37" / name).read_bytes() for name in before} == before
    assert [p.name for p in gomod.iterdir()] == ["v1.37"]

    monkeypatch.delenv("FAKE_GO_TIDY_FAILS")
    build.ensure_wrapper_module("v1.37.3", log=False)
    assert build.wrapper_module("v1.37.3") == gomod / "v1.37"
    assert "require k8s.io/kubernetes v1.37.3\n" in (gomod / "v1.37" / "go.mod").read_text()
    assert (gomod / "v1.37" / "go.sum").read_text() == "k8s.io/kubernetes v1.37.3 h1:fake=\n"


@pytest.mark.parametrize("version", layout.KUBERNETES_VERSIONS)
def test_each_committed_wrapper_module_is_what_its_release_s_go_mod_makes(version: str) -> None:
    """The committed go.mod, its indirect requirements aside (go mod tidy writes those), is what `wrapper_go_mod`
    makes from a release's go.mod that replaces those staging modules, a generator and a sample."""
    committed = (build.wrapper_module(version) / "go.mod").read_text()
    staging = re.findall(r"^\t(k8s\.io/\S+) => ", committed, re.MULTILINE)
    go = re.findall(r"^go (\S+)$", committed, re.MULTILINE)[0]
    replaced = [*staging, "k8s.io/code-generator", "k8s.io/sample-controller"]
    release_go_mod = (
        f"module k8s.io/kubernetes\n\ngo {go}\n\nreplace (\n"
        + "".join(f"\t{name} => ./staging/src/{name}\n" for name in replaced)
        + ")\n"
    )
    without_indirect = re.sub(r"\nrequire \(\n.*?\n\)\n", "", committed, flags=re.DOTALL)
    assert wrapper_go_mod(version, release_go_mod) == without_indirect


def test_a_release_in_the_table_that_is_no_kubernetes_1_x_is_refused_naming_the_table(
    gomod: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "KUBERNETES_VERSIONS", ("v2.0.0",))
    with pytest.raises(build.BuildError) as refused:
        build.ensure_wrapper_module("v2.0.0", log=False)
    assert str(refused.value) == (
        "v2.0.0 is not a Kubernetes 1.x release (v1.<minor>.<patch>) "
        "(KUBERNETES_VERSIONS, mpsagent_testing/cluster/layout.py)"
    )
    assert [p.name for p in gomod.iterdir()] == ["v1.37"]
