"""A fake kubelet: the Registration service on a real unix socket, calling back into each registered plugin as
the real kubelet does (GetDevicePluginOptions while Register is still pending, then a ListAndWatch stream)."""

from __future__ import annotations

import contextlib
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from mpsagent_testing.kubelet.stubs import dp_grpc, dp_pb2
from mpsagent_testing.waiting import WAIT_S, wait_for

__all__ = ["WAIT_S", "FakeKubelet", "Plugin", "wait_for"]


@dataclass
class Plugin:
    """What the fake kubelet knows of one registered plugin."""

    request: Any
    options: Any
    channel: grpc.Channel
    stub: Any
    updates: list[list[tuple[str, str, tuple[int, ...]]]] = field(default_factory=list)
    stream: Any = None
    stream_ended: threading.Event = field(default_factory=threading.Event)

    def latest(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return self.updates[-1] if self.updates else []


class FakeKubelet(dp_grpc.RegistrationServicer):
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.plugins: list[Plugin] = []
        self._lock = threading.Condition()
        self._server: grpc.Server | None = None

    def start(self) -> FakeKubelet:
        self.socket_path.unlink(missing_ok=True)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dp_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        self._server.start()
        return self

    def stop(self, *, remove_sockets: bool = True) -> None:
        """Stop; like the real kubelet on restart, delete every file in the directory but its checkpoint (kubelets
        before 1.26 delete every file, later ones every socket; none deletes a directory)."""
        if self._server is not None:
            self._server.stop(grace=0).wait(WAIT_S)
            self._server = None
        with self._lock:
            plugins, self.plugins = self.plugins, []
        for plugin in plugins:
            if plugin.stream is not None:
                plugin.stream.cancel()
            plugin.channel.close()
        if remove_sockets:
            for path in self.socket_path.parent.iterdir():
                if path.name != "kubelet_internal_checkpoint" and not path.is_dir():
                    path.unlink(missing_ok=True)

    def restart(self) -> FakeKubelet:
        self.stop()
        return self.start()

    def Register(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}")
        channel = grpc.insecure_channel(f"unix://{self.socket_path.parent / request.endpoint}")
        stub = dp_grpc.DevicePluginStub(channel)
        # The real kubelet dials back and asks for the options before Register returns.
        options = stub.GetDevicePluginOptions(dp_pb2.Empty(), timeout=5)
        plugin = Plugin(request=request, options=options, channel=channel, stub=stub)
        plugin.stream = stub.ListAndWatch(dp_pb2.Empty())
        threading.Thread(target=self._watch, args=(plugin,), daemon=True).start()
        with self._lock:
            self.plugins.append(plugin)
            self._lock.notify_all()
        return dp_pb2.Empty()

    def _watch(self, plugin: Plugin) -> None:
        with contextlib.suppress(grpc.RpcError):
            for response in plugin.stream:
                devices = [(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in response.devices]
                with self._lock:
                    plugin.updates.append(devices)
                    self._lock.notify_all()
        plugin.stream_ended.set()

    def wait_registered(self, resource: str, count: int = 1, timeout: float = WAIT_S) -> Plugin:
        def found() -> Plugin | None:
            with self._lock:
                matching = [p for p in self.plugins if p.request.resource_name == resource]
            return matching[-1] if len(matching) >= count and matching[-1].updates else None

        return wait_for(found, timeout, f"{resource} to register (with a first ListAndWatch update)")
