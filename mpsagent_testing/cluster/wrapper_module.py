"""A Kubernetes release's wrapper module (`gomod/v1.<minor>/`), made from the release's own go.mod: what adding a
release to `layout.KUBERNETES_VERSIONS` needs besides that one line, so that `scripts/e2e-cluster build` makes it.

`k8s.io/kubernetes` replaces its staging modules (`k8s.io/api`, `k8s.io/kubelet`, ...) with directories of its own
tree, which a module that requires it cannot use; the wrapper replaces each with its published release of the same
patch (`v0.<minor>.<patch>` for `v1.<minor>.<patch>`), and `go mod tidy` writes the rest from the proxy."""

from __future__ import annotations

import re
from pathlib import Path

MODULE_PATH = "mpsagent.test/kubernetes"
HEADER = (
    "// The upstream Kubernetes commands the e2e node runs, built from their published modules "
    "(mpsagent_testing/cluster/build.py).\n"
    "// k8s.io/kubernetes replaces its staging modules with local directories, which a dependent cannot use: each is\n"
    "// replaced here with its published release of the same minor version.\n"
)
LEFT_OUT = ("k8s.io/code-generator", "k8s.io/sample-")
"""Staging modules no command of the node imports (the generators and the samples): not replaced."""

_STAGING = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", re.MULTILINE)
_GO = re.compile(r"^go (\S+)$", re.MULTILINE)
_REQUIRED = re.compile(r"^require k8s\.io/kubernetes (\S+)$", re.MULTILINE)


def minor_of(version: str) -> str:
    """The minor release of Kubernetes `version`, `38` for v1.38.0-beta.0, which names its wrapper's folder."""
    return version.lstrip("v").split(".")[1]


def folder_name(version: str) -> str:
    """The wrapper module's folder for `version` in `gomod/`: one per minor release, `v1.38`."""
    return f"v1.{minor_of(version)}"


def staging_release(version: str) -> str:
    """The staging modules' release of Kubernetes `version`: v0.38.0-beta.0 for v1.38.0-beta.0."""
    major, _, rest = version.lstrip("v").partition(".")
    if major != "1" or not rest:
        raise ValueError(f"{version} is not a Kubernetes 1.x release (v1.<minor>.<patch>)")
    return f"v0.{rest}"


def staging_modules(kubernetes_go_mod: str) -> list[str]:
    """The staging modules `k8s.io/kubernetes`'s go.mod replaces with its own directories, those the node needs."""
    return [name for name in _STAGING.findall(kubernetes_go_mod) if not name.startswith(LEFT_OUT)]


def wrapper_go_mod(version: str, kubernetes_go_mod: str) -> str:
    """The wrapper's go.mod before `go mod tidy`: the release required, its staging modules replaced, the Go version
    the release names."""
    go = _GO.search(kubernetes_go_mod)
    modules = staging_modules(kubernetes_go_mod)
    if go is None or not modules:
        raise ValueError(f"k8s.io/kubernetes {version}'s go.mod names no Go version or no staging module")
    release = staging_release(version)
    replaced = "".join(f"\t{name} => {name} {release}\n" for name in modules)
    return (
        f"{HEADER}module {MODULE_PATH}\n\ngo {go.group(1)}\n\nrequire k8s.io/kubernetes {version}\n\n"
        f"replace (\n{replaced})\n"
    )


def required_release(folder: Path) -> str | None:
    """The release the wrapper module in `folder` requires; None when there is none there."""
    try:
        found = _REQUIRED.search((folder / "go.mod").read_text())
    except FileNotFoundError:
        return None
    return found.group(1) if found else None
