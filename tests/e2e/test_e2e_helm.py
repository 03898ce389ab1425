"""The Helm chart on a real node: `helm install` of packaging/helm/mpsagent with the one-file image and the same
test values as the kustomize overlay (fake NVML, image, loopback network, probe host); both DaemonSets run, the agent
registers from its container, a pod gets its share; `helm uninstall` removes the DaemonSets and their pods and keeps
only the config map (on purpose: an OnDelete daemon host pod may still mount it)."""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsagent_testing.cluster import claims, kubectl, pods
from mpsagent_testing.cluster.kube_route import (
    AGENT_DS,
    DAEMON_DS,
    NAMESPACE,
    daemonset_ready,
    helm,
    helm_values,
    import_image,
    logs,
    prepared_node,
)
from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.repo import ROOT

require_real_control()

GPU = "nvidia.com/gpu"
CHART = ROOT / "packaging" / "helm" / "mpsagent"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def installed(cluster: str, onefile_image: str) -> Iterator[dict[str, Any]]:
    """The release installed; the values it was installed with."""
    import_image(onefile_image)
    with prepared_node(cluster) as fake, tempfile.TemporaryDirectory(prefix="mpa-helm-") as directory:
        chosen = helm_values(fake, onefile_image)
        values = Path(directory) / "values.json"
        values.write_text(json.dumps(chosen))
        try:
            helm("install", "mpsagent", str(CHART), "--namespace", NAMESPACE, "--create-namespace",
                 "--values", str(values), "--wait", "--timeout", "3m", timeout=240)  # fmt: skip
            yield chosen
        finally:
            pods.delete_all()
            if "mpsagent" in helm("list", "--namespace", NAMESPACE, "--short"):
                helm("uninstall", "mpsagent", "--namespace", NAMESPACE, "--wait", "--timeout", "2m", timeout=150)
            kubectl.run("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=120s", check=False, timeout=150)


def test_helm_install_runs_both_daemonsets_and_a_pod_gets_its_share(cluster: str, installed: dict[str, Any]) -> None:
    # `helm --wait` counts a DaemonSet ready within its maxUnavailable: wait for the pods themselves.
    kubectl.wait_for(lambda: daemonset_ready(DAEMON_DS) and daemonset_ready(AGENT_DS), 120, "both DaemonSets")
    kubectl.wait_for(lambda: pods.allocatable(cluster, GPU) == 8, 60, f"{GPU} allocatable to be 8")
    assert "registered with kubelet" in logs(AGENT_DS)
    pods.create("through-helm", {GPU: 2})
    pods.wait_running("through-helm")
    seen = pods.report("through-helm")
    assert seen.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert seen.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert "control" in seen.pipe
    assert (
        helm("status", "mpsagent", "--namespace", NAMESPACE, "-o", "json")
        and json.loads(helm("status", "mpsagent", "--namespace", NAMESPACE, "-o", "json"))["info"]["status"]
        == "deployed"
    )


def test_helm_upgrade_with_dra_serves_a_claim_with_the_pods_service_account(
    cluster: str, installed: dict[str, Any]
) -> None:
    """`dra.enabled=true`: the agent's pod reaches the API server with its own service account and the chart's RBAC
    (publishes the ResourceSlice, reads claims), registers with the kubelet through the mounted plugin directories,
    and writes CDI specs the runtime applies. The node has no kube-proxy: the pod is pointed at the API server's
    loopback address, which its certificate names."""
    with tempfile.TemporaryDirectory(prefix="mpa-helm-") as directory:
        chosen = copy.deepcopy(installed)
        api_server = [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                      {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}]  # fmt: skip
        chosen["agent"]["extraEnv"] = [*chosen["agent"]["extraEnv"], *api_server]
        chosen["dra"] = {"enabled": True}
        values = Path(directory) / "values.json"
        values.write_text(json.dumps(chosen))
        helm("upgrade", "mpsagent", str(CHART), "--namespace", NAMESPACE, "--values", str(values),
             "--wait", "--timeout", "3m", timeout=240)  # fmt: skip
    try:
        kubectl.wait_for(lambda: daemonset_ready(AGENT_DS) and "resource slice published" in logs(AGENT_DS), 120,
                         "the agent's ResourceSlice")  # fmt: skip
        slices = kubectl.get("resourceslices")["items"]
        assert [s["spec"]["driver"] for s in slices if s["spec"].get("nodeName") == cluster] == [claims.DRIVER]
        claims.create_pod("helm-claim", {"memory": "2Gi"})
        pods.wait_running("helm-claim")
        seen = pods.report("helm-claim")
        assert seen.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].startswith("0=2048M")
        assert "control" in seen.pipe
    finally:
        pods.delete_all()
        claims.delete_templates()


def test_helm_uninstall_removes_the_daemonsets_and_keeps_only_the_config(
    cluster: str, installed: dict[str, Any]
) -> None:
    helm("uninstall", "mpsagent", "--namespace", NAMESPACE, "--wait", "--timeout", "2m", timeout=150)
    assert kubectl.get("daemonsets", "-n", NAMESPACE)["items"] == []
    kubectl.wait_for(lambda: not kubectl.get("pods", "-n", NAMESPACE)["items"], 60, "the release's pods to end")
    kept = {c["metadata"]["name"] for c in kubectl.get("configmaps", "-n", NAMESPACE)["items"]} - {"kube-root-ca.crt"}
    # The config map is kept on purpose (helm.sh/resource-policy: keep): OnDelete pods may still mount it.
    assert [name.rsplit("-", 1)[0] for name in kept] == ["mpsagent-config"]
