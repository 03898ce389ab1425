"""The project's own artefacts, built for tests: the one-file executable (packaging/binary/build.sh) and the two
container images, built with podman (as root) from a Debian base that debootstrap makes
(packaging/container/debian-base.sh, cached under /var/cache/mpsagent-image). Images stay tagged
`localhost/mpsagent-test:*`, so that a second run reuses their layers; an image a build replaces is removed.

Containers cannot be started with podman on these machines (crun: "cgroups in hybrid mode not supported"): RUN steps
use chroot isolation on the host's network. The real node (`mpsagent_testing.cluster`) runs the images through
containerd, after `save_archive`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mpsagent_testing.repo import ROOT

PACKAGING = ROOT / "packaging"
BUILD_SH = PACKAGING / "binary" / "build.sh"
DOCKERFILE = PACKAGING / "container" / "Dockerfile"
DOCKERIGNORE = PACKAGING / "container" / "Dockerfile.dockerignore"
ONEFILE_DOCKERFILE = PACKAGING / "container" / "Dockerfile.onefile"
DEBIAN_BASE = PACKAGING / "container" / "debian-base.sh"
VENV_TAG = "localhost/mpsagent-test:venv"
ONEFILE_TAG = "localhost/mpsagent-test:onefile"

BUILD_TIMEOUT_S = 540
IMAGE_TIMEOUT_S = 600
COMMAND_TIMEOUT_S = 60


class ImageBuildError(AssertionError):
    """A build step failed; the message has its output's tail."""


def run(*argv: str | Path, timeout: float = COMMAND_TIMEOUT_S, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT, **kw
    )


def podman(*args: str | Path, timeout: float = COMMAND_TIMEOUT_S) -> str:
    done = run("podman", *args, timeout=timeout)
    if done.returncode != 0:
        raise ImageBuildError(f"podman {args[0]}: {done.stderr[-3000:]}")
    return done.stdout


def build_binary(out: Path) -> Path:
    """The one-file executable, built into `out/dist/mpsagent` (about 25 s on 2 cores)."""
    env = {**os.environ, "PYTHON": sys.executable, "DIST_DIR": str(out / "dist"), "WORK_DIR": str(out / "work")}
    built = run(BUILD_SH, env=env, timeout=BUILD_TIMEOUT_S)
    if built.returncode != 0:
        raise ImageBuildError(built.stdout + built.stderr)
    path = out / "dist" / "mpsagent"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ImageBuildError(f"{BUILD_SH} made no executable {path}")
    return path


def pip_ca_bundle() -> Path | None:
    """The CA bundle the build host's pip is told to trust, if any: the build's pip trusts it too."""
    for variable in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        value = os.environ.get(variable)
        if value and Path(value).is_file():
            return Path(value)
    return None


def base_image() -> str:
    """The Debian base image's tag, made by debian-base.sh when its recipe changed."""
    done = run(DEBIAN_BASE, timeout=IMAGE_TIMEOUT_S)
    if done.returncode != 0:
        raise ImageBuildError(done.stderr[-3000:])
    return done.stdout.split()[-1]


def image_id(tag: str) -> str | None:
    done = run("podman", "image", "inspect", "--format", "{{.Id}}", tag)
    return done.stdout.strip() if done.returncode == 0 else None


def build_image(base: str, tag: str, dockerfile: Path, context: Path, *extra: str | Path) -> str:
    ca = pip_ca_bundle()
    secret = ("--secret", f"id=pip-ca,src={ca}") if ca else ()
    isolation = ("--isolation", "chroot", "--network", "host")
    previous = image_id(tag)
    podman("build", *isolation, "--build-arg", f"BASE_IMAGE={base}", *secret, *extra, "-f", dockerfile, "-t", tag,
           context, timeout=IMAGE_TIMEOUT_S)  # fmt: skip
    if previous not in (None, image_id(tag)):
        run("podman", "rmi", previous)  # the image this run replaced, with its layers (best effort)
    return tag


def venv_image(base: str) -> str:
    return build_image(base, VENV_TAG, DOCKERFILE, ROOT, "--ignorefile", DOCKERIGNORE)


def onefile_image(base: str, binary: Path) -> str:
    return build_image(base, ONEFILE_TAG, ONEFILE_DOCKERFILE, binary.parent)


def save_archive(tag: str, path: Path) -> Path:
    """The image as a docker archive at `path` (what `ctr images import` reads), named `tag` inside."""
    path.unlink(missing_ok=True)
    podman("save", "--format", "docker-archive", "-o", path, tag, timeout=IMAGE_TIMEOUT_S)
    return path
