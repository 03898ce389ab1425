"""DRA on the e2e node: ResourceClaimTemplates of the agent's DeviceClass, pods that claim them (the report pod of
`pods`), and the reads the scenarios make: a pod's allocated device, its events, the scheduler's reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mpsagent_testing.cluster import kubectl, pods
from mpsagent_testing.repo import ROOT

DEVICE_CLASS = "mps-share.mpsagent.io"
DRIVER = "mps.mpsagent.io"
DEVICE_CLASS_FILE = ROOT / "packaging/kubernetes/dra/deviceclass.yaml"
EXTENDED_RESOURCE_CLASS_FILE = ROOT / "packaging/kubernetes/dra/extended-resource/deviceclass.yaml"
CLAIM = "gpu"
"""The name of every scenario pod's claim (and of its template's one request)."""


def apply_file(path: Path) -> None:
    kubectl.run("apply", "-f", str(path))


def template(
    name: str,
    capacity: dict[str, str] | None = None,
    *,
    selector: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ResourceClaimTemplate of one request of the agent's class: `capacity` its capacity requests (None: none,
    the whole GPU), `selector` a CEL expression, `parameters` an opaque config of the driver."""
    exactly: dict[str, Any] = {"deviceClassName": DEVICE_CLASS}
    if capacity is not None:
        exactly["capacity"] = {"requests": capacity}
    if selector is not None:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    spec: dict[str, Any] = {"devices": {"requests": [{"name": CLAIM, "exactly": exactly}]}}
    if parameters is not None:
        spec["devices"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": pods.NAMESPACE},
        "spec": {"spec": spec},
    }


def create_pod(name: str, capacity: dict[str, str] | None = None, **options: Any) -> None:
    """A template named after the pod, and the report pod claiming it."""
    pod = pods.manifest(name, {})
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": CLAIM}]}
    pod["spec"]["resourceClaims"] = [{"name": CLAIM, "resourceClaimTemplateName": name}]
    kubectl.apply([template(name, capacity, **options), pod])


def claim_of(pod: str) -> dict[str, Any]:
    """The ResourceClaim made for the pod's claim."""
    status = pods.get(pod)["status"]
    names = {entry["name"]: entry.get("resourceClaimName") for entry in status.get("resourceClaimStatuses", [])}
    name = names.get(CLAIM)
    if not name:
        raise AssertionError(f"pod {pod} has no claim yet: {status}")
    claim: dict[str, Any] = kubectl.get("resourceclaim", name, "-n", pods.NAMESPACE)
    return claim


def allocated_device(pod: str) -> str:
    """The device (`gpu-0`) the scheduler allocated the pod's claim."""
    results = claim_of(pod)["status"]["allocation"]["devices"]["results"]
    (result,) = results
    device: str = result["device"]
    return device


def events(pod: str) -> list[str]:
    """The running pod's events, as `reason: message`: not those of an earlier pod of that name (the node's API
    server keeps events an hour, and an earlier run of the suite used the same names)."""
    uid = pods.get(pod)["metadata"]["uid"]
    selector = f"involvedObject.name={pod},involvedObject.uid={uid}"
    listed = kubectl.get("events", "-n", pods.NAMESPACE, "--field-selector", selector)["items"]
    return [f"{event.get('reason')}: {event.get('message')}" for event in listed]


def unschedulable_reason(pod: str) -> str | None:
    """The scheduler's message while it cannot place the pod; None while it has not said so."""
    for condition in pods.get(pod)["status"].get("conditions", []):
        if condition["type"] == "PodScheduled" and condition["status"] == "False":
            return str(condition.get("message", ""))
    return None


def delete_templates() -> None:
    kubectl.run("delete", "resourceclaimtemplates", "--all", "-n", pods.NAMESPACE, "--wait=true", timeout=60)


def remaining_claims() -> list[str]:
    listed = kubectl.get("resourceclaims", "-n", pods.NAMESPACE)["items"]
    return [claim["metadata"]["name"] for claim in listed]
