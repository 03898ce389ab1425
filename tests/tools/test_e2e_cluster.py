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
