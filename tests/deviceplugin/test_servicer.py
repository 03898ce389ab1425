"""The DevicePlugin servicer in-process: grpclib's `ChannelFor` carries real gRPC messages to it over an in-memory
HTTP/2 connection, so every answer, refusal and status is checked in milliseconds. The same RPCs through the
agent's socket: test_plugin_integration.py, test_hostile_requests.py, test_input_limits.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import grpclib.protocol
import grpclib.server
import pytest
from google.protobuf.message import Message
from grpclib import GRPCError, Status
from grpclib.client import UnaryStreamMethod, UnaryUnaryMethod
from grpclib.const import Cardinality
from grpclib.encoding.proto import ProtoCodec
from grpclib.events import _DispatchServerEvents
from grpclib.testing import ChannelFor

from mpsagent._proto.upb.deviceplugin.v1beta1 import api_pb2 as pb
from mpsagent.base.config import check_config, parse_config
from mpsagent.base.errors import DaemonCommandError
from mpsagent.deviceplugin.servicer import SERVICE, DevicePluginServicer
from mpsagent.domain.allocation import ContainerAllocation, ResourceAllocator
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import build_plan
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent.kubelet.wire import EndedInsideMessage, RequestWire
from mpsagent_testing.kubelet.cancel import cancelled_after
from mpsagent_testing.mps.ceilings import SWITCH_TURNS, FakeCeilings
from mpsagent_testing.node import ALL, GPU0, GPU1, RESOURCE, config, ids, small_node

CALL_TIMEOUT_S = 5


@dataclass
class Served:
    servicer: DevicePluginServicer
    allocator: ResourceAllocator
    inventory: Inventory
    daemon: FakeCeilings
    granted: list[ContainerAllocation] = field(default_factory=list)
    timed: list[tuple[str, str]] = field(default_factory=list)

    def live(self) -> list[tuple[str, ...]]:
        return [g.replica_ids for g in self.allocator.ledger.live_grants()]


def serve(tmp_path: Path, text: str | None = None) -> Served:
    node = SnapshotGpuSource(small_node(tmp_path / "node.json", numa=[0, 1])).discover()
    plan = build_plan(check_config(parse_config(text or config(), "config.yaml")), node, tmp_path / "mps")
    resource = plan.resources[0]
    allocator = ResourceAllocator(resource, plan.shm_directory)
    inventory = Inventory(resource, daemon_ready=True)
    daemon = FakeCeilings()
    granted: list[ContainerAllocation] = []
    timed: list[tuple[str, str]] = []
    servicer = DevicePluginServicer(
        allocator,
        inventory,
        pre_start_required=True,
        set_ceilings=daemon,
        on_granted=granted.extend,
        rpc_timer=lambda rpc, _seconds, outcome: timed.append((rpc, outcome)),
    )
    return Served(servicer, allocator, inventory, daemon, granted, timed)


@pytest.fixture
def served(tmp_path: Path) -> Served:
    return serve(tmp_path)


def in_channel(servicer: DevicePluginServicer, talk: Callable[[Any], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        with anyio.fail_after(CALL_TIMEOUT_S):
            async with ChannelFor([servicer]) as channel:
                return await talk(channel)

    return anyio.run(main)


def call(servicer: DevicePluginServicer, rpc: str, request: Any, reply_type: type[Message]) -> Any:
    """One unary RPC; its reply, or the GRPCError the client sees."""
    return in_channel(
        servicer, lambda channel: UnaryUnaryMethod(channel, SERVICE + rpc, type(request), reply_type)(request)
    )


def refused(servicer: DevicePluginServicer, rpc: str, request: Any, reply_type: type[Message]) -> GRPCError:
    with pytest.raises(GRPCError) as error:
        call(servicer, rpc, request, reply_type)
    return error.value


def allocate_request(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=c) for c in containers])


def allocate(served: Served, *containers: list[str]) -> pb.AllocateResponse:
    return call(served.servicer, "Allocate", allocate_request(*containers), pb.AllocateResponse)


def refused_allocate(served: Served, *containers: list[str]) -> GRPCError:
    return refused(served.servicer, "Allocate", allocate_request(*containers), pb.AllocateResponse)


def preferred_request(available: list[str], size: int, must: list[str] | None = None) -> pb.PreferredAllocationRequest:
    return pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must or [], allocation_size=size
            )
        ]
    )


# --- Allocate --------------------------------------------------------------------------------------------------


def test_allocate_answers_each_container_with_its_grant_and_records_it(served: Served) -> None:
    response = allocate(served, ids(GPU1, 2), ALL)
    capped, full = (dict(c.envs) for c in response.container_responses)
    assert capped["NVIDIA_VISIBLE_DEVICES"] == GPU1
    assert capped["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert full == {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe", "NVIDIA_VISIBLE_DEVICES": f"{GPU0},{GPU1}"}
    assert {m.container_path for m in response.container_responses[0].mounts} == {
        "/mps/nvidia.com/gpu/pipe",
        "/dev/shm",
    }
    # The second container's grant holds GPU1::2 too: the first has ended (the kubelet granted it again).
    assert served.live() == [tuple(ALL)]
    assert [a.setup.replica_ids for a in served.granted] == [tuple(ids(GPU1, 2)), tuple(ALL)]
    assert served.daemon.calls == [False]  # the daemon holds the ledger's caps before the answer
    assert served.timed == [("allocate", "ok")]


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        (
            [["GPU-nope::0"]],
            f"{RESOURCE}: unknown device ID 'GPU-nope::0' in the request; this resource advertises IDs of the form "
            "<GPU UUID>::<replica>",
        ),
        ([[]], f"{RESOURCE}: a container request must name at least one device ID"),
        (
            [ids(GPU0, 0), ["x", "y", "z", "w"]],
            f"{RESOURCE}: unknown device IDs 'x', 'y', 'z' and 1 more in the request",
        ),
    ],
)
def test_a_refused_allocate_says_why_and_changes_nothing(
    served: Served, containers: list[list[str]], message: str
) -> None:
    allocate(served, ids(GPU0, 1))
    error = refused_allocate(served, *containers)
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message is not None and error.message.startswith(message)
    assert served.live() == [tuple(ids(GPU0, 1))]
    assert served.daemon.calls == [False]  # only the first Allocate's
    assert served.timed == [("allocate", "ok"), ("allocate", "refused")]


def greater_than_one_refused(count: int) -> str:
    return (
        f"{RESOURCE}: a request of {count} replicas is refused: sharing.mps.failRequestsGreaterThanOne is true "
        "(the default), which allows 1 per container; set it to false to allow more"
    )


@pytest.mark.parametrize("fail_gt_one", [True, None], ids=["true", "omitted"])
def test_more_than_one_replica_is_refused_when_fail_requests_greater_than_one(
    tmp_path: Path, fail_gt_one: bool | None
) -> None:
    """The kubelet asks GetPreferredAllocation first whenever more IDs are free than requested, so its refusal is
    usually what the operator reads in the pod's status: it names the resource and the key that allows more."""
    served = serve(tmp_path, config(fail_gt_one=fail_gt_one))
    error = refused(
        served.servicer, "GetPreferredAllocation", preferred_request(ALL, 2), pb.PreferredAllocationResponse
    )
    assert (error.status, error.message) == (Status.INVALID_ARGUMENT, greater_than_one_refused(2))
    error = refused_allocate(served, ids(GPU0, 0, 1))
    assert (error.status, error.message) == (Status.INVALID_ARGUMENT, greater_than_one_refused(2))
    assert served.live() == []


