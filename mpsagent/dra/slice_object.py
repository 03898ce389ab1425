"""The node's ResourceSlice as the API server reads it, built from the domain's `NodeSlice` and compared with what the
server holds: plain JSON-shaped dicts, without the API client's library, so that `--once` prints the slice the agent
would publish without loading it. The slice publisher writes what `resource_slice` builds and compares the server's
slices (their `to_dict()`) with it here."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgspec

from mpsagent.base.clock import utc
from mpsagent.base.config import quantity_value
from mpsagent.base.errors import KubeApiError
from mpsagent.domain.claims import CLIENTS, COMPUTE, MEMORY, CapacityPolicy, DeviceTaint, NodeSlice, SliceDevice

SliceManifest = dict[str, Any]
"""A ResourceSlice as JSON: what the API server reads, and what the agent's API client's `to_dict()` gives of the
server's slices."""

API_VERSION = "resource.k8s.io/v1"
MAX_SLICE_DEVICES = 128
"""Devices in one ResourceSlice, as the API server bounds them."""
MAX_TAINTED_SLICE_DEVICES = 64
"""Devices in one ResourceSlice when any of them has taints, as the API server bounds them."""
MAX_NAME_CHARS = 253
MAX_ATTRIBUTE_CHARS = 64
"""A string attribute's length, as the API server bounds it."""
CONTENT_ANNOTATION = "mpsagent.io/slice-content"
"""The digest of the NodeSlice a published slice shows: a new digest is a new pool generation."""


def slice_name(node: str, driver: str) -> str:
    """The node's one slice of the driver: `<node>-<driver with dots as dashes>`, at most 253 characters (a long
    node name is cut, the driver's part kept)."""
    suffix = "-" + driver.replace(".", "-")
    return node[: MAX_NAME_CHARS - len(suffix)].rstrip("-.") + suffix


def slice_digest(node_slice: NodeSlice) -> str:
    """A digest of everything the slice shows: equal digests, equal slices."""
    return hashlib.sha256(msgspec.json.encode(node_slice)).hexdigest()[:32]


def _capacity(policy: CapacityPolicy) -> dict[str, Any]:
    if not policy.has_policy:  # less than one step left: the API server refuses a step beyond the value
        return {"value": str(policy.value)}
    valid = {"min": str(policy.minimum), "max": str(policy.maximum), "step": str(policy.step)}
    return {"value": str(policy.value), "requestPolicy": {"default": str(policy.default), "validRange": valid}}


def _taint(taint: DeviceTaint) -> dict[str, Any]:
    return {"key": taint.key, "value": taint.value, "effect": taint.effect, "timeAdded": utc(int(taint.added))}


def _device(device: SliceDevice) -> dict[str, Any]:
    attributes = {
        "uuid": {"string": device.uuid[:MAX_ATTRIBUTE_CHARS]},
        "productName": {"string": device.product_name[:MAX_ATTRIBUTE_CHARS]},
        "index": {"int": device.index},
        "computeCapability": {"version": device.compute_capability},
        "driverVersion": {"version": device.driver_version},
        "mpsResource": {"string": device.resource[:MAX_ATTRIBUTE_CHARS]},
    }
    manifest: dict[str, Any] = {
        "name": device.name,
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            MEMORY: _capacity(device.memory),
            COMPUTE: _capacity(device.compute),
            CLIENTS: _capacity(device.clients),
        },
    }
    if device.taints:
        manifest["taints"] = [_taint(taint) for taint in device.taints]
    return manifest


def resource_slice(node_slice: NodeSlice, *, generation: int, node_uid: str) -> SliceManifest:
    """The ResourceSlice that shows `node_slice`, at pool generation `generation`, owned by the Node object (whose
    UID is `node_uid`) so that it goes with the node. Raises KubeApiError for more devices than a slice holds."""
    tainted = any(device.taints for device in node_slice.devices)
    limit = MAX_TAINTED_SLICE_DEVICES if tainted else MAX_SLICE_DEVICES
    if len(node_slice.devices) > limit:
        raise KubeApiError(
            f"publishing the ResourceSlice of node {node_slice.node}",
            f"{len(node_slice.devices)} devices, more than the {limit} a ResourceSlice holds"
            + (" when a device has taints" if tainted else ""),
        )
    owner = {"apiVersion": "v1", "kind": "Node", "name": node_slice.node, "uid": node_uid, "controller": False}
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {
            "name": slice_name(node_slice.node, node_slice.driver),
            "annotations": {CONTENT_ANNOTATION: slice_digest(node_slice)},
            "ownerReferences": [owner],
        },
        "spec": {
            "driver": node_slice.driver,
            "nodeName": node_slice.node,
            "pool": {"name": node_slice.pool, "generation": generation, "resourceSliceCount": 1},
            "devices": [_device(device) for device in node_slice.devices],
        },
    }


def _spec(item: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = item.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _content(item: Mapping[str, Any]) -> object:
    metadata = item.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    return annotations.get(CONTENT_ANNOTATION) if isinstance(annotations, Mapping) else None


def pool_of(item: Mapping[str, Any]) -> tuple[object, int]:
    """A server's slice's pool name and generation (0 when it has none that is a number)."""
    pool = _spec(item).get("pool")
    pool = pool if isinstance(pool, Mapping) else {}
    generation = pool.get("generation")
    return pool.get("name"), generation if type(generation) is int else 0


def same_pool(existing: Mapping[str, Any], node_slice: NodeSlice) -> bool:
    """Whether the server's slice `existing` can be updated into this one: driver, node and pool name are
    immutable."""
    spec = _spec(existing)
    return (spec.get("driver"), spec.get("nodeName"), pool_of(existing)[0]) == (
        node_slice.driver,
        node_slice.node,
        node_slice.pool,
    )


def next_generation(existing: Mapping[str, Any] | None, node_slice: NodeSlice) -> int:
    """The pool generation to publish `node_slice` at: 1 for a new slice, the server's slice's while it shows the
    same, one more when anything changed (the scheduler counts only the slices of a pool's highest generation)."""
    if existing is None:
        return 1
    unchanged = _content(existing) == slice_digest(node_slice) and same_pool(existing, node_slice)
    return pool_of(existing)[1] + (0 if unchanged else 1)


def slice_matches(existing: Mapping[str, Any], desired: SliceManifest) -> bool:
    """Whether the server's slice `existing` shows what the agent's `desired` (from `resource_slice`) says: the
    same content annotation, and every field of the spec the agent writes holding the agent's value (lists of the
    same length; capacities by amount, as the server writes `1073741824` back as `1Gi`). Fields the agent does not
    write are not compared, so that the server's defaults are no difference."""
    devices = _spec(existing).get("devices") or ()
    if len(devices) > MAX_SLICE_DEVICES or _content(existing) != _content(desired):
        return False
    return _holds(desired["spec"], existing.get("spec"))


def _holds(want: object, have: object, *, amounts: bool = False) -> bool:
    """Whether `have` holds `want` (the agent's own, so the walk is as deep as the agent wrote, whatever `have`
    is); strings under a `capacity` are quantities when `amounts`."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            _holds(value, have.get(key), amounts=amounts or key == "capacity") for key, value in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(have) == len(want)
            and all(_holds(w, h, amounts=amounts) for w, h in zip(want, have, strict=True))
        )
    if amounts and isinstance(want, str) and isinstance(have, str) and want != have:
        amount = quantity_value(want)
        return amount is not None and quantity_value(have) == amount
    return type(want) is type(have) and want == have
