"""A DRA kubelet plugin that does nothing, on grpcio: driver `noop.example.com`, registered through the kubelet's
plugin watcher, answering every `NodePrepareResources` claim with one device (`gpu-0` of the node's pool, request
`gpu`, no CDI IDs) without reading the claim, and every `NodeUnprepareResources` with no error. The DRA prepare
bench measures the agent against it. Run as `python -m mpsagent_testing.cluster.noop_dra NODE [KUBECONFIG]`; SIGTERM
stops it and removes its sockets.

With a KUBECONFIG it reads each claim first, as upstream's kubeletplugin helper and NVIDIA's driver do (a GET of the
claim, its UID and allocation checked, one long-lived connection), and does nothing else: the least a driver that
prepares what the scheduler allocated does on the prepare's path.

`publish` makes its ResourceSlice (one device `gpu-0` that many claims may share, with an 80Gi `memory` capacity,
so that the agent's kind of claim, `capacity.requests.memory`, schedules on it too) and its DeviceClass through
kubectl; `unpublish` removes both."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx2
from lightkube import ApiError, Client, KubeConfig
from lightkube.config.client_adapter import verify_cluster
from lightkube.resources.resource_v1 import ResourceClaim

from mpsagent.dra.api import KEEPALIVE_S
from mpsagent_testing.cluster import kubectl
from mpsagent_testing.cluster.layout import KUBELET_ROOT
from mpsagent_testing.kubelet.stubs import dra_grpc, dra_pb2, reg_grpc, reg_pb2

DRIVER = "noop.example.com"
DEVICE_CLASS = DRIVER
DEVICE = "gpu-0"
REQUEST = "gpu"
"""The request name every answer names: the bench's claims have one request, named so."""
REGISTRATION_SOCKET = KUBELET_ROOT / "plugins_registry" / f"{DRIVER}-reg.sock"
DRA_SOCKET = KUBELET_ROOT / "plugins" / DRIVER / "dra.sock"
MEMORY = "80Gi"


class NoopDra(dra_grpc.DRAPluginServicer):
    def __init__(self, node: str, api: Client | None = None) -> None:
        """`api`: read each claim before answering it (None: answer without reading)."""
        self.node = node
        self.api = api

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        device = dra_pb2.Device(request_names=[REQUEST], pool_name=self.node, device_name=DEVICE)
        answers = {}
        for claim in request.claims:
            problem = self._read_problem(claim)
            answers[claim.uid] = (
                dra_pb2.NodePrepareResourceResponse(error=problem)
                if problem
                else dra_pb2.NodePrepareResourceResponse(devices=[device])
            )
        return dra_pb2.NodePrepareResourcesResponse(claims=answers)

    def _read_problem(self, claim: Any) -> str:
        """Why the claim cannot be prepared as read from the API server ("": it can, or it is not read)."""
        if self.api is None:
            return ""
        try:
            found = self.api.get(ResourceClaim, claim.name, namespace=claim.namespace)
        except (ApiError, httpx2.HTTPError) as exc:
            return f"reading claim {claim.namespace}/{claim.name}: {exc}"
        if found.metadata is None or found.metadata.uid != claim.uid:
            return f"claim {claim.namespace}/{claim.name} has another UID than {claim.uid}"
        if found.status is None or found.status.allocation is None:
            return f"claim {claim.namespace}/{claim.name} is not allocated"
        return ""

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        return dra_pb2.NodeUnprepareResourcesResponse(
            claims={claim.uid: dra_pb2.NodeUnprepareResourceResponse() for claim in request.claims}
        )


class NoopRegistration(reg_grpc.RegistrationServicer):
    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return reg_pb2.PluginInfo(
            type="DRAPlugin", name=DRIVER, endpoint=str(DRA_SOCKET), supported_versions=["v1.DRAPlugin"]
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.plugin_registered:
            print(f"registration refused: {request.error}", file=sys.stderr, flush=True)
        else:
            print("registered", flush=True)
        return reg_pb2.RegistrationStatusResponse()


def _server(path: Path) -> grpc.Server:
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return grpc.server(futures.ThreadPoolExecutor(max_workers=4))


def _client(kubeconfig: Path) -> Client:
    """A client that keeps its connection as long as the agent's does (`KEEPALIVE_S`): the bench's prepares come
    seconds apart, and a new TLS connection would be the most of a read."""
    config = KubeConfig.from_file(kubeconfig).get()
    assert config.user is not None
    transport = httpx2.HTTPTransport(
        verify=verify_cluster(config.cluster, config.user, config.abs_file),
        limits=httpx2.Limits(keepalive_expiry=KEEPALIVE_S),
    )
    return Client(config, transport=transport)


def serve(node: str, kubeconfig: Path | None = None) -> None:
    """Serve the DRA service, then the registration (the kubelet may call the first as soon as it registers);
    until SIGTERM, then remove both sockets (the registration's first: the kubelet forgets the plugin). With
    `kubeconfig`, each claim is read before it is answered."""
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    api = None if kubeconfig is None else _client(kubeconfig)
    dra = _server(DRA_SOCKET)
    dra_grpc.add_DRAPluginServicer_to_server(NoopDra(node, api), dra)
    dra.add_insecure_port(f"unix://{DRA_SOCKET}")
    dra.start()
    registration = _server(REGISTRATION_SOCKET)
    reg_grpc.add_RegistrationServicer_to_server(NoopRegistration(), registration)
    registration.add_insecure_port(f"unix://{REGISTRATION_SOCKET}")
    registration.start()
    print("serving", flush=True)
    try:
        stopped.wait()
    finally:
        registration.stop(grace=1).wait()
        REGISTRATION_SOCKET.unlink(missing_ok=True)
        dra.stop(grace=1).wait()
        DRA_SOCKET.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            DRA_SOCKET.parent.rmdir()


def slice_name(node: str) -> str:
    return f"{node}-{DRIVER}"


def objects(node: str) -> list[dict[str, Any]]:
    """The DeviceClass and the node's ResourceSlice."""
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
    memory = {"value": MEMORY, "requestPolicy": {"default": MEMORY, "validRange": {"min": "1Mi", "step": "1Mi"}}}
    resource_slice = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node)},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": DEVICE, "allowMultipleAllocations": True, "capacity": {"memory": memory}}],
        },
    }
    return [device_class, resource_slice]


def publish(node: str) -> None:
    kubectl.apply(objects(node))


def unpublish(node: str) -> None:
    kubectl.run("delete", "resourceslice", slice_name(node), "--ignore-not-found", check=False)
    kubectl.run("delete", "deviceclass", DEVICE_CLASS, "--ignore-not-found", check=False)


if __name__ == "__main__":
    serve(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else None)
