"""Requests no kubelet sends, through the agent's real socket: too large, declared large and abandoned, undecodable.
Each gets a clear status fast, one log line, and leaves the agent's memory where it was."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from mpsagent_testing.agents import AgentLauncher, AgentProcess, start_agent
from mpsagent_testing.kubelet.calls import allocate, preferred
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.kubelet.stubs import dp_pb2
from mpsagent_testing.node import ALL, RESOURCE, config, small_node, write_config

ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
MIB = 1024 * 1024


@pytest.fixture
def served(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> tuple[AgentProcess, Plugin, Path]:
    agent = start_agent(agents, kubelet, short_dir, config())
    plugin = kubelet.wait_registered(RESOURCE)
    return agent, plugin, kubelet.socket_path.parent / plugin.request.endpoint


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for PID {pid}")


def raw_call(socket_path: Path, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """An Allocate whose message is `payload` as is (grpcio sends bytes unchanged without a serializer)."""
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        call = channel.unary_unary(ALLOCATE)
        try:
            call(payload, timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def declare_and_abandon(socket_path: Path, *, declared: int, send: int, reset: bool, stall_s: float = 1.0) -> int:
    """Open a connection, start an Allocate whose message declares `declared` bytes, send up to `send` bytes of its
    body as the server's flow control lets through, then abandon it: reset the stream, or drop the connection.
    Returns the body bytes the server let through."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    sent = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(stall_s)
        sock.connect(str(socket_path))
        connection.initiate_connection()
        stream = connection.get_next_available_stream_id()
        connection.send_headers(
            stream,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", ALLOCATE),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        connection.send_data(stream, struct.pack(">?I", False, declared))
        sock.sendall(connection.data_to_send())
        chunk = b"\x0a" * connection.max_outbound_frame_size
        answered = False
        while sent < send and not answered:
            window = min(connection.local_flow_control_window(stream), len(chunk), send - sent)
            if window > 0:
                connection.send_data(stream, chunk[:window])
                sock.sendall(connection.data_to_send())
                sent += window
                continue
            try:
                data = sock.recv(65536)  # wait for a window update, or the server's answer
            except TimeoutError:
                break  # the server stopped reading: it will not take more
            if not data:
                break
            for event in connection.receive_data(data):
                answered |= isinstance(event, h2.events.StreamEnded | h2.events.StreamReset)
            sock.sendall(connection.data_to_send())
        if reset and not answered:
            with contextlib.suppress(Exception):
                connection.reset_stream(stream)
                sock.sendall(connection.data_to_send())
    return sent


def test_a_100_mb_allocate_is_refused_fast_as_resource_exhausted(served) -> None:
    agent, plugin, _ = served
    request = dp_pb2.AllocateRequest(
        container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=["x" * 100 * MIB])]
    )
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        plugin.stub.Allocate(request, timeout=30)
    assert time.monotonic() - began < 5
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = refused.value.details()
    assert f"{RESOURCE}: Allocate request of {len(request.SerializeToString())} bytes is larger than" in details
    assert len(details) < 300
    assert "Traceback" not in agent.log()
    # The largest request a kubelet sends for this node still passes: every replica at once.
    assert len(allocate(plugin, ALL).container_responses) == 1


def test_huge_declared_messages_abandoned_midway_do_not_grow_the_agents_memory(served) -> None:
    agent, _, socket_path = served
    pid = agent.process.pid
    declare_and_abandon(socket_path, declared=1024, send=0, reset=True)  # warm up the connection path
    before = rss_bytes(pid)
    let_through = [
        declare_and_abandon(socket_path, declared=4 * 1024 * MIB - 1, send=64 * MIB, reset=attempt % 2 == 0)
        for attempt in range(6)
    ]
    # The body is refused once its length prefix is read: the server lets through at most a flow-control window.
    assert max(let_through) <= 1 * MIB, let_through
    assert agent.process.poll() is None
    growth = rss_bytes(pid) - before
    assert growth < 20 * MIB, f"RSS grew by {growth / MIB:.0f} MiB"
    refused = [e for e in agent.log_events() if e.get("event") == "request refused"]
    assert len(refused) >= 1 and refused[0]["reason"].startswith("Allocate request of 4294967295 bytes")


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xff\xff\xff",  # a field number of 0x1fffffff with wire type 7, which does not exist
        b"\x0a\x05ab",  # a string field that declares 5 bytes and has 2
    ],
)
def test_an_undecodable_request_is_invalid_argument_with_one_log_line(served, payload: bytes) -> None:
    agent, _, socket_path = served
    code, details = raw_call(socket_path, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"{RESOURCE}: the Allocate request is not a valid protobuf message; was it sent by a kubelet?"
    logged = wait_for(lambda: [e for e in agent.log_events() if e.get("event") == "request refused"], 5, "the log line")
    assert len(logged) == 1 and logged[0]["rpc"] == "Allocate"
    assert "Traceback" not in agent.log() and "Application error" not in agent.log()
    assert agent.process.poll() is None


def test_the_largest_requests_of_a_large_node_pass(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    """32 GPUs of 48 replicas: a preferred allocation naming all 1,536 as available and as required is 144 KB,
    well over the 64 KiB a small node's plugin takes."""
    agents.start(
        "--config-file",
        str(write_config(short_dir / "config.yaml", config(replicas=48))),
        "--node-snapshot",
        str(small_node(short_dir / "node.json", gpus=32)),
        "--kubelet-socket",
        str(kubelet.socket_path),
        "--mps-root",
        str(short_dir / "mps"),
    )
    plugin = kubelet.wait_registered(RESOURCE)
    every = [device[0] for device in plugin.latest()]
    assert len(every) == 1536
    assert sorted(preferred(plugin, every, len(every), must=every)) == sorted(every)
    assert len(allocate(plugin, every).container_responses) == 1