def test_containers_of_one_share_get_the_same_answer_each_time(served: Served) -> None:
    """A share's part of an answer is built once: every container of the share, in one Allocate or the next, gets
    all of it."""
    first = allocate(served, ids(GPU0, 0), ids(GPU0, 1))
    second = allocate(served, ids(GPU0, 2))
    parts = [*first.container_responses, *second.container_responses]
    assert [dict(part.envs) for part in parts] == [dict(parts[0].envs)] * 3
    assert dict(parts[0].envs)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert [list(part.mounts) for part in parts] == [list(parts[0].mounts)] * 3
    assert len(parts[0].mounts) == 2


def test_an_allocate_whose_daemon_cannot_hold_the_caps_is_withdrawn(served: Served) -> None:
    allocate(served, ids(GPU0, 0))
    served.daemon.failing = DaemonCommandError("set_default_active_thread_percentage 25 did not hold")
    error = refused_allocate(served, ids(GPU0, 0, 1))
    assert error.status is Status.UNAVAILABLE
    assert error.message == (
        f"{RESOURCE}: set_default_active_thread_percentage 25 did not hold; nothing was granted (asked: "
        f"'{GPU0}::0', '{GPU0}::1')"
    )
    # The grant it recorded is gone, the grant it ended is live again, and the daemon was asked again for the
    # caps of what is left.
    assert served.live() == [tuple(ids(GPU0, 0))]
    assert served.daemon.calls == [False, False, False]
    assert [a.setup.replica_ids for a in served.granted] == [tuple(ids(GPU0, 0))]
    assert served.timed == [("allocate", "ok"), ("allocate", "failed")]


