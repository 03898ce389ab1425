"""The node's upstream binaries, built once into the cache: kube-apiserver, kube-controller-manager,
kube-scheduler, kubelet and kubectl of the chosen Kubernetes release (layout.KUBERNETES_VERSION) from its wrapper
module `gomod/v1.<minor>/` (k8s.io/kubernetes with its staging modules replaced by their published releases), and
helm and containerd (with its runc shim and ctr) from their own modules, once for every release. A changed recipe
(the wrapper module, the flags or a version) builds again; otherwise nothing runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpsagent_testing.cluster.layout import (
    BIN,
    COMMANDS,
    CONTAINERD_COMMANDS,
    CONTAINERD_VERSION,
    HELM_VERSION,
    KUBERNETES_VERSION,
    KUBERNETES_VERSIONS,
    TOOLS_BIN,
    VERSION_VARIABLE,
)
from mpsagent_testing.cluster.wrapper_module import folder_name, minor_of, required_release, wrapper_go_mod

GOMOD = Path(__file__).with_name("gomod")
BUILD_TIMEOUT_S = 40 * 60
"""A cold build of v1.37.2's five commands took 7 minutes on 2 cores, helm and containerd 1 each (docs/e2e.md); the
bound leaves room."""
OLDEST_GO_MINOR = 21
"""Go 1.21 is the first that fetches the toolchain a module names (the wrapper modules name Go 1.26)."""

_MINOR = minor_of(KUBERNETES_VERSION)
LDFLAGS = " ".join(
    (
        "-s -w",
        f"-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}",
        "-X k8s.io/component-base/version.gitMajor=1",
        f"-X k8s.io/component-base/version.gitMinor={_MINOR}",
        "-X k8s.io/component-base/version.gitTreeState=clean",
        f"-X k8s.io/client-go/pkg/version.gitVersion={KUBERNETES_VERSION}",
    )
)


_PROGRESS = ("go: downloading ", "go: finding ", "go: extracting ")
"""Lines of go's progress, left out of a failure's tail: a cold `go mod tidy` prints hundreds before its error."""


class BuildError(RuntimeError):
    """A binary could not be built; the message has the tail of Go's output."""


def wrapper_module(version: str = KUBERNETES_VERSION) -> Path:
    """The folder of the wrapper module `version` is built from; BuildError, naming the releases there are, for a
    version the node does not build."""
    if version not in KUBERNETES_VERSIONS:
        raise BuildError(
            f"{VERSION_VARIABLE}={version} is not a Kubernetes release the e2e node builds: "
            f"{', '.join(KUBERNETES_VERSIONS)} (mpsagent_testing/cluster/layout.py)"
        )
    return GOMOD / folder_name(version)


def _recipe(module: Path) -> str:
    digest = hashlib.sha256(LDFLAGS.encode())
    for name in ("go.mod", "go.sum", "tools.go"):
        digest.update((module / name).read_bytes())
    return digest.hexdigest()[:16]


def path(name: str) -> Path:
    """Where the built command `name` is kept: the chosen release's folder for Kubernetes' own, the shared one for
    the tools."""
    return (BIN if name in COMMANDS else TOOLS_BIN) / name


def _stamp(name: str) -> Path:
    return path(name).with_name(f".{name}.recipe")


def _current(name: str, recipe: str) -> bool:
    stamp = _stamp(name)
    return path(name).is_file() and stamp.is_file() and stamp.read_text() == recipe


