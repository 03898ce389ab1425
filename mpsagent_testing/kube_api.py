"""The Kubernetes API server in the DRA driver's tests, without a server: the objects it holds (a ResourceClaim of
this node as it returns one, the Node, the node's slice as the agent wants it), and the agent's API client over a
mock transport that a test answers (`kube_api`), with the server's failure answer (`status`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

from mpsagent.domain.claims import DRA_DRIVER, CapacityPolicy, ClaimRef, NodeSlice, SliceDevice
from mpsagent.dra import api
from mpsagent.dra.api import KubeApi

UID = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
NODE = "node-1"
REF = ClaimRef(namespace="team-a", name="trainer-gpu", uid=UID)
CLASS_PARAMETERS = {"apiVersion": "mps.mpsagent.io/v1alpha1", "kind": "ShareParameters", "threadPercentage": 50}
CLAIM_PARAMETERS = {"apiVersion": "mps.mpsagent.io/v1alpha1", "kind": "ShareParameters", "memory": "8Gi"}

CLAIM: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {
        "name": "trainer-gpu",
        "namespace": "team-a",
        "uid": UID,
        "resourceVersion": "48213",
        "creationTimestamp": "2026-12-01T10:00:00Z",
        "finalizers": ["resource.kubernetes.io/delete-protection"],
    },
    "spec": {
        "devices": {
            "requests": [
                {
                    "name": "gpu",
                    "exactly": {
                        "deviceClassName": "mps.mpsagent.io",
                        "allocationMode": "ExactCount",
                        "count": 1,
                        "capacity": {"requests": {"memory": "8Gi", "compute": "25"}},
                    },
                },
                {"name": "whole", "exactly": {"deviceClassName": "mps.mpsagent.io", "count": 1}},
            ],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRA_DRIVER, "parameters": CLAIM_PARAMETERS}}],
        }
    },
    "status": {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": DRA_DRIVER,
                        "pool": NODE,
                        "device": "gpu-0",
                        "shareID": "2f1b8c5e-93d4-4b7a-a0c1-5e6f7a8b9c0d",
                        "consumedCapacity": {"memory": "8Gi", "compute": "25"},
                    },
                    {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-1"},
                    {
                        "request": "gpu",
                        "driver": DRA_DRIVER,
                        "pool": "node-2",
                        "device": "gpu-0",
                        "shareID": "0c3d2e1f-0000-4000-8000-000000000000",
                        "consumedCapacity": {"memory": "1Gi", "compute": "10"},
                    },
                    {"request": "whole", "driver": DRA_DRIVER, "pool": NODE, "device": "gpu-1"},
                ],
                "config": [
                    {"source": "FromClass", "opaque": {"driver": DRA_DRIVER, "parameters": CLASS_PARAMETERS}},
                    {"source": "FromClass", "opaque": {"driver": "gpu.nvidia.com", "parameters": {"sharing": "x"}}},
                    {
                        "source": "FromClaim",
                        "requests": ["gpu"],
                        "opaque": {"driver": DRA_DRIVER, "parameters": CLAIM_PARAMETERS},
                    },
                ],
            },
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]
            },
        },
        "reservedFor": [
            {"resource": "pods", "name": "trainer-0", "uid": "a1a1a1a1-0000-4000-8000-000000000000"},
            {"apiGroup": "batch", "resource": "jobs", "name": "trainer", "uid": "b2b2b2b2-0000-4000-8000-000000000000"},
        ],
    },
}
"""Claim REF as the API server returns it: allocated on NODE, two results of this driver on it (a share of gpu-0
with its consumed capacity, gpu-1 whole) and two that are not (another driver's, another node's), a class's and
the claim's own configurations."""

GIB = 1 << 30
MEMORY = CapacityPolicy(value=141 * GIB, default=GIB, minimum=1 << 20, maximum=141 * GIB, step=1 << 20)
COMPUTE = CapacityPolicy(value=100, default=100, minimum=1, maximum=100, step=1)
CLIENTS = CapacityPolicy(value=48, default=1, minimum=1, maximum=1, step=1)


def slice_device(index: int, product: str = "NVIDIA H200") -> SliceDevice:
    """GPU `index` of the node's slice: an H200, whole (141 GiB, 100 % of its SMs, 48 MPS clients) and untainted."""
    return SliceDevice(
        name=f"gpu-{index}",
        uuid=f"GPU-5c1f0e7a-0000-4000-8000-00000000000{index}",
        index=index,
        product_name=product,
        compute_capability="9.0.0",
        driver_version="580.65.6",
        resource="nvidia.com/gpu",
        memory=MEMORY,
        compute=COMPUTE,
        clients=CLIENTS,
    )


NODE_SLICE = NodeSlice(driver=DRA_DRIVER, node=NODE, pool=NODE, devices=(slice_device(0), slice_device(1)))
"""The slice the agent wants for NODE: two H200s."""

Handler = Callable[[httpx2.Request], Awaitable[httpx2.Response]]
SLICE_PATH = "/apis/resource.k8s.io/v1/resourceslices"
NODE_OBJECT = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "4f6e3d2c-node"}}
SLICE = f"{SLICE_PATH}/node-1-mps-mpsagent-io"
"""The path of NODE's slice of this driver."""


def kube_api(handler: Handler) -> KubeApi:
    """The agent's API client, its requests answered by `handler` (a bearer token `t0ken`)."""
    config = KubeConfig.from_one(cluster=Cluster(server="https://k8s.test:6443"), user=User(token="t0ken"))
    client = AsyncClient(config, transport=httpx2.MockTransport(handler), field_manager=api.FIELD_MANAGER)
    return KubeApi(client)


def status(code: int, message: str) -> httpx2.Response:
    """The API server's failure answer: a `Status` with `code` and `message`."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}
    return httpx2.Response(code, json=body)
