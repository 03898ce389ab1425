"""Images for a node that reaches no registry: the pod sandbox (pause) and a busybox image, both made here from
Debian's statically linked busybox as docker archives, and the import of any archive into containerd's `k8s.io`
namespace (where the kubelet's images live)."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

from mpsagent_testing.cluster.build import binary
from mpsagent_testing.cluster.layout import BUSYBOX_IMAGE, CONTAINERD_SOCKET, IMAGES, PAUSE_IMAGE

BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "cat", "env", "grep", "ls", "sleep", "echo", "test", "mount", "id", "true", "printenv", "stat")
IMPORT_TIMEOUT_S = 300


class ImageError(RuntimeError):
    """An image could not be made or imported."""


def _busybox_layer() -> bytes:
    if not BUSYBOX.is_file() or b"ld-linux" in BUSYBOX.read_bytes()[:4096]:
        raise ImageError(f"{BUSYBOX} is not a static busybox: install Debian's busybox-static")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("bin", "tmp", "dev", "proc", "sys", "etc"):
            info = tarfile.TarInfo(directory)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        data = BUSYBOX.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    return buffer.getvalue()


def _docker_archive(path: Path, tag: str, layer: bytes, config: dict[str, object]) -> None:
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    image_config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], **config},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(image_config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": ["layer.tar"]}]).encode()
    part = path.with_suffix(".part")
    with tarfile.open(part, mode="w") as tar:
        for name, data in ((config_name, image_config), ("layer.tar", layer), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    part.replace(path)


def base_archives() -> list[Path]:
    """The pause and busybox archives in the cache, made when missing."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    wanted = {
        # The sandbox holds the pod's namespaces and does nothing; containerd ends it with SIGKILL.
        IMAGES / "pause.tar": (PAUSE_IMAGE, {"Entrypoint": ["/bin/sleep", "2147483647"]}),
        IMAGES / "busybox.tar": (BUSYBOX_IMAGE, {"Cmd": ["/bin/sh"]}),
    }
    missing = [path for path in wanted if not path.is_file()]
    if missing:
        layer = _busybox_layer()
        for path in missing:
            tag, config = wanted[path]
            _docker_archive(path, tag, layer, config)
    return list(wanted)


def ctr(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`ctr` against the node's containerd, in the kubelet's `k8s.io` namespace."""
    return subprocess.run(
        [str(binary("ctr")), "--address", str(CONTAINERD_SOCKET), "--namespace", "k8s.io", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def import_archive(archive: Path) -> None:
    """Import a docker or OCI archive into the node's containerd (unpacked for the CRI's snapshotter)."""
    done = ctr("images", "import", str(archive), timeout=IMPORT_TIMEOUT_S)
    if done.returncode != 0:
        raise ImageError(f"importing {archive} into containerd failed: {done.stderr.strip()[-2000:]}")