@pytest.mark.parametrize("cancels", [1, 2])
def test_an_allocate_cancelled_at_any_await_is_withdrawn_or_stands_exactly_once(tmp_path: Path, cancels: int) -> None:
    """The kubelet gives up on an Allocate (grpclib cancels the handler's task, and cancels it again when the
    connection closes) after each number of the loop's turns: the grant is gone and the daemon back at the ceilings
    of what is left, or (once it completed) the grant stands once."""

    async def cancelled(served: Served, turns: int) -> tuple[bool, object, object]:
        await served.servicer.allocate(allocate_request(ids(GPU0, 0)))  # an earlier grant, its ceilings held
        before = (served.live(), served.daemon.held)
        call = served.servicer.allocate(allocate_request(ids(GPU0, 1, 2)))
        completed = await cancelled_after(call, turns=turns, cancels=cancels)
        return completed, before, (served.live(), served.daemon.held)

    for turns in range(4 * SWITCH_TURNS):
        (tmp_path / f"turns-{turns}").mkdir()
        served = serve(tmp_path / f"turns-{turns}")
        served.daemon.allocator, served.daemon.held = served.allocator, served.allocator.ceilings()
        completed, before, after = anyio.run(cancelled, served, turns)
        if completed:
            assert turns > SWITCH_TURNS
            assert after == (
                [tuple(ids(GPU0, 0)), tuple(ids(GPU0, 1, 2))],
                served.allocator.ceilings(),
            ), f"completed after {turns} turns"
            break
        assert after == before, f"cancelled after {turns} turns"
    else:
        pytest.fail("the allocate never completed")


# --- GetPreferredAllocation ------------------------------------------------------------------------------------


def test_preferred_allocation_chooses_from_the_available_ids_and_keeps_the_required(served: Served) -> None:
    reply = call(
        served.servicer,
        "GetPreferredAllocation",
        preferred_request(ALL, 3, must=ids(GPU1, 3)),
        pb.PreferredAllocationResponse,
    )
    chosen = list(reply.container_responses[0].deviceIDs)
    assert len(set(chosen)) == 3
    assert set(chosen) <= set(ALL)
    assert ids(GPU1, 3)[0] in chosen
    assert served.live() == []  # a preference grants nothing
    assert served.timed == [("preferred_allocation", "ok")]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (preferred_request(ALL, 0), f"{RESOURCE}: allocation size must be at least 1, not 0"),
        (
            preferred_request(["GPU-nope::1"], 1),
            f"{RESOURCE}: unknown device ID 'GPU-nope::1' in the available devices",
        ),
        (
            preferred_request(ALL, 1, must=["GPU-nope::2"]),
            f"{RESOURCE}: unknown device ID 'GPU-nope::2' in the devices that must be included",
        ),
    ],
)
def test_a_refused_preferred_allocation_says_why(
    served: Served, request_: pb.PreferredAllocationRequest, message: str
) -> None:
    error = refused(served.servicer, "GetPreferredAllocation", request_, pb.PreferredAllocationResponse)
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message is not None and error.message.startswith(message)
    assert served.timed == [("preferred_allocation", "refused")]


# --- PreStartContainer, options, ListAndWatch -----------------------------------------------------------------


def test_pre_start_verifies_the_daemons_real_caps(served: Served) -> None:
    request = pb.PreStartContainerRequest(devices_ids=ids(GPU0, 0))
    assert call(served.servicer, "PreStartContainer", request, pb.PreStartContainerResponse) == (
        pb.PreStartContainerResponse()
    )
    assert served.daemon.calls == [True]
    served.daemon.failing = DaemonCommandError("the daemon's thread percentage is 100, not 25")
    error = refused(served.servicer, "PreStartContainer", request, pb.PreStartContainerResponse)
    assert (error.status, error.message) == (
        Status.UNAVAILABLE,
        f"{RESOURCE}: the daemon's thread percentage is 100, not 25",
    )


def test_pre_start_of_unknown_ids_is_refused_before_the_daemon_is_asked(served: Served) -> None:
    request = pb.PreStartContainerRequest(devices_ids=["GPU-nope::0"])
    error = refused(served.servicer, "PreStartContainer", request, pb.PreStartContainerResponse)
    assert error.status is Status.INVALID_ARGUMENT
    assert served.daemon.calls == []


def test_options_ask_for_pre_start_and_offer_preferred_allocation(served: Served) -> None:
    options = call(served.servicer, "GetDevicePluginOptions", pb.Empty(), pb.DevicePluginOptions)
    assert (options.pre_start_required, options.get_preferred_allocation_available) == (True, True)


