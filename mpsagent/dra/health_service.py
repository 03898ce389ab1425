"""The DRA device health service (`DRAResourceHealth`, KEP-4680) in both its versions: the kubelet opens one
NodeWatchResources stream on the DRA socket and shows each prepared device's health in its pod's
`status.containerStatuses[].allocatedResourcesStatus`. Kubelet 1.37 to 1.39 call `v1.DRAResourceHealth` when the
registration lists it (and `v1alpha1` when only that is listed); kubelet 1.36 calls `v1alpha1` whether listed or
not. Both versions' messages are the same, field for field (kubelet 1.37 reads a v1alpha1 stream into v1's messages
as they are), so one stream, in v1's messages, serves both.

A stream gets every device of the node's slice at once, then again on each change and at least every
RESEND_INTERVAL_S: the kubelet counts a device Unknown when it has not heard of it for `health_check_timeout_seconds`,
and forgets them all when the stream ends. The devices' health comes from a `DeviceHealthSource` (the claim server:
a GPU with a critical Xid, or whose MPS daemon is down or hung, is Unhealthy).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from grpclib import GRPCError, Status
from grpclib.const import Cardinality, Handler
from grpclib.server import Stream

from mpsagent._proto import v1 as pb  # the package `v1`: DRAResourceHealth v1 (and the pod-resources API)
from mpsagent.base.changes import Changes
from mpsagent.base.logs import get_logger
from mpsagent.kubelet.wire import receive_message

log = get_logger(__name__)

HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
"""The gRPC services, newest first, as the registration's supported versions name them (a kubelet takes the first
it knows)."""
RESEND_INTERVAL_S = 10.0
"""How often a stream repeats every device's health, changed or not."""
HEALTH_CHECK_TIMEOUT_S = 30
"""How long the kubelet keeps a device's last health before it counts it Unknown: three resends."""
MAX_STREAMS = 8
"""Streams open at once (the kubelet keeps one): a client that opens more is refused, RESOURCE_EXHAUSTED."""
RECEIVE_LIMIT = 1024
"""The request is an empty message."""
MAX_MESSAGE_CHARS = 1024
"""The kubelet cuts a message to this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceHealth:
    """One device of the node's slice: its pool and name, and whether its GPU serves (`problem` None) or why not."""

    pool: str
    device: str
    problem: str | None


class DeviceHealthSource(Protocol):
    def device_health(self) -> Sequence[DeviceHealth]: ...

    async def wait_health_changed(self, since: int) -> int:
        """Wait until the devices' health differs from generation `since`; the new generation."""
        ...

    @property
    def health_generation(self) -> int: ...


class DeviceHealthBoard:
    """The devices' health as last shown, numbered by generation (a `DeviceHealthSource`): the claim server shows it
    what the node's health says, and each stream waits on it."""

    def __init__(self, health: Sequence[DeviceHealth]) -> None:
        self._health = tuple(health)
        self._changes = Changes()

    def show(self, health: Sequence[DeviceHealth]) -> None:
        """The devices' health now: a new generation, and the streams woken, when it differs."""
        if tuple(health) != self._health:
            self._health = tuple(health)
            self._changes.changed()

    def device_health(self) -> Sequence[DeviceHealth]:
        return self._health

    @property
    def health_generation(self) -> int:
        return self._changes.count

    async def wait_health_changed(self, since: int) -> int:
        return await self._changes.wait(since)


def health_message(devices: Sequence[DeviceHealth], now: float) -> pb.NodeWatchResourcesResponse:
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=device.pool, device_name=device.device),
                health=pb.HealthStatus.HEALTHY if device.problem is None else pb.HealthStatus.UNHEALTHY,
                last_updated_time=int(now),
                health_check_timeout_seconds=HEALTH_CHECK_TIMEOUT_S,
                message=(device.problem or "")[:MAX_MESSAGE_CHARS],
            )
            for device in devices
        ]
    )


class DraHealthService:
    """The DRAResourceHealth servicer (grpclib's IServable), one handler per version over one stream."""

    def __init__(self, source: DeviceHealthSource, *, resend_interval_s: float = RESEND_INTERVAL_S) -> None:
        self._source = source
        self._resend = resend_interval_s
        self._streams: list[str] = []
        self.streams_opened = 0

    @property
    def watched(self) -> tuple[str, ...]:
        """The service of each stream open now, as it was called (`v1.DRAResourceHealth`)."""
        return tuple(self._streams)

    async def watch(self) -> AsyncIterator[pb.NodeWatchResourcesResponse]:
        """Every device's health now, then again on each change and every resend interval, until cancelled."""
        generation = self._source.health_generation
        while True:
            yield health_message(self._source.device_health(), time.time())
            with anyio.move_on_after(self._resend):
                generation = await self._source.wait_health_changed(generation)

    async def _handle(self, service: str, stream: Stream[Any, Any]) -> None:
        rpc = "NodeWatchResources"
        request = await receive_message(
            stream,
            rpc,
            RECEIVE_LIMIT,
            pb.NodeWatchResourcesRequest.parse,
            lambda status, reason: GRPCError(status, f"{rpc}: {reason}"),
        )
        if request is None:
            return  # the kubelet went away before asking
        if len(self._streams) >= MAX_STREAMS:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"NodeWatchResources: {MAX_STREAMS} streams are open already")
        self._streams.append(service)
        self.streams_opened += 1
        log.info("device health watched", service=service, streams=len(self._streams))
        try:
            async for message in self.watch():
                await stream.send_message(message)
        finally:
            self._streams.remove(service)

    def __mapping__(self) -> dict[str, Handler]:
        return {
            f"/{service}/NodeWatchResources": Handler(
                functools.partial(self._handle, service),
                Cardinality.UNARY_STREAM,
                pb.NodeWatchResourcesRequest,
                pb.NodeWatchResourcesResponse,
            )
            for service in HEALTH_SERVICES
        }
