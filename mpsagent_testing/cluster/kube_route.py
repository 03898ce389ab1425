"""The Kubernetes route on the e2e node: the project's images imported into containerd, the node made what a GPU
node is to the DaemonSets (the GPU label, `/run/nvidia/mps` a shared mount for the daemon host's init container),
the fake NVML library handed to both containers, and a test overlay of `packaging/kubernetes` with only what a
GPU-less loopback node needs. `prepared_node` undoes all of it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mpsagent_testing import images
from mpsagent_testing.cluster import images as node_images
from mpsagent_testing.cluster import kubectl
from mpsagent_testing.cluster.build import binary
from mpsagent_testing.cluster.host_agent import fake_gpu, fake_nvml_config
from mpsagent_testing.cluster.layout import KUBECONFIG
from mpsagent_testing.cluster.node import unmount_below
from mpsagent_testing.nvml.build import SONAME, build_fake_nvml
from mpsagent_testing.repo import BUILD, ROOT

NAMESPACE = "mpsagent"
MPS_ROOT = Path("/run/nvidia/mps")
GPU_LABEL = "nvidia.com/gpu.present"
FAKE_NVML_IN_CONTAINER = "/opt/fake-nvml"
AGENT_DS = "mpsagent"
DAEMON_DS = "mpsagent-mps-daemon"


def import_image(tag: str) -> None:
    """`tag` from podman's store into containerd's, under the same name."""
    with tempfile.TemporaryDirectory(prefix="mpa-image-") as directory:
        node_images.import_archive(images.save_archive(tag, Path(directory) / "image.tar"))


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"mount {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def prepared_node(node_name: str, gpus: int = 2) -> Iterator[Path]:
    """The node labelled as a GPU node, the MPS root a shared mount, a directory with the fake NVML library and
    its config (`FAKE_NVML_*` files) for the containers; its path. Everything undone afterwards."""
    if MPS_ROOT.exists():
        raise RuntimeError(f"{MPS_ROOT} exists: another agent's MPS root? Remove it first")
    fake = Path(tempfile.mkdtemp(prefix="mpa-fake-nvml-", dir="/tmp"))
    fake.chmod(0o755)
    shutil.copy2(build_fake_nvml(BUILD), fake / SONAME)
    (fake / "nvml.json").write_text(fake_nvml_config([fake_gpu(i) for i in range(gpus)]))
    made = next(p for p in (MPS_ROOT, *MPS_ROOT.parents) if p.parent.exists())  # the top directory made here
    MPS_ROOT.mkdir(parents=True)
    try:
        # The daemon host's init container mounts a tmpfs with Bidirectional propagation: the kubelet needs the
        # host path on a shared mount (docs/install.md).
        _mount("--bind", str(MPS_ROOT), str(MPS_ROOT))
        _mount("--make-shared", str(MPS_ROOT))
        kubectl.run("label", "node", node_name, f"{GPU_LABEL}=true", "--overwrite")
        yield fake
    finally:
        kubectl.run("label", "node", node_name, f"{GPU_LABEL}-", check=False)
        unmount_below(MPS_ROOT)
        shutil.rmtree(made, ignore_errors=True)
        shutil.rmtree(fake, ignore_errors=True)


def fake_nvml_env() -> list[dict[str, str]]:
    files = {"CONFIG": "nvml.json", "STATE": "nvml-state.json", "EVENTS": "nvml-events.jsonl"}
    env = [{"name": "LD_LIBRARY_PATH", "value": FAKE_NVML_IN_CONTAINER}]
    env += [{"name": f"FAKE_NVML_{key}", "value": f"{FAKE_NVML_IN_CONTAINER}/{name}"} for key, name in files.items()]
    return env


def fake_nvml_volume(fake: Path) -> dict[str, Any]:
    return {"name": "fake-nvml", "hostPath": {"path": str(fake), "type": "Directory"}}


FAKE_NVML_MOUNT = {"name": "fake-nvml", "mountPath": FAKE_NVML_IN_CONTAINER}
PROBE_HOST = {"httpGet": {"host": "127.0.0.1"}}
"""The node has loopback only, so the pods share the host's network and the kubelet probes the agent on
127.0.0.1 (not the node's address)."""


def e2e_overlay(fake: Path, image: str) -> Path:
    """A kustomization over packaging/kubernetes: the image, the fake NVML library, the host's network and the
    probes' host; nothing else. Its directory (under the checkout's git-ignored build directory, so that the base
    is a relative path)."""
    directory = Path(tempfile.mkdtemp(prefix="e2e-overlay-", dir=BUILD.mkdir(parents=True, exist_ok=True) or BUILD))
    name, _, tag = image.rpartition(":")
    agent_patch = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": AGENT_DS},
        "spec": {
            "template": {
                "spec": {
                    "hostNetwork": True,
                    "containers": [
                        {
                            "name": "mpsagent",
                            "env": [*fake_nvml_env(), {"name": "METRICS_ADDRESS", "value": "127.0.0.1:9402"}],
                            "livenessProbe": PROBE_HOST,
                            "readinessProbe": PROBE_HOST,
                            "volumeMounts": [FAKE_NVML_MOUNT],
                        }
                    ],
                    "volumes": [fake_nvml_volume(fake)],
                }
            }
        },
    }
    daemon_patch = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": DAEMON_DS},
        "spec": {
            "template": {
                "spec": {
                    "hostNetwork": True,
                    "containers": [{"name": "mps-daemon", "env": fake_nvml_env(), "volumeMounts": [FAKE_NVML_MOUNT]}],
                    "volumes": [fake_nvml_volume(fake)],
                }
            }
        },
    }
    (directory / "agent.json").write_text(json.dumps(agent_patch))
    (directory / "daemon.json").write_text(json.dumps(daemon_patch))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(ROOT / "packaging" / "kubernetes", directory)],
        "images": [{"name": "mpsagent", "newName": name, "newTag": tag}],
        "patches": [{"path": "agent.json"}, {"path": "daemon.json"}],
    }
    (directory / "kustomization.yaml").write_text(json.dumps(kustomization, indent=1))
    return directory


