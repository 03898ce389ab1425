"""The kubelet's side of the calls: grpcio requests over the unix sockets, timed with perf_counter_ns."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from mpsagent_testing.kubelet.stubs import dp_grpc, dp_pb2

CALL_TIMEOUT_S = 30.0  # the kubelet sets none; the bench must not hang


def stub_for(socket_path: Path) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(f"unix://{socket_path}")
    grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
    return channel, dp_grpc.DevicePluginStub(channel)


def allocate_request(*containers: Sequence[str]) -> Any:
    return dp_pb2.AllocateRequest(
        container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=list(ids)) for ids in containers]
    )


def preferred_request(available: Sequence[str], size: int) -> Any:
    return dp_pb2.PreferredAllocationRequest(
        container_requests=[
            dp_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=list(available), allocation_size=size)
        ]
    )


def timed(call: Callable[..., Any], request: Any) -> tuple[int, Any]:
    """One round trip: (nanoseconds, response)."""
    started = time.perf_counter_ns()
    response = call(request, timeout=CALL_TIMEOUT_S)
    return time.perf_counter_ns() - started, response


def time_calls(call: Callable[..., Any], requests: Sequence[Any]) -> list[int]:
    """Sequential round trips, one per request: nanoseconds each."""
    samples = []
    for request in requests:
        started = time.perf_counter_ns()
        call(request, timeout=CALL_TIMEOUT_S)
        samples.append(time.perf_counter_ns() - started)
    return samples


def burst(stub: Any, requests: Sequence[Any]) -> int:
    """Every request at once (pods admitted together) on one connection: nanoseconds until the last answer."""
    started = time.perf_counter_ns()
    pending = [stub.Allocate.future(request, timeout=CALL_TIMEOUT_S) for request in requests]
    for future in pending:
        future.result()
    return time.perf_counter_ns() - started


def cycle(items: Sequence[Any], count: int, offset: int = 0) -> list[Any]:
    return [items[(offset + i) % len(items)] for i in range(count)]