def _go_minor(go: str) -> int | None:
    """The minor version of the Go at `go` (23 for go1.23.5), as that binary itself says, fetching nothing."""
    try:
        done = subprocess.run(
            [go, "version"], cwd="/", env={**os.environ, "GOTOOLCHAIN": "local"},
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except OSError:
        return None
    found = re.search(r"\bgo1\.(\d+)", done.stdout)
    return int(found.group(1)) if done.returncode == 0 and found else None


def go_candidates(usr_lib: Path = Path("/usr/lib")) -> list[str]:
    """Where a go command may be, in the order tried: on PATH, Go's own tarball (/usr/local/go), then Debian's
    golang-1.N-go packages, newest first (/usr/lib/go-1.N/bin/go, which they put on no PATH: the install script
    installs golang-1.23-go from bookworm-backports where no Go 1.21+ is on PATH)."""
    on_path = shutil.which("go")
    debian = sorted(usr_lib.glob("go-1.*/bin/go"), key=lambda go: int(go.parent.parent.name.rsplit(".", 1)[1]))
    return [*([on_path] if on_path else []), "/usr/local/go/bin/go", *(str(go) for go in reversed(debian))]


def find_go(candidates: list[str]) -> str | None:
    """The first of `candidates` that is a Go 1.21 or newer."""
    for go in candidates:
        minor = _go_minor(go) if Path(go).is_file() else None
        if minor is not None and minor >= OLDEST_GO_MINOR:
            return go
    return None


def _go() -> str:
    candidates = go_candidates()
    go = find_go(candidates)
    if go is None:
        found = [f"{c} (go1.{_go_minor(c)})" for c in candidates if Path(c).is_file() and _go_minor(c) is not None]
        raise BuildError(
            f"no Go 1.{OLDEST_GO_MINOR} or newer (found: {', '.join(found) or 'none'}): the e2e node builds "
            "Kubernetes from its Go modules; scripts/install-system-deps.sh installs golang-1.23-go from "
            "bookworm-backports"
        )
    return go


def _run_go(argv: list[str], cwd: Path, **extra_env: str) -> str:
    """What the go command printed on its standard output; BuildError with the tail of both when it failed."""
    # GOTOOLCHAIN auto (unless the environment says otherwise): a Go older than the release's fetches the one its
    # go.mod names through the proxy, whatever `go env -w` set (1.38 names Go 1.27).
    env = {
        "GOTOOLCHAIN": "auto",
        **os.environ,
        "CGO_ENABLED": "0",
        "GOFLAGS": "-mod=readonly -buildvcs=false",
        **extra_env,
    }
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        said = "".join(line for line in (done.stdout + done.stderr).splitlines(True) if not line.startswith(_PROGRESS))
        raise BuildError(f"{' '.join(argv[:3])} ... failed:\n{said[-4000:]}")
    return done.stdout


def ensure_wrapper_module(version: str = KUBERNETES_VERSION, *, log: bool = True) -> Path:
    """The folder of `version`'s wrapper module, made first where it is missing or requires another patch (a release
    or patch just added to KUBERNETES_VERSIONS): its go.mod from the release's own (fetched through the module
    proxy), then `go mod tidy`. Made aside and moved into place whole, so that a failure leaves nothing half-made."""
    module = wrapper_module(version)
    if required_release(module) == version:
        return module
    shown = module.relative_to(GOMOD.parents[2])
    if log:
        print(f"e2e-cluster: making {shown}/ for {version} from its go.mod", file=sys.stderr)
    go = _go()
    with tempfile.TemporaryDirectory(dir=GOMOD, prefix=f".{module.name}.", ignore_cleanup_errors=True) as made:
        fetched = json.loads(_run_go([go, "mod", "download", "-json", f"k8s.io/kubernetes@{version}"], Path(made)))
        try:
            go_mod = wrapper_go_mod(version, Path(fetched["GoMod"]).read_text())
        except ValueError as exc:  # a release in the table that is no Kubernetes 1.x, or a go.mod not its kind
            raise BuildError(f"{exc} (KUBERNETES_VERSIONS, mpsagent_testing/cluster/layout.py)") from None
        (Path(made) / "go.mod").write_text(go_mod)
        shutil.copy(next(GOMOD.glob("v1.*/tools.go")), Path(made) / "tools.go")  # the same in every release
        _run_go([go, "mod", "tidy"], Path(made), GOFLAGS="")
        Path(made).chmod(0o755)  # a temporary folder is its owner's alone
        shutil.rmtree(module, ignore_errors=True)
        Path(made).rename(module)
    if log:
        print(f"e2e-cluster: made {shown}/: commit it with the table", file=sys.stderr)
    return module


def ensure_binaries(log: bool = True) -> dict[str, float]:
    """Build what is missing or stale; the seconds each build took (empty when everything was current)."""
    module = ensure_wrapper_module(log=log)
    took: dict[str, float] = {}
    recipe = _recipe(module)
    stale = [name for name in COMMANDS if not _current(name, recipe)]
    if stale:
        if log:
            what = f"{', '.join(stale)} {KUBERNETES_VERSION}"
            print(f"e2e-cluster: building {what} (cold: about 7 min on 2 cores)", file=sys.stderr)
        BIN.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        packages = [f"k8s.io/kubernetes/cmd/{name}" for name in stale]
        _run_go([_go(), "build", "-trimpath", "-ldflags", LDFLAGS, "-o", str(BIN) + "/", *packages], module)
        for name in stale:
            _stamp(name).write_text(recipe)
        took["kubernetes"] = time.monotonic() - started
    installs = {
        "helm": (("helm",), [f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"]),
        "containerd": (
            CONTAINERD_COMMANDS,
            [f"github.com/containerd/containerd/v2/cmd/{name}@{CONTAINERD_VERSION}" for name in CONTAINERD_COMMANDS],
        ),
    }
    for part, (names, modules) in installs.items():
        recipe = " ".join(modules)
        if all(_current(name, recipe) for name in names):
            continue
        if log:
            print(f"e2e-cluster: building {', '.join(names)} ({modules[0].rsplit('@', 1)[1]})", file=sys.stderr)
        TOOLS_BIN.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        _run_go([_go(), "install", "-trimpath", "-ldflags", "-s -w", *modules], TOOLS_BIN, GOBIN=str(TOOLS_BIN),
                GOFLAGS="")  # fmt: skip
        for name in names:
            _stamp(name).write_text(recipe)
        took[part] = time.monotonic() - started
    return took


def binary(name: str) -> Path:
    """The cached binary `name`; BuildError (saying what builds it) when it is not there."""
    built = path(name)
    if not built.is_file():
        raise BuildError(f"{built} is missing: `scripts/e2e-cluster build` builds it")
    return built