def test_list_and_watch_sends_the_list_again_when_health_changes_and_ends_on_close(served: Served) -> None:
    async def talk(channel: Any) -> list[list[tuple[str, str, tuple[int, ...]]]]:
        method = UnaryStreamMethod(channel, SERVICE + "ListAndWatch", pb.Empty, pb.ListAndWatchResponse)
        lists = []
        async with method.open() as stream:
            await stream.send_message(pb.Empty(), end=True)
            async for response in stream:
                lists.append([(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in response.devices])
                if len(lists) == 1:
                    served.inventory.set_resource_problem("mps daemon", True)
                else:
                    served.servicer.close()
        return lists

    first, second = in_channel(served.servicer, talk)
    assert first == [(i, "Healthy", (0,)) for i in ids(GPU0, 0, 1, 2, 3)] + [
        (i, "Healthy", (1,)) for i in ids(GPU1, 0, 1, 2, 3)
    ]
    assert {d[1] for d in second} == {"Unhealthy"}


# --- what arrives on the wire -----------------------------------------------------------------------------------


class RawBytes:
    """A "message" that is any bytes, to send what no protobuf library would."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # the protobuf name that grpclib's codec calls
        return self.data


def test_a_request_larger_than_a_kubelet_sends_is_refused_before_it_is_read(served: Served) -> None:
    limit = served.servicer.receive_limit
    error = refused(
        served.servicer, "GetPreferredAllocation", RawBytes(b"\0" * (limit + 1)), pb.PreferredAllocationResponse
    )
    assert (error.status, error.message) == (
        Status.RESOURCE_EXHAUSTED,
        f"{RESOURCE}: GetPreferredAllocation request of {limit + 1} bytes is larger than the {limit} bytes a "
        "kubelet sends",
    )


def test_an_undecodable_request_is_refused_and_changes_nothing(served: Served) -> None:
    # Field 1 (container_requests) says 255 bytes follow; none do.
    error = refused(served.servicer, "Allocate", RawBytes(b"\x0a\xff\x01"), pb.AllocateResponse)
    assert (error.status, error.message) == (
        Status.INVALID_ARGUMENT,
        f"{RESOURCE}: the Allocate request is not a valid protobuf message; was it sent by a kubelet?",
    )
    assert served.live() == []
    assert served.daemon.calls == []


# --- the one adapter below grpclib's public surface ---------------------------------------------------------------


def _server_stream(h2_stream: object) -> Any:
    return grpclib.server.Stream(
        h2_stream,  # type: ignore[arg-type]
        SERVICE + "Allocate",
        Cardinality.UNARY_UNARY,
        pb.AllocateRequest,
        pb.AllocateResponse,
        codec=ProtoCodec(),
        status_details_codec=None,
        dispatch=_DispatchServerEvents(),
    )


def _http2_stream(*chunks: bytes) -> grpclib.protocol.Stream:
    """grpclib's HTTP/2 stream of a request, fed as grpclib's protocol handler feeds it: data, then its end."""
    connection = SimpleNamespace(
        ack=lambda stream_id, size: None, streams_started=0, last_stream_created=None, get_peer=lambda: None
    )
    stream = grpclib.protocol.Stream(connection, None, None)  # type: ignore[arg-type]
    stream.init_stream(1, connection)  # type: ignore[arg-type]
    for chunk in chunks:
        stream.buffer.add(chunk, len(chunk))
    stream.buffer.eof()
    return stream


def test_grpclib_still_has_what_the_request_wire_reads() -> None:
    """`RequestWire` reads below grpclib's public surface (grpclib 0.4 has no receive limit): the HTTP/2 stream a
    server `Stream` keeps as `_stream`, and its `recv_data`. This fails when grpclib changes either."""

    async def main() -> None:
        wire = RequestWire(_server_stream(_http2_stream(b"\0\0\0\0\3", b"ab", b"c")))
        assert await wire.read(5) == b"\0\0\0\0\3"  # whole reads across the frames as they came
        assert await wire.read(3) == b"abc"
        assert await wire.read(5) == b""  # ended before any byte: the client sent nothing more
        with pytest.raises(EndedInsideMessage):
            await RequestWire(_server_stream(_http2_stream(b"\0\0\0"))).read(5)  # ended inside the bytes asked for
        assert await RequestWire(_server_stream(_http2_stream())).read_exactly(0) == b""  # an empty message
        with pytest.raises(EndedInsideMessage):
            await RequestWire(_server_stream(_http2_stream())).read_exactly(3)

    anyio.run(main)


def test_a_request_that_ends_inside_its_message_is_refused(served: Served) -> None:
    async def main() -> None:
        error: GRPCError | None = None
        for sent in (b"\0\0\0", b"\0\0\0\0\x09", b"\0\0\0\0\x09\x0a\x01"):
            stream = _server_stream(_http2_stream(sent))
            with pytest.raises(GRPCError) as refused_here:
                await served.servicer._receive(stream, "Allocate", pb.AllocateRequest)
            error = refused_here.value
            assert (error.status, error.message) == (
                Status.INVALID_ARGUMENT,
                f"{RESOURCE}: the Allocate request ended inside its message",
            )
        assert await served.servicer._receive(_server_stream(_http2_stream()), "Allocate", pb.AllocateRequest) is None

    anyio.run(main)
