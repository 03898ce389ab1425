"""The DevicePlugin gRPC servicer: translates the kubelet's messages to the allocator and inventory and back. An
Allocate is one grant transaction (`kubelet.grant_transaction`: its grants withdrawn and the daemon's ceilings
restored on any failure or cancellation); what goes wrong becomes a gRPC status in `kubelet.wire.answering`, the one
mapping both kubelet plugins use.

Its messages are the upb `protobuf` runtime's, not betterproto2's: the kubelet waits on these calls during pod
admission, and at node scale (768 IDs) betterproto2 alone spends 5 ms parsing a request that upb parses in 0.02 ms
(docs/performance.md). grpclib serves them with its own protobuf codec, through the plain handler table below.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import anyio
from google.protobuf.message import Message
from grpclib import GRPCError, Status
from grpclib.const import Cardinality, Handler
from grpclib.server import Stream

from mpsagent._proto.upb.deviceplugin.v1beta1 import api_pb2 as pb
from mpsagent.base.errors import DaemonError
from mpsagent.base.logs import get_logger
from mpsagent.domain.allocation import ContainerAllocation, ResourceAllocator, describe_ids
from mpsagent.domain.container import ContainerSetup, MemoryLimitDevice
from mpsagent.domain.inventory import Inventory, InventorySnapshot
from mpsagent.domain.shares import Share
from mpsagent.kubelet.grant_transaction import SetCeilings, carry_out
from mpsagent.kubelet.memory_limit_devices import EnsureLimitDevices
from mpsagent.kubelet.wire import Refuse, answering, receive_message, unary_handler

log = get_logger(__name__)

_Request = TypeVar("_Request", bound=Message)


RpcTimer = Callable[[str, float, str], None]
"""Told how long an RPC took (`allocate`, `preferred_allocation`) and its outcome: `ok`, `refused` (the request
was wrong) or `failed` (the node, or a bug)."""
OnGranted = Callable[[Sequence[ContainerAllocation]], None]
"""Told of the grants of an Allocate that is answered OK."""
MAX_KNOWN_PARTS = 4096


async def _no_daemon(*, verify: bool = False) -> None:
    return None


def _nothing_on_granted(allocations: Sequence[ContainerAllocation]) -> None:
    return None


def _no_limit_devices(devices: Sequence[MemoryLimitDevice | None]) -> None:
    return None


def container_response(setup: ContainerSetup) -> pb.ContainerAllocateResponse:
    """One container's part of an Allocate answer."""
    return pb.ContainerAllocateResponse(
        envs=setup.envs,
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in setup.mounts
        ],
        cdi_devices=[pb.CDIDevice(name=name) for name in setup.cdi_devices],
    )


def list_and_watch_response(snapshot: InventorySnapshot) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(
        devices=[
            pb.Device(
                ID=device.replica_id,
                health=device.health.value,
                topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=device.numa_node)])
                if device.numa_node is not None
                else None,
            )
            for device in snapshot.devices
        ]
    )


SERVICE = "/v1beta1.DevicePlugin/"
MIN_RECEIVE_LIMIT = 64 * 1024
RECEIVE_LIMIT_MARGIN = 2


def receive_limit(device_ids: Sequence[str]) -> int:
    """The largest request message the plugin of a resource with these IDs accepts: twice the largest one a kubelet
    sends (a preferred allocation naming every replica as available and as required), and at least 64 KiB."""
    largest = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=device_ids, must_include_deviceIDs=device_ids, allocation_size=len(device_ids)
            )
        ]
    )
    size: int = largest.ByteSize()
    return max(MIN_RECEIVE_LIMIT, RECEIVE_LIMIT_MARGIN * size)


# What the kubelet asked wrongly, as opposed to what the node failed to do.
_REFUSALS = frozenset({Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED})


