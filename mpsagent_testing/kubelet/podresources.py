"""A fake of the kubelet's pod-resources endpoint (v1 `List`) on a real unix socket, with a listing the test sets."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from mpsagent_testing.kubelet.stubs import pr_grpc, pr_pb2
from mpsagent_testing.node import RESOURCE


@dataclass(frozen=True)
class ListedContainer:
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


def listed(pod: str, device_ids: list[str], container: str = "main") -> ListedContainer:
    """A container of namespace `ml` holding `device_ids` of `node.RESOURCE`, as a kubelet lists it."""
    return ListedContainer(
        namespace="ml", pod=pod, container=container, resource=RESOURCE, device_ids=tuple(device_ids)
    )


class FakePodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._containers: list[ListedContainer] = []
        self._later: tuple[float, list[ListedContainer]] | None = None
        self._refusal: grpc.StatusCode | None = None
        self.calls = 0
        self._server: grpc.Server | None = None

    def start(self) -> FakePodResources:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait(10)
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    def set_containers(self, *containers: ListedContainer) -> None:
        with self._lock:
            self._containers, self._later = list(containers), None

    def set_containers_later(self, delay_s: float, *containers: ListedContainer) -> None:
        """List these containers from `delay_s` seconds on, the current ones until then: as the kubelet, which
        records a container's devices only after its Allocate returned."""
        with self._lock:
            self._later = (time.monotonic() + delay_s, list(containers))

    def refuse(self, code: grpc.StatusCode | None) -> None:
        """Answer every List with this error status (None: answer normally again)."""
        with self._lock:
            self._refusal = code

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.calls += 1
            if self._later is not None and time.monotonic() >= self._later[0]:
                self._containers, self._later = self._later[1], None
            refusal, containers = self._refusal, list(self._containers)
        if refusal is not None:
            context.abort(refusal, "refused by the test")
        pods: dict[tuple[str, str], Any] = {}
        for c in containers:
            pod = pods.setdefault((c.namespace, c.pod), pr_pb2.PodResources(name=c.pod, namespace=c.namespace))
            pod.containers.append(
                pr_pb2.ContainerResources(
                    name=c.container,
                    devices=[pr_pb2.ContainerDevices(resource_name=c.resource, device_ids=list(c.device_ids))],
                )
            )
        return pr_pb2.ListPodResourcesResponse(pod_resources=list(pods.values()))
