"""Packaging: the one-file executable, the systemd units, the container images and the Kubernetes manifests.

The one-file build is slow (about 25 s on 2 cores): it is built once per module, into a
temporary directory, and removed afterwards. The two images are built with podman (as root) from a Debian base
made by debootstrap (packaging/container/debian-base.sh, cached under /var/cache/mpsagent-image), and kept tagged
`localhost/mpsagent-test:*` so that a second run reuses their layers (an image a run replaces is removed;
`podman image prune` removes the build stages of older sources).
"""

from __future__ import annotations

import json
import os
import pkgutil
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from mpsagent_testing.cluster.layout import KUBERNETES_VERSIONS
from mpsagent_testing.images import DOCKERFILE, IMAGE_TIMEOUT_S, podman
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.node import small_node, write_config
from mpsagent_testing.packaging import DRA_RULES, script
from mpsagent_testing.repo import EXAMPLES, H100_NODE, ROOT

PACKAGING = ROOT / "packaging"
HOOK = PACKAGING / "binary" / "rthook_mpsagent.py"
GLIBC_FLOOR = PACKAGING / "binary" / "glibc_floor.py"
UNIT = PACKAGING / "systemd" / "mpsagent.service"
SHM_MOUNT = PACKAGING / "systemd" / "run-nvidia-mps-shm.mount"
KUSTOMIZE = PACKAGING / "kubernetes"
INSTALL_DOC = ROOT / "docs" / "install.md"
CONFIG = EXAMPLES / "config-mps.yaml"

MPS_ROOT = "/run/nvidia/mps"
METRICS_PORT = 9402
# The Kubernetes releases the manifests are validated against: every one kubernetes-validate ships from this on.
OLDEST_KUBERNETES = Version("1.30")
# Variables in the units that are not the agent's flags: the NVIDIA container runtime's, and the one-file build's.
NOT_AGENT_FLAGS = {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "TMPDIR", "MPSAGENT_CHILD_TMPDIR"}

IMAGE_ENTRYPOINT = ["/opt/mpsagent/bin/mpsagent"]
ONEFILE_IMAGE_TARGET_MB = 120
# The virtual-environment image's ceiling (docs/performance.md, "Image sizes"): 175 MB before 2026-12-05.
VENV_IMAGE_TARGET_MB = 120
# The image's own import check (packaging/container/check_imports.py, copied in by the Dockerfile).
IMAGE_IMPORT_CHECK = "/opt/mpsagent/share/check_imports.py"
COMMAND_TIMEOUT_S = 60


def run(*argv: str | Path, timeout: float = COMMAND_TIMEOUT_S, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT, **kw
    )


def python_agent(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, "-m", "mpsagent", *args)


# --- the one-file executable --------------------------------------------------------------------------------


def bundle_members(path: Path) -> tuple[dict[str, bytes], set[str]]:
    """The binaries (ELF files) in the one-file bundle, and the Python modules in its archive."""
    from PyInstaller.archive.readers import CArchiveReader  # noqa: PLC0415  (a test-only dependency)

    # The script's own reader of the bundle.
    elf_members = script("binary/glibc_floor.py").elf_members
    elves = {name: data for name, data in elf_members(path).items() if name != "(bootloader)"}
    archive = CArchiveReader(str(path))
    modules: set[str] = set()
    for name in archive.toc:
        if name.endswith(".pyz"):
            modules |= set(archive.open_embedded_archive(name).toc)
    return elves, modules


def runtime_import_names() -> set[str]:
    """Top-level import names of mpsagent's runtime dependencies, followed through their own requirements."""
    distributions: set[str] = set()
    pending = [Requirement(r) for r in requires("mpsagent") or [] if "extra ==" not in r]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in distributions or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        distributions.add(name)
        for text in requires(requirement.name) or []:
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in {"", *requirement.extras}):
                child.marker = None
                pending.append(child)
    return {
        module
        for module, owners in packages_distributions().items()
        if any(canonicalize_name(owner) in distributions for owner in owners)
    } | {"mpsagent"}