class DevicePluginServicer:
    def __init__(
        self,
        allocator: ResourceAllocator,
        inventory: Inventory,
        *,
        pre_start_required: bool = False,
        set_ceilings: SetCeilings = _no_daemon,
        on_granted: OnGranted = _nothing_on_granted,
        rpc_timer: RpcTimer | None = None,
        ensure_limit_devices: EnsureLimitDevices | None = None,
    ) -> None:
        self._allocator = allocator
        self._ensure_limit_devices = ensure_limit_devices or _no_limit_devices
        self._inventory = inventory
        self._pre_start_required = pre_start_required
        self._set_ceilings = set_ceilings
        self._on_granted = on_granted
        self._rpc_timer = rpc_timer
        self._closing = anyio.Event()
        self._log = log.bind(resource=allocator.resource.name)
        self.receive_limit = receive_limit(allocator.resource.device_ids)
        self._parts: dict[int, tuple[Share, pb.ContainerAllocateResponse, pb.AllocateResponse]] = {}
        """Each share's part of an answer, and the answer to one container of it, by the share's identity."""

    def close(self) -> None:
        """End every open ListAndWatch stream."""
        self._closing.set()

    def reopen(self) -> None:
        """Serve streams again after a close (the endpoint re-serves after a kubelet restart)."""
        if self._closing.is_set():
            self._closing = anyio.Event()

    async def get_device_plugin_options(self, message: pb.Empty) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=self._pre_start_required, get_preferred_allocation_available=True
        )

    async def _next_generation(self, since: int) -> int | None:
        """The next inventory generation, or None once the server is closing."""
        result: int | None = None
        async with anyio.create_task_group() as tg:

            async def changed() -> None:
                nonlocal result
                result = await self._inventory.wait_changed(since)
                tg.cancel_scope.cancel()

            async def closing() -> None:
                await self._closing.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(changed)
            tg.start_soon(closing)
        return result

    async def list_and_watch(self, message: pb.Empty) -> AsyncIterator[pb.ListAndWatchResponse]:
        self._log.info("kubelet watching devices")
        generation: int | None = self._inventory.generation
        while generation is not None and not self._closing.is_set():
            with self._answering("ListAndWatch", "device list"):
                snapshot = self._inventory.snapshot()
                response = list_and_watch_response(snapshot)
            yield response
            generation = await self._next_generation(snapshot.generation)

    async def allocate(self, message: pb.AllocateRequest) -> pb.AllocateResponse:
        with self._timed("allocate"):
            return await self._allocate(message)

    @contextmanager
    def _timed(self, rpc: str) -> Iterator[None]:
        if self._rpc_timer is None:
            yield
            return
        began = time.perf_counter()
        outcome = "failed"
        try:
            yield
            outcome = "ok"
        except GRPCError as exc:
            if exc.status in _REFUSALS:
                outcome = "refused"
            raise
        finally:
            self._rpc_timer(rpc, time.perf_counter() - began, outcome)

    async def _allocate(self, message: pb.AllocateRequest) -> pb.AllocateResponse:
        # The message's own ID lists: the allocator reads each once (a node's full grant names hundreds).
        requests = [container.devices_ids for container in message.container_requests]
        with self._answering("Allocate", "allocate", containers=len(requests)):
            allocations = self._allocator.allocate(requests)
            try:  # one grant transaction: a failure or a cancellation withdraws the grants and restores the ceilings
                await carry_out(
                    lambda: self._carry_out(allocations),
                    release=lambda: self._withdraw(allocations),
                    ceilings=(self._set_ceilings,),
                )
            except DaemonError as exc:
                asked = describe_ids([i for ids in requests for i in ids])
                raise DaemonError(f"{exc}; nothing was granted (asked: {asked})") from exc
            # Told once the answer is on its way: what the grant is followed by (its log line, the reconciler's
            # follow-ups) costs the kubelet nothing it waits for. The loop runs it right after this call's step.
            asyncio.get_running_loop().call_soon(self._on_granted, allocations)
        if len(allocations) == 1:  # the kubelet asks for one container at a time
            return self._parts_of(allocations[0].setup)[2]
        return pb.AllocateResponse(container_responses=[self._parts_of(a.setup)[1] for a in allocations])

    def _parts_of(self, setup: ContainerSetup) -> tuple[Share, pb.ContainerAllocateResponse, pb.AllocateResponse]:
        """A container's part of the answer, and the answer to it alone: what its setup names apart from its
        replicas, which follows from its share alone (ContainerSetup), so each share's are built once (and shared:
        nothing changes an answer once built; grpclib serializes it)."""
        known = self._parts.get(id(setup.share))
        if known is not None and known[0] is setup.share:
            return known
        if len(self._parts) >= MAX_KNOWN_PARTS:
            self._parts.clear()
        part = container_response(setup)
        known = self._parts[id(setup.share)] = (setup.share, part, pb.AllocateResponse(container_responses=[part]))
        return known

    async def _carry_out(self, allocations: Sequence[ContainerAllocation]) -> None:
        self._ensure_limit_devices([a.setup.memory_limits for a in allocations])
        await self._set_ceilings()

    def _withdraw(self, allocations: Sequence[ContainerAllocation]) -> None:
        """An Allocate answered with an error starts no container: its grants go (the transaction then brings the
        daemon back to the caps of the grants left: a switch that failed halfway may have lifted them)."""
        self._allocator.withdraw(allocations)
        self._log.warning("allocate withdrawn", grants=[a.record.grant.grant_id for a in allocations])

    async def get_preferred_allocation(self, message: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
        with self._timed("preferred_allocation"), self._answering("GetPreferredAllocation", "preferred allocation"):
            chosen = [
                self._allocator.preferred(
                    list(request.available_deviceIDs),
                    list(request.must_include_deviceIDs),
                    request.allocation_size,
                )
                for request in message.container_requests
            ]
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in chosen]
        )

    async def pre_start_container(self, message: pb.PreStartContainerRequest) -> pb.PreStartContainerResponse:
        with self._answering("PreStartContainer", "pre-start"):
            self._allocator.check_request(list(message.devices_ids))
            # The caps follow the ledger's live grants, never a request's IDs: a restarted container starts under
            # the caps the ledger needs, checked against the daemon's real values (any client container can change
            # them), whatever a failure in between left the daemon holding.
            await self._set_ceilings(verify=True)
        return pb.PreStartContainerResponse()

    def _answering(self, rpc: str, action: str, **context: object) -> AbstractContextManager[None]:
        """What goes wrong inside the RPC, as its gRPC status (`wire.answering`)."""
        return answering(self._log.bind(**context), rpc, action, failed=f"{self._allocator.resource.name}: ")

    # --- receiving requests ----------------------------------------------------------------------------------

    async def _receive(self, stream: Stream[Any, Any], rpc: str, message_type: type[_Request]) -> _Request | None:
        """The request message, or None when the kubelet went away before sending one.

        grpclib has no receive limit: it reads a message whole, whatever length its prefix declares, and keeps what
        it read until the connection's handler is collected (an aborted 4 GiB message grew the agent by the 200 MiB
        sent, every time). So the prefix is read first (`wire.receive_message`, the one adapter below grpclib's
        public surface), and a longer message than a kubelet ever sends is refused before its body is read; the
        endpoint's flow-control windows bound what a client can push beyond that."""
        return await receive_message(stream, rpc, self.receive_limit, message_type.FromString, self._refuser(rpc))

    def _refuser(self, rpc: str) -> Refuse:
        return lambda status, reason: self._refusal(status, rpc, reason)

    def _refusal(self, status: Status, rpc: str, reason: str) -> GRPCError:
        self._log.warning("request refused", rpc=rpc, reason=reason)
        return GRPCError(status, f"{self._allocator.resource.name}: {reason}")

    # --- the gRPC handler table (grpclib's IServable) ---------------------------------------------------------

    def __mapping__(self) -> dict[str, Handler]:
        return {
            SERVICE + "GetDevicePluginOptions": self._unary(
                "GetDevicePluginOptions", pb.Empty, pb.DevicePluginOptions, self.get_device_plugin_options
            ),
            SERVICE + "ListAndWatch": Handler(
                self._list_and_watch_stream, Cardinality.UNARY_STREAM, pb.Empty, pb.ListAndWatchResponse
            ),
            SERVICE + "GetPreferredAllocation": self._unary(
                "GetPreferredAllocation",
                pb.PreferredAllocationRequest,
                pb.PreferredAllocationResponse,
                self.get_preferred_allocation,
            ),
            SERVICE + "Allocate": self._unary("Allocate", pb.AllocateRequest, pb.AllocateResponse, self.allocate),
            SERVICE + "PreStartContainer": self._unary(
                "PreStartContainer", pb.PreStartContainerRequest, pb.PreStartContainerResponse, self.pre_start_container
            ),
        }

    def _unary(
        self,
        rpc: str,
        request_type: type[_Request],
        reply_type: type[Message],
        method: Callable[[_Request], Awaitable[Message]],
    ) -> Handler:
        return unary_handler(
            rpc,
            (request_type, reply_type),
            request_type.FromString,
            method,
            limit=self.receive_limit,
            refuse=self._refuser(rpc),
        )

    async def _list_and_watch_stream(self, stream: Stream[Any, Any]) -> None:
        request = await self._receive(stream, "ListAndWatch", pb.Empty)
        if request is None:
            return  # the kubelet went away before asking
        async for response in self.list_and_watch(request):
            await stream.send_message(response)