def helm_values(fake: Path, image: str) -> dict[str, Any]:
    """The same test changes as `e2e_overlay`, as values of packaging/helm/mpsagent."""
    name, _, tag = image.rpartition(":")
    extra = {
        "extraEnv": fake_nvml_env(),
        "extraVolumeMounts": [FAKE_NVML_MOUNT],
        "extraVolumes": [fake_nvml_volume(fake)],
    }
    return {
        "image": {"repository": name, "tag": tag},
        "hostNetwork": True,
        "namespace": {"create": False},
        "agent": {
            **extra,
            "livenessProbe": {"httpGet": {"path": "/healthz", "host": "127.0.0.1"}},
            "readinessProbe": {"httpGet": {"path": "/readyz", "host": "127.0.0.1"}},
        },
        "daemonHost": extra,
    }


def daemonset_ready(name: str) -> bool:
    found = kubectl.run("get", "daemonset", name, "-n", NAMESPACE, "-o", "json", check=False)
    if not found:
        return False
    status = json.loads(found).get("status", {})
    desired = status.get("desiredNumberScheduled", 0)
    return bool(desired) and status.get("numberReady") == desired and status.get("updatedNumberScheduled") == desired


def pod_of(daemonset: str) -> dict[str, Any] | None:
    """The DaemonSet's one running pod that is not being deleted, if any."""
    items = kubectl.get("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/name={daemonset}")["items"]
    live = [p for p in items if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"]
    return live[0] if len(live) == 1 else None


def daemon_pid(resource: str = "nvidia.com/gpu") -> int | None:
    """The PID in the resource's daemon record (a host PID: the daemon host shares the host's PID namespace)."""
    vendor, name = resource.split("/")
    with contextlib.suppress(OSError, ValueError, KeyError):
        return int(json.loads((MPS_ROOT / vendor / name / "daemon.json").read_text())["pid"])
    return None


def logs(daemonset: str) -> str:
    pod = pod_of(daemonset)
    if pod is None:
        return ""
    return kubectl.run("logs", pod["metadata"]["name"], "-n", NAMESPACE, check=False)


def helm(*args: str, timeout: float = 180) -> str:
    """`helm ARGS` (the cached build) against the node; its stdout, AssertionError with stderr when it fails."""
    done = subprocess.run(
        [str(binary("helm")), "--kubeconfig", str(KUBECONFIG), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args[:2])}: {done.stderr.strip()[-2000:]}")
    return done.stdout
