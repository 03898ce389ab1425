"""A device plugin that does nothing: it registers `RESOURCE` with the node's kubelet, lists COUNT healthy devices
and answers every `Allocate` with an empty response (no environment, no mounts), on grpcio. The pod start-up bench
measures the agent against it. Run as `python -m mpsagent_testing.cluster.noop_plugin RESOURCE COUNT`; SIGTERM
stops it."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from mpsagent_testing.cluster.layout import DEVICE_PLUGINS
from mpsagent_testing.kubelet.stubs import dp_grpc, dp_pb2


class NoopPlugin(dp_grpc.DevicePluginServicer):
    def __init__(self, count: int) -> None:
        self.devices = [dp_pb2.Device(ID=f"noop-{i}", health="Healthy") for i in range(count)]
        self.stopped = threading.Event()

    def GetDevicePluginOptions(self, request: Any, context: grpc.ServicerContext) -> Any:
        return dp_pb2.DevicePluginOptions()

    def ListAndWatch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield dp_pb2.ListAndWatchResponse(devices=self.devices)
        self.stopped.wait()

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:
        return dp_pb2.AllocateResponse(
            container_responses=[dp_pb2.ContainerAllocateResponse() for _ in request.container_requests]
        )

    def PreStartContainer(self, request: Any, context: grpc.ServicerContext) -> Any:
        return dp_pb2.PreStartContainerResponse()


def serve(resource: str, count: int) -> None:
    endpoint = f"noop-{resource.replace('/', '-')}.sock"
    socket_path = DEVICE_PLUGINS / endpoint
    socket_path.unlink(missing_ok=True)
    plugin = NoopPlugin(count)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    dp_grpc.add_DevicePluginServicer_to_server(plugin, server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    with grpc.insecure_channel(f"unix://{DEVICE_PLUGINS / 'kubelet.sock'}") as channel:
        request = dp_pb2.RegisterRequest(version="v1beta1", endpoint=endpoint, resource_name=resource)
        dp_grpc.RegistrationStub(channel).Register(request, timeout=10)
    print("registered", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: plugin.stopped.set())
    plugin.stopped.wait()
    server.stop(grace=1).wait()
    socket_path.unlink(missing_ok=True)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