def documented_glibc_floor() -> Version:
    match = re.search(r"glibc (\d+\.\d+) or newer", INSTALL_DOC.read_text())
    assert match, "docs/install.md must state the build's glibc floor as `glibc X.Y or newer`"
    return Version(match.group(1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_binary_prints_the_same_version_as_the_package(binary: Path) -> None:
    ours = run(binary, "--version")
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == python_agent("--version").stdout
    assert re.fullmatch(r"mpsagent \d+\.\d+\.\d+\S*\n", ours.stdout)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("output", [(), ("--output", "json")], ids=["text", "json"])
def test_binary_dry_run_matches_the_package(binary: Path, output: tuple[str, ...]) -> None:
    args = ("--once", "--node-snapshot", H100_NODE, "--config-file", CONFIG, *output)
    ours = run(binary, *args)
    theirs = python_agent(*args)
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    assert ours.stdout == theirs.stdout
    if output:
        assert json.loads(ours.stdout)
    else:
        assert "Resource nvidia.com/gpu: 8 GPUs x 4 replicas = 32 devices" in ours.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_binary_reports_a_bad_config_like_the_package(binary: Path, tmp_path: Path) -> None:
    bad = write_config(tmp_path / "bad.yaml", "version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n")
    args = ("--once", "--node-snapshot", H100_NODE, "--config-file", bad)
    ours = run(binary, *args)
    theirs = python_agent(*args)
    assert ours.returncode == theirs.returncode == 2
    assert ours.stderr == theirs.stderr
    assert "sharing.mps.resources[0]" in ours.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_binary_bundles_python_and_only_the_runtime_dependencies(binary: Path) -> None:
    elves, modules = bundle_members(binary)
    assert any(name.startswith("libpython3") for name in elves)
    tops = {name.split(".")[0] for name in modules}
    allowed = set(sys.stdlib_module_names) | runtime_import_names()
    assert tops - allowed == set(), "not a runtime dependency of mpsagent: add it to build.sh's --exclude-module"
    assert {"mpsagent", "anyio", "grpclib", "betterproto2", "msgspec", "yaml", "structlog", "pynvml"} <= tops
    assert {"mpsagent.gpu.nvml", "mpsagent.supervisor.app", "anyio._backends._asyncio"} <= modules
    assert binary.stat().st_size < 40 * 1024**2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_binary_needs_no_newer_glibc_than_documented(binary: Path) -> None:
    done = run(sys.executable, GLIBC_FLOOR, binary)
    # Exit status 1: a library that is neither bundled nor glibc's.
    assert done.returncode == 0, done.stdout + done.stderr
    found = Version(done.stdout.split()[0])
    assert found >= Version("2.17")  # objdump did find versioned glibc symbols
    assert found <= documented_glibc_floor(), done.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_binary_serves_the_kubelet_and_gives_the_mps_daemon_a_clean_environment(
    binary: Path, kubelet: FakeKubelet, short_dir: Path
) -> None:
    """The agent proper (gRPC server, anyio, the real MPS daemon) from the one-file build: it registers, lists the
    replicas and stops on SIGTERM; the MPS programs it starts see neither the bundle's libraries nor its TMPDIR."""
    real_control = shutil.which("nvidia-cuda-mps-control")
    assert real_control, "scripts/install-system-deps.sh installs nvidia-cuda-mps"
    envs = short_dir / "envs"
    envs.mkdir()
    control = short_dir / "control"
    control.write_text(f'#!/bin/sh\nenv > "{envs}/$$"\nexec {real_control} "$@"\n')
    control.chmod(0o755)
    unpack = short_dir / "unpack"
    unpack.mkdir()
    env = {**os.environ, "TMPDIR": str(unpack), "MPSAGENT_CHILD_TMPDIR": ""}
    args = [
        *("--config-file", write_config(short_dir / "config.yaml", CONFIG.read_text())),
        *("--node-snapshot", small_node(short_dir / "node.json")),
        *("--kubelet-socket", kubelet.socket_path),
        *("--mps-root", short_dir / "mps"),
        *("--mps-control-bin", control),
        *("--mps-on-exit", "quit", "--log-format", "json"),
    ]
    log = short_dir / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen([str(binary), *map(str, args)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        plugin = kubelet.wait_registered("nvidia.com/gpu", timeout=30)
        wait_for(lambda: len(plugin.latest()) == 8, 10, "8 replicas listed")
        assert {health for _, health, _ in plugin.latest()} == {"Healthy"}
        assert [p.name for p in unpack.iterdir() if p.name.startswith("_MEI")], "unpacked under $TMPDIR"
        seen = [dict(line.split("=", 1) for line in p.read_text().splitlines() if "=" in line) for p in envs.iterdir()]
        assert seen, "the agent ran the MPS control program"
        for child in seen:
            assert "_MEI" not in child.get("LD_LIBRARY_PATH", ""), child.get("LD_LIBRARY_PATH")
            assert child.get("LD_LIBRARY_PATH") == os.environ.get("LD_LIBRARY_PATH")
            assert "LD_LIBRARY_PATH_ORIG" not in child
            assert "TMPDIR" not in child
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0, log.read_text()
        assert not [p for p in unpack.iterdir() if p.name.startswith("_MEI")], "the bootloader cleaned up"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)


def test_runtime_hook_restores_the_environment_and_follows_the_bootloader() -> None:
    """The hook, run by a plain Python whose parent (this test's Python) stands in for the bootloader."""
    script = (
        "import ctypes, json, os, runpy, sys\n"
        f"runpy.run_path({str(HOOK)!r})\n"
        "sig = ctypes.c_int()\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
        "keys = ('LD_LIBRARY_PATH', 'LD_LIBRARY_PATH_ORIG', 'TMPDIR', 'MPSAGENT_CHILD_TMPDIR', 'WATCHDOG_PID')\n"
        "print(json.dumps({'pid': os.getpid(), 'deathsig': sig.value, 'env': {k: os.environ.get(k) for k in keys}}))\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in {"LD_LIBRARY_PATH", "TMPDIR", "WATCHDOG_PID"}}
    cases = [
        (
            {"LD_LIBRARY_PATH": "/tmp/_MEI1:/usr/local/lib", "LD_LIBRARY_PATH_ORIG": "/usr/local/lib"},
            {"LD_LIBRARY_PATH": "/usr/local/lib"},
        ),
        (
            {"LD_LIBRARY_PATH": "/tmp/_MEI1", "TMPDIR": "/run/mpsagent", "MPSAGENT_CHILD_TMPDIR": ""},
            {"LD_LIBRARY_PATH": None, "TMPDIR": None},
        ),
        ({"TMPDIR": "/run/mpsagent", "MPSAGENT_CHILD_TMPDIR": "/var/tmp"}, {"TMPDIR": "/var/tmp"}),
        ({"TMPDIR": "/srv/tmp"}, {"TMPDIR": "/srv/tmp"}),
    ]
    for given, expected in cases:
        env = {**base, **given, "WATCHDOG_PID": str(os.getpid())}
        done = run(sys.executable, "-c", script, env=env)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["deathsig"] == signal.SIGKILL
        assert result["env"]["WATCHDOG_PID"] == str(result["pid"])
        assert result["env"]["LD_LIBRARY_PATH_ORIG"] is None
        assert result["env"]["MPSAGENT_CHILD_TMPDIR"] is None
        for key, value in expected.items():
            assert result["env"][key] == value, (given, key)


# --- systemd ------------------------------------------------------------------------------------------------


def unit_settings(path: Path) -> dict[str, list[str]]:
    """`Section.Key` -> every value it is given, in order (systemd keys repeat, so no configparser)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def unit_environment(settings: dict[str, list[str]]) -> dict[str, str]:
    return dict(value.split("=", 1) for value in settings.get("Service.Environment", []))


def systemd_verify(units: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` in a scratch root: the distribution's units, ours, and a stand-in for the
    executable (verify checks that ExecStart= names an executable file). Needs no systemd running as PID 1."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for name, text in units.items():
        (root / "etc/systemd/system" / name).write_text(text)
    executable = root / unit_settings(UNIT)["Service.ExecStart"][0].split()[0].lstrip("/")
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    return run("systemd-analyze", "verify", "--man=no", "--generators=no", f"--root={root}", *units)


def our_units() -> dict[str, str]:
    return {UNIT.name: UNIT.read_text(), SHM_MOUNT.name: SHM_MOUNT.read_text()}


def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    done = systemd_verify(our_units(), tmp_path)
    # verify exits 0 on settings it ignores (unknown keys, bad values): any message at all is a failure.
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("KillMode=process", "KillMode=sometimes"),
        ("Type=notify", "Typ=notify"),
        ("[Service]", "[Servic]"),
        ("OOMScoreAdjust=-997", "OOMScoreAdjust=-2000"),
        ("LimitNOFILE=65536", "LimitNOFILE=lots"),
    ],
)
def test_systemd_verify_catches_a_broken_unit(tmp_path: Path, old: str, new: str) -> None:
    units = our_units()
    assert old in units[UNIT.name]
    units[UNIT.name] = units[UNIT.name].replace(old, new)
    done = systemd_verify(units, tmp_path)
    assert done.returncode != 0 or done.stdout + done.stderr != ""


def test_systemd_unit_keeps_mps_across_restarts_and_notifies() -> None:
    service = unit_settings(UNIT)
    assert service["Service.Type"] == ["notify"]
    # The one-file build's Python runs as the bootloader's child, not as the main PID.
    assert service["Service.NotifyAccess"] == ["all"]
    assert service["Service.WatchdogSec"]
    assert service["Service.KillMode"] == ["process"]
    assert service["Service.Restart"] == ["on-failure"]
    assert service["Service.RestartPreventExitStatus"] == ["2"]
    assert service["Service.ExecStart"] == ["/usr/local/bin/mpsagent"]
    env = unit_environment(service)
    assert env["CONFIG_FILE"] == "/etc/mpsagent/config.yaml"
    assert env["MPS_ROOT"] == MPS_ROOT
    assert env["MPS_ON_EXIT"] == "keep"
    assert env["METRICS_ADDRESS"].endswith(f":{METRICS_PORT}")
    assert env["TMPDIR"] == "%t/mpsagent" and service["Service.RuntimeDirectory"] == ["mpsagent"]
    # The daemon, a child of the agent, must see the clients' shm as its /dev/shm.
    assert service["Service.BindPaths"] == [f"{MPS_ROOT}/shm:/dev/shm"]
    assert f"{SHM_MOUNT.name}" in service["Unit.Requires"][0].split()
    assert SHM_MOUNT.name in service["Unit.After"][0].split()


def test_systemd_unit_has_descriptors_to_spare_and_keeps_the_oom_killer_off_the_daemon() -> None:
    service = unit_settings(UNIT)
    # systemd's default soft limit (1,024) is what idle HTTP clients once exhausted.
    assert service["Service.LimitNOFILE"] == ["65536"]
    # A node-critical pod's adjustment, below every ordinary pod; the kubelet's own (-999) stays lower. The daemon
    # and its servers inherit it.
    assert service["Service.OOMScoreAdjust"] == ["-997"]
    assert service["Service.OOMPolicy"] == ["continue"]
    # Sandboxing the daemon inherits and that would take from it the GPUs' device nodes, the driver's set-uid
    # helper for non-root pods, or the agent's NFD directory under /etc.
    for directive in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "NoNewPrivileges"):
        assert f"Service.{directive}" not in service, directive
    assert "Service.ProtectSystem" not in service


def test_systemd_shm_mount_is_a_tmpfs_at_the_mps_root() -> None:
    mount = unit_settings(SHM_MOUNT)
    assert mount["Mount.Where"] == [f"{MPS_ROOT}/shm"]
    assert mount["Mount.Type"] == ["tmpfs"]
    options = mount["Mount.Options"][0].split(",")
    assert "mode=1777" in options
    assert any(o.startswith("size=") for o in options)
    escaped = run("systemd-escape", "--path", "--suffix=mount", mount["Mount.Where"][0])
    assert escaped.stdout.strip() == SHM_MOUNT.name


def test_example_config_for_etc_mpsagent_is_valid() -> None:
    done = python_agent("--once", "--node-snapshot", H100_NODE, "--config-file", CONFIG)
    assert done.returncode == 0, done.stderr


# --- container image ----------------------------------------------------------------------------------------


def test_dockerfile_runs_the_agent_with_mps_from_debian_non_free() -> None:
    """A static check: no Docker engine is needed (nor available in CI)."""
    text = DOCKERFILE.read_text()
    lines = re.sub(r"\\\n", " ", text).splitlines()
    instructions = [line.split(None, 1) for line in lines if line.strip() and not line.lstrip().startswith("#")]
    entrypoints = [json.loads(rest) for word, rest in instructions if word == "ENTRYPOINT"]
    assert entrypoints == [["/opt/mpsagent/bin/mpsagent"]]
    assert not [rest for word, rest in instructions if word == "CMD"]
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "non-free" in runs
    assert re.search(r"apt-get install [^&]*\bnvidia-cuda-mps\b", runs)
    assert [rest.strip() for word, rest in instructions if word == "USER"] == ["0:0"]
    for word, rest in instructions:
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source
    env = " ".join(rest for word, rest in instructions if word == "ENV")
    assert "CONFIG_FILE=/etc/mpsagent/config.yaml" in env


# --- container images, built and run ---------------------------------------------------------------------
#
# podman builds them. Containers cannot be started on CI's machines (crun: "cgroups in hybrid mode not supported",
# and setrlimit is refused), so RUN steps use chroot isolation on the host's network, and the entrypoint is run
# with chroot in a created (never started) container's mounted root filesystem, with the image's environment.


@pytest.fixture(params=["venv", "onefile"])
def image(request: pytest.FixtureRequest) -> str:
    tag: str = request.getfixturevalue(f"{request.param}_image")
    return tag


def image_config(image: str) -> dict:
    (found,) = json.loads(podman("image", "inspect", image))
    config: dict = found["Config"]
    return config


def image_mb(image: str) -> float:
    (found,) = json.loads(podman("image", "inspect", image))
    return float(found["Size"]) / 1e6


@contextmanager
def container_root(image: str) -> Iterator[Path]:
    """The root filesystem of a container created from the image (writable; the image is not changed)."""
    container = podman("create", image).strip()
    try:
        yield Path(podman("mount", container).strip())
    finally:
        run("podman", "umount", container)
        run("podman", "rm", container)


def in_image(image: str, root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """argv in the image's root filesystem with the image's environment only (the entrypoint if argv starts with
    an option)."""
    config = image_config(image)
    command = [*config["Entrypoint"], *argv] if not argv or argv[0].startswith("-") else list(argv)
    return run("chroot", root, "/usr/bin/env", "-i", *config["Env"], *command)


@pytest.mark.slow
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_image_has_the_entrypoint_environment_user_and_labels(image: str) -> None:
    config = image_config(image)
    print(f"{image}: {image_mb(image):.0f} MB")
    assert config["Entrypoint"] == IMAGE_ENTRYPOINT
    assert not config.get("Cmd")  # the DaemonSets give the agent's arguments (`--daemon-host`) or none
    assert config["User"] == "0:0"
    assert config["StopSignal"] == "SIGTERM"
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PATH"].startswith("/opt/mpsagent/bin:")
    assert {k: env[k] for k in ("CONFIG_FILE", "LOG_FORMAT", "NVIDIA_VISIBLE_DEVICES")} == {
        "CONFIG_FILE": "/etc/mpsagent/config.yaml",
        "LOG_FORMAT": "json",
        "NVIDIA_VISIBLE_DEVICES": "all",
    }
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "mpsagent"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"


@pytest.mark.slow
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_image_entrypoint_runs_the_agent_and_finds_the_mps_control_binary(image: str) -> None:
    host_once = python_agent("--once", "--node-snapshot", H100_NODE, "--config-file", CONFIG)
    assert host_once.returncode == 0, host_once.stderr
    with container_root(image) as root:
        version = in_image(image, root, "--version")
        assert version.returncode == 0, version.stderr
        assert version.stdout == python_agent("--version").stdout
        # The config where the image's CONFIG_FILE says, as the DaemonSets mount it.
        (root / "etc" / "mpsagent").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(CONFIG, root / "etc" / "mpsagent" / "config.yaml")
        shutil.copyfile(H100_NODE, root / "tmp" / "node.yaml")
        once = in_image(image, root, "--once", "--node-snapshot", "/tmp/node.yaml")
        assert once.returncode == 0, once.stderr
        assert once.stdout == host_once.stdout.replace(str(H100_NODE), "/tmp/node.yaml")
        assert "--daemon-host" in in_image(image, root, "--help").stdout
        control = in_image(image, root, "sh", "-c", "command -v nvidia-cuda-mps-control")
        assert control.stdout.strip() == "/usr/bin/nvidia-cuda-mps-control", control.stderr
        assert in_image(image, root, "nvidia-cuda-mps-control", "-h").returncode == 0


def documented_image_mb(image: str) -> float:
    """The size docs/install.md gives `image` ("one-file image", "virtual-environment image"), as `IMAGE ... about
    N MB` within one sentence."""
    match = re.search(rf"{image}[^.]*?about (\d+) MB", INSTALL_DOC.read_text())
    assert match, f"docs/install.md must give the {image}'s size as `{image} ... about N MB`"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_onefile_image_is_the_venv_image_in_less_room(venv_image: str, onefile_image: str) -> None:
    venv, onefile = image_config(venv_image), image_config(onefile_image)
    for key in ("Entrypoint", "Env", "User", "StopSignal", "Labels"):
        assert onefile.get(key) == venv.get(key), key
    size = image_mb(onefile_image)
    print(f"one-file image: {size:.0f} MB; venv image: {image_mb(venv_image):.0f} MB")
    assert size <= ONEFILE_IMAGE_TARGET_MB
    assert abs(size - documented_image_mb("one-file image")) <= 10, "update the size in docs/install.md"


@pytest.mark.slow
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_venv_image_stays_within_its_size_target(venv_image: str) -> None:
    """What the agent does not need at run time stays out (packaging/container/Dockerfile): pip, setuptools, debug
    symbols, the standard library's tests; pure-Python modules are in compressed zip archives."""
    size = image_mb(venv_image)
    print(f"venv image: {size:.1f} MB (target {VENV_IMAGE_TARGET_MB} MB)")
    assert size <= VENV_IMAGE_TARGET_MB, f"the venv image is {size:.1f} MB, over its {VENV_IMAGE_TARGET_MB} MB target"
    assert abs(size - documented_image_mb("virtual-environment image")) <= 10, (
        "update the venv image's size in docs/install.md"
    )


@pytest.mark.slow
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_every_agent_module_imports_in_the_venv_image(venv_image: str) -> None:
    """Every module under mpsagent, what the dependencies import once the agent runs, and every extension module
    left in the standard library import with the image's interpreter and files only (nothing removed that is
    needed); the build runs the same check."""
    with container_root(venv_image) as root:
        done = in_image(venv_image, root, "/opt/mpsagent/bin/python", "-B", IMAGE_IMPORT_CHECK)
        assert done.returncode == 0, done.stderr + done.stdout
        assert "modules imported" in done.stdout
        names = in_image(
            venv_image, root, "/opt/mpsagent/bin/python", "-B", "-c",
            "import pkgutil, mpsagent; print(len(list(pkgutil.walk_packages(mpsagent.__path__, 'mpsagent.'))))",
        )  # fmt: skip
        assert names.returncode == 0, names.stderr
        host = len(list(pkgutil.walk_packages([str(ROOT / "mpsagent")], "mpsagent.")))
        assert int(names.stdout) == host, "the image's agent has other modules than the checkout's"


# Run with the image's python after the import check: every module loaded came from bytecode (a module in a zip
# archive is loaded from its .pyc when its origin is that .pyc, a file module has its __pycache__ .pyc).
FROM_BYTECODE = """
import importlib.util, os, runpy, sys
runpy.run_path(sys.argv[1])
source = []
for name, module in sorted(sys.modules.items()):
    origin = getattr(getattr(module, "__spec__", None), "origin", None) or ""
    zipped = ".zip/" in origin
    if origin.endswith(".py") and (zipped or not os.path.isfile(importlib.util.cache_from_source(origin))):
        source.append(f"{name}: {origin}")
print(len(sys.modules), "modules;", "without bytecode:", source)
"""


@pytest.mark.slow
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_venv_image_ships_bytecode_for_what_the_agent_imports(venv_image: str) -> None:
    """A new container starts without compiling (about 1.5 s more on 2 vCPUs, docs/performance.md "Image sizes"):
    every module the import check loads has bytecode that Python takes as it is (it writes none, as it would for
    a missing or stale .pyc), and the agent's own modules keep their sources, for tracebacks."""
    with container_root(venv_image) as root:
        marker = root / "tmp" / "bytecode-marker"
        marker.touch()
        os.utime(marker, (marker.stat().st_mtime - 2,) * 2)
        done = in_image(venv_image, root, "/opt/mpsagent/bin/python", "-c", FROM_BYTECODE, IMAGE_IMPORT_CHECK)
        assert done.returncode == 0, done.stderr + done.stdout
        assert done.stdout.rstrip().endswith("without bytecode: []"), done.stdout
        written = [
            path
            for top in ("opt/mpsagent", "usr/lib/python3.11", "usr/lib/python3")
            for path in (root / top).rglob("*.pyc")
            if path.stat().st_mtime > marker.stat().st_mtime
        ]
        assert not written, f"Python compiled modules in the image: {written[:10]}"
        assert (root / "opt/mpsagent/lib/python3.11/site-packages/mpsagent/cli.py").is_file()


@pytest.mark.slow
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_venv_image_keeps_dpkg_consistent(venv_image: str) -> None:
    """Files were removed from installed packages, never packages past their dependents: an image built on this one
    installs with apt as on Debian's."""
    with container_root(venv_image) as root:
        done = in_image(venv_image, root, "apt-get", "check")
        assert done.returncode == 0, done.stderr + done.stdout
        audit = in_image(venv_image, root, "dpkg", "--audit")
        assert audit.returncode == 0 and not audit.stdout.strip(), audit.stdout + audit.stderr


# --- Kubernetes ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "scripts/install-system-deps.sh installs kubectl (Debian's kubernetes-client)"
    done = run(kubectl, "kustomize", KUSTOMIZE)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


AGENT = "mpsagent"
MPS_DAEMON = "mpsagent-mps-daemon"
GPU_NODE_TERMS = [
    {
        "matchExpressions": [
            {"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In", "values": ["true"]}
        ]
    },
    {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]},
]


def daemonset(objects: list[dict], name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == name]
    return found


def only_container(daemonset: dict) -> dict:
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return container


def agent_container(objects: list[dict]) -> dict:
    return only_container(daemonset(objects, AGENT))


def environment(container: dict) -> dict[str, str]:
    """The container's variables with a value (not those from valueFrom)."""
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def kubernetes_versions() -> list[str]:
    versions = sorted({Version(v) for v in all_versions()})
    return [str(v) for v in versions if v >= OLDEST_KUBERNETES]


def test_kustomize_renders_a_namespace_configmap_and_two_daemonsets(rendered: list[dict]) -> None:
    assert sorted(o["kind"] for o in rendered) == ["ConfigMap", "DaemonSet", "DaemonSet", "Namespace"]
    assert {o["metadata"]["name"] for o in rendered if o["kind"] == "DaemonSet"} == {AGENT, MPS_DAEMON}
    namespace = one(rendered, "Namespace")["metadata"]["name"]
    assert {o["metadata"].get("namespace") for o in rendered if o["kind"] != "Namespace"} == {namespace}


def test_kustomize_objects_match_the_kubernetes_schemas(rendered: list[dict]) -> None:
    versions = kubernetes_versions()
    assert versions and Version(versions[-1]) >= Version("1.34"), versions
    for version in versions:
        for obj in rendered:
            kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_a_misspelt_field(rendered: list[dict]) -> None:
    broken = json.loads(json.dumps(daemonset(rendered, AGENT)))
    only_container(broken)["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_versions()[-1], strict=True)


@pytest.mark.parametrize("name", [AGENT, MPS_DAEMON])
def test_both_daemonsets_run_on_gpu_nodes_as_nvidias_do_and_as_node_critical(rendered: list[dict], name: str) -> None:
    spec = daemonset(rendered, name)["spec"]
    pod = spec["template"]["spec"]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": GPU_NODE_TERMS
    }
    assert "nodeSelector" not in pod
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork")
    assert pod["automountServiceAccountToken"] is False
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert only_container(daemonset(rendered, name))["image"].startswith("mpsagent:")


def test_the_agent_adopts_the_daemon_hosts_daemons_and_may_be_restarted_and_rolled(rendered: list[dict]) -> None:
    spec = daemonset(rendered, AGENT)["spec"]
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    container = agent_container(rendered)
    assert "command" not in container and "args" not in container  # the image's entrypoint: the agent
    env = environment(container)
    assert env["MPS_DAEMON"] == "host"
    assert "MPS_ON_EXIT" not in env
    # No MPS daemon in this cgroup: a memory limit only ever ends the agent.
    assert container["resources"]["limits"].keys() == {"memory"}
    assert "initContainers" not in spec["template"]["spec"]


def test_the_mps_daemon_host_is_never_restarted_by_kubernetes_on_its_own(rendered: list[dict]) -> None:
    spec = daemonset(rendered, MPS_DAEMON)["spec"]
    assert spec["updateStrategy"] == {"type": "OnDelete"}
    container = only_container(daemonset(rendered, MPS_DAEMON))
    assert container["args"] == ["--daemon-host"]
    assert "command" not in container
    assert not {"livenessProbe", "readinessProbe", "startupProbe"} & container.keys()
    assert container["resources"]["requests"].keys() == {"cpu", "memory"}
    assert "limits" not in container["resources"]
    # Both read the same config, so the daemon host starts the daemons the agent drives.
    agent_env, host_env = environment(agent_container(rendered)), environment(container)
    assert host_env["CONFIG_FILE"] == agent_env["CONFIG_FILE"] and host_env["MPS_ROOT"] == agent_env["MPS_ROOT"]
    # Clients get 20 s to finish when the pod is deleted (keeper.QUIT_TIMEOUT_S), inside the grace period.
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > 20


def test_agent_probes_are_its_health_endpoints(rendered: list[dict]) -> None:
    container = agent_container(rendered)
    env = environment(container)
    assert env["METRICS_ADDRESS"] == f"0.0.0.0:{METRICS_PORT}"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": METRICS_PORT}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": METRICS_PORT}
    assert {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"} in container["ports"]


def host_mounts(daemonset: dict) -> dict[str, tuple[str, dict]]:
    """Each of the container's mounts of a host path: the host path and the mount."""
    pod = daemonset["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    return {
        m["name"]: (host_paths[m["name"]], m)
        for m in only_container(daemonset)["volumeMounts"]
        if m["name"] in host_paths
    }


def test_daemonsets_share_the_mps_directories_with_client_pods_through_host_paths(rendered: list[dict]) -> None:
    agent, host = host_mounts(daemonset(rendered, AGENT)), host_mounts(daemonset(rendered, MPS_DAEMON))
    env = environment(agent_container(rendered))
    # The agent hands host paths under its MPS root to the kubelet: the same path inside and out, in both pods.
    assert env["MPS_ROOT"] == MPS_ROOT
    for mounts in (agent, host):
        path, mount = mounts["mps-root"]
        assert (path, mount["mountPath"], mount["mountPropagation"]) == (MPS_ROOT, MPS_ROOT, "HostToContainer")
    # The daemon's /dev/shm is the host's <mps-root>/shm, which clients get as theirs: not an emptyDir.
    assert (host["mps-shm"][0], host["mps-shm"][1]["mountPath"]) == (f"{MPS_ROOT}/shm", "/dev/shm")
    for name in (AGENT, MPS_DAEMON):
        assert not [v for v in daemonset(rendered, name)["spec"]["template"]["spec"]["volumes"] if "emptyDir" in v]
    kubelet_dir = "/var/lib/kubelet/device-plugins"
    assert (agent["device-plugins"][0], agent["device-plugins"][1]["mountPath"]) == (kubelet_dir, kubelet_dir)
    assert env["KUBELET_SOCKET"] == f"{kubelet_dir}/kubelet.sock"
    pod_resources = "/var/lib/kubelet/pod-resources"
    assert (agent["pod-resources"][0], agent["pod-resources"][1]["mountPath"]) == (pod_resources, pod_resources)
    assert env["POD_RESOURCES_SOCKET"] == f"{pod_resources}/kubelet.sock"
    assert "device-plugins" not in host and "pod-resources" not in host
    mounts = {m["name"]: m for m in agent_container(rendered)["volumeMounts"]}
    assert env["CONFIG_FILE"].startswith(mounts["config"]["mountPath"] + "/")
    # The daemon host's init container mounts the shm tmpfs on the host.
    (init,) = daemonset(rendered, MPS_DAEMON)["spec"]["template"]["spec"]["initContainers"]
    init_mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert init_mounts["mps-root"]["mountPath"] == MPS_ROOT
    assert init_mounts["mps-root"]["mountPropagation"] == "Bidirectional"
    assert init["securityContext"]["privileged"] is True
    script = init["command"][-1]
    assert "mount -t tmpfs" in script and "mode=1777" in script and "mountpoint -q" in script
    assert environment(init)["MPS_ROOT"] == MPS_ROOT


@pytest.mark.parametrize(
    ("name", "capabilities"), [(AGENT, {"SYS_ADMIN", "SYS_PTRACE"}), (MPS_DAEMON, {"SETUID", "SETGID", "KILL"})]
)
def test_each_container_is_root_with_only_the_capabilities_it_needs(
    rendered: list[dict], name: str, capabilities: set[str]
) -> None:
    security = only_container(daemonset(rendered, name))["securityContext"]
    assert security["runAsUser"] == 0
    assert security["privileged"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"]["add"]) == capabilities
    # The API server refuses allowPrivilegeEscalation=false together with SYS_ADMIN.
    assert "allowPrivilegeEscalation" not in security


def test_configmap_holds_a_config_the_agent_accepts(rendered: list[dict], tmp_path: Path) -> None:
    configmap = one(rendered, "ConfigMap")
    for name in (AGENT, MPS_DAEMON):
        volumes = {v["name"]: v for v in daemonset(rendered, name)["spec"]["template"]["spec"]["volumes"]}
        assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    config = write_config(tmp_path / "config.yaml", configmap["data"]["config.yaml"])
    done = python_agent("--once", "--node-snapshot", H100_NODE, "--config-file", config)
    assert done.returncode == 0, done.stderr


def test_units_use_only_the_agents_environment_variables(rendered: list[dict], dra_rendered: list[dict]) -> None:
    """Every variable that the systemd unit or the DaemonSets (with the DRA component too) set is one of the
    agent's flags (`--help` names each flag's variable), but for the NVIDIA runtime's and the one-file build's
    own."""
    done = python_agent("--help")
    assert done.returncode == 0
    known = set(re.findall(r"\[env\s+([A-Z_]+)", done.stdout))
    assert {"CONFIG_FILE", "MPS_ROOT", "KUBELET_SOCKET", "DRA", "NODE_NAME"} <= known
    used = set(unit_environment(unit_settings(UNIT)))
    for objects in (rendered, dra_rendered):
        for name in (AGENT, MPS_DAEMON):
            used |= {e["name"] for e in only_container(daemonset(objects, name))["env"]}
    assert used - NOT_AGENT_FLAGS - known == set()


# --- Kubernetes: the DRA driver (packaging/kubernetes/dra) -----------------------------------------------------

DRA = KUSTOMIZE / "dra"
DRA_EXTENDED_RESOURCE = DRA / "extended-resource"
DRA_EXAMPLES = DRA / "examples"
DRA_DRIVER = "mps.mpsagent.io"
DRA_SELECTORS = [{"cel": {"expression": f'device.driver == "{DRA_DRIVER}"'}}]
SHARE_CLASS = "mps-share.mpsagent.io"
GPU_CLASS = "mps-gpu.mpsagent.io"
# resource.k8s.io/v1 with consumable capacity (KEP-5075) and DeviceClass.spec.extendedResourceName (KEP-5004),
# both beta and on by default from 1.36.
OLDEST_DRA_KUBERNETES = Version("1.36")
# The kubelet's plugin registration and DRA socket directories, and the CDI spec directory: each at the host's path.
DRA_HOST_PATHS = {
    "plugins-registry": "/var/lib/kubelet/plugins_registry",
    "plugins": "/var/lib/kubelet/plugins",
    "cdi": "/var/run/cdi",
}
DRA_OBJECTS = ["ClusterRole/mpsagent-dra", "ClusterRoleBinding/mpsagent-dra", f"DeviceClass/{SHARE_CLASS}",
               "ServiceAccount/mpsagent"]  # fmt: skip


def kustomize_with(directory: Path, components: list[Path], namespace: str | None = None) -> list[dict]:
    """The base with these components, from a kustomization of an operator's own (in `directory`, outside the
    base's folder: kustomize refuses an overlay inside its base's folder, and absolute paths)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "scripts/install-system-deps.sh installs kubectl (Debian's kubernetes-client)"
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE, directory)],
        "components": [os.path.relpath(c, directory) for c in components],
    }
    if namespace:
        kustomization["namespace"] = namespace
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    done = run(kubectl, "kustomize", directory)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def dra_rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return kustomize_with(tmp_path_factory.mktemp("dra"), [DRA])


def named(objects: list[dict]) -> dict[str, dict]:
    found = {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}
    assert len(found) == len(objects)
    return found


def dra_examples() -> list[dict]:
    return [doc for path in sorted(DRA_EXAMPLES.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def dra_versions() -> list[str]:
    return [v for v in kubernetes_versions() if Version(v) >= OLDEST_DRA_KUBERNETES]


def test_the_dra_component_adds_the_driver_s_rbac_and_device_class_to_the_base(
    rendered: list[dict], dra_rendered: list[dict]
) -> None:
    base, dra = named(rendered), named(dra_rendered)
    assert sorted(dra) == sorted([*base, *DRA_OBJECTS])
    namespace = one(rendered, "Namespace")["metadata"]["name"]
    assert dra["ServiceAccount/mpsagent"]["metadata"]["namespace"] == namespace
    assert dra["ClusterRole/mpsagent-dra"]["rules"] == DRA_RULES
    binding = dra["ClusterRoleBinding/mpsagent-dra"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "mpsagent-dra",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mpsagent", "namespace": namespace}]
    share = dra[f"DeviceClass/{SHARE_CLASS}"]
    assert share["spec"] == {"selectors": DRA_SELECTORS}
    # Cluster-scoped objects: no namespace (kustomize does not know DeviceClass is cluster-scoped).
    for name in ("ClusterRole/mpsagent-dra", "ClusterRoleBinding/mpsagent-dra", f"DeviceClass/{SHARE_CLASS}"):
        assert "namespace" not in dra[name]["metadata"], name
    # Everything else is the base's, but for the agent's DaemonSet (next test).
    for name, obj in base.items():
        if name != f"DaemonSet/{AGENT}":
            assert dra[name] == obj, name


def without_dra(daemonset: dict) -> dict:
    """The agent's DaemonSet with what the DRA component adds taken out again."""
    copy = json.loads(json.dumps(daemonset))
    pod = copy["spec"]["template"]["spec"]
    del pod["serviceAccountName"]
    pod["automountServiceAccountToken"] = False
    container = only_container(copy)
    container["env"] = [e for e in container["env"] if e["name"] not in {"DRA", "NODE_NAME"}]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] not in DRA_HOST_PATHS]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in DRA_HOST_PATHS]
    return copy


def test_the_dra_component_runs_the_agent_as_the_driver_with_its_node_name_sockets_and_cdi_specs(
    rendered: list[dict], dra_rendered: list[dict]
) -> None:
    agent = daemonset(dra_rendered, AGENT)
    pod = agent["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mpsagent"
    assert pod["automountServiceAccountToken"] is True  # the in-cluster config: no KUBECONFIG
    env = {e["name"]: e for e in only_container(agent)["env"]}
    assert env["DRA"] == {"name": "DRA", "value": "on"}  # the string, not YAML 1.1's true
    assert env["NODE_NAME"] == {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert "KUBECONFIG" not in env
    mounts = host_mounts(agent)
    for name, path in DRA_HOST_PATHS.items():
        assert (mounts[name][0], mounts[name][1]["mountPath"]) == (path, path), name
        assert not mounts[name][1].get("readOnly"), name  # the agent creates sockets and writes spec files
    # The agent finds the kubelet's directory above its device-plugin socket (KUBELET_SOCKET).
    kubelet_dir = Path(env["KUBELET_SOCKET"]["value"]).parent.parent
    assert {kubelet_dir / "plugins_registry", kubelet_dir / "plugins"} == {
        Path(DRA_HOST_PATHS["plugins-registry"]),
        Path(DRA_HOST_PATHS["plugins"]),
    }
    # The mps-daemon pods get no token; nothing else changes in the agent's DaemonSet.
    assert "serviceAccountName" not in daemonset(dra_rendered, MPS_DAEMON)["spec"]["template"]["spec"]
    assert without_dra(agent) == daemonset(rendered, AGENT)


def test_an_operator_s_namespace_moves_the_service_account_and_its_binding(tmp_path: Path) -> None:
    objects = named(kustomize_with(tmp_path, [DRA], namespace="gpu-sharing"))
    assert objects["ServiceAccount/mpsagent"]["metadata"]["namespace"] == "gpu-sharing"
    assert objects["ClusterRoleBinding/mpsagent-dra"]["subjects"][0]["namespace"] == "gpu-sharing"
    assert objects[f"DaemonSet/{AGENT}"]["metadata"]["namespace"] == "gpu-sharing"


def test_the_extended_resource_component_adds_a_class_for_nvidia_gpu_requests(
    dra_rendered: list[dict], tmp_path: Path
) -> None:
    objects = named(kustomize_with(tmp_path, [DRA, DRA_EXTENDED_RESOURCE]))
    assert sorted(objects) == sorted([*named(dra_rendered), f"DeviceClass/{GPU_CLASS}"])
    gpu = objects[f"DeviceClass/{GPU_CLASS}"]
    assert gpu["spec"] == {"selectors": DRA_SELECTORS, "extendedResourceName": "nvidia.com/gpu"}
    assert "namespace" not in gpu["metadata"]
    # `kubectl apply -f` of the one file does the same.
    (alone,) = yaml.safe_load_all((DRA_EXTENDED_RESOURCE / "deviceclass.yaml").read_text())
    assert alone == gpu


def test_the_dra_objects_and_examples_match_the_kubernetes_schemas(tmp_path: Path) -> None:
    versions = dra_versions()
    assert versions, "kubernetes-validate has no schemas of Kubernetes 1.36 or newer"
    objects = kustomize_with(tmp_path, [DRA, DRA_EXTENDED_RESOURCE]) + dra_examples()
    for version in versions:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_a_misspelt_field_of_a_claim() -> None:
    broken = json.loads(json.dumps(dra_examples()[0]))
    request = broken["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    request["capacty"] = request.pop("capacity")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, dra_versions()[-1], strict=True)


def test_the_examples_claim_shares_of_the_driver_s_class_and_are_not_applied_by_the_component() -> None:
    examples = named(dra_examples())
    templates = {name.split("/", 1)[1]: o for name, o in examples.items() if name.startswith("ResourceClaimTemplate/")}
    requests = {name: t["spec"]["spec"]["devices"]["requests"] for name, t in templates.items()}
    exactly = {name: r["exactly"] for name, (r,) in requests.items()}
    assert {name: e["deviceClassName"] for name, e in exactly.items()} == dict.fromkeys(
        ["mps-share-8gi", "mps-share-8gi-25pct", "mps-whole-gpu"], SHARE_CLASS
    )
    capacities = {name: e.get("capacity", {}).get("requests") for name, e in exactly.items()}
    assert capacities == {
        "mps-share-8gi": {"memory": "8Gi"},
        "mps-share-8gi-25pct": {"memory": "8Gi", "compute": "25"},
        "mps-whole-gpu": None,  # no capacity: the whole GPU, uncapped
    }
    assert all("namespace" not in t["metadata"] for t in templates.values())  # the operator's namespace
    (pod,) = [o for o in examples.values() if o["kind"] == "Pod"]
    (claim,) = pod["spec"]["resourceClaims"]
    assert claim["resourceClaimTemplateName"] in templates
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["claims"] == [{"name": claim["name"]}]
    component = yaml.safe_load((DRA / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert not [r for r in component["resources"] if "examples" in r]


# --- the two distributions ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """The agent's wheel and the test support's, built from the checkout: their members by distribution."""
    out = tmp_path_factory.mktemp("wheels")
    members: dict[str, set[str]] = {}
    for name, source in (("mpsagent", ROOT), ("mpsagent_testing", ROOT / "testing")):
        done = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                   out / name, source, timeout=IMAGE_TIMEOUT_S)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        (wheel,) = (out / name).glob("*.whl")
        members[name] = set(zipfile.ZipFile(wheel).namelist())
    return members


def test_the_agents_wheel_carries_the_agent_only(wheels: dict[str, set[str]]) -> None:
    top = {member.split("/")[0] for member in wheels["mpsagent"] if not member.startswith("mpsagent-")}
    assert top == {"mpsagent"}, "a production node must not get the fakes (a fake nvidia-cuda-mps-control among them)"


def test_the_test_supports_wheel_carries_the_fakes_and_the_protos(wheels: dict[str, set[str]]) -> None:
    members = wheels["mpsagent_testing"]
    assert {m.split("/")[0] for m in members if not m.startswith("mpsagent_testing-")} == {"mpsagent_testing"}
    modules = {
        f"cluster/gomod/{module.parent.name}/{module.name}"
        for module in (ROOT / "mpsagent_testing" / "cluster" / "gomod").glob("v1.*/*")
    }
    assert len(modules) == 3 * len(KUBERNETES_VERSIONS), "each release's wrapper module: go.mod, go.sum, tools.go"
    needed = {
        "nvml/fake_nvml.c",
        "mps/nvidia-cuda-mps-control",
        *modules,
        "kubelet/protos/deviceplugin/v1beta1/api.proto",
        "kubelet/protos/podresources/v1/api.proto",
    }
    assert {f"mpsagent_testing/{path}" for path in needed} <= members
