"""The device-plugin calls a kubelet makes, through a registered plugin's grpcio stub."""

from __future__ import annotations

from typing import Any

from mpsagent_testing.kubelet.fake import Plugin
from mpsagent_testing.kubelet.stubs import dp_pb2


def allocate(plugin: Plugin, *containers: list[str]) -> Any:
    """`Allocate` with one container request per list of replica IDs; the response."""
    request = dp_pb2.AllocateRequest(
        container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    return plugin.stub.Allocate(request, timeout=5)


def preferred(plugin: Plugin, available: list[str], size: int, must: list[str] | None = None) -> list[str]:
    """`GetPreferredAllocation` for one container; the IDs the plugin prefers."""
    request = dp_pb2.PreferredAllocationRequest(
        container_requests=[
            dp_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must or [], allocation_size=size
            )
        ]
    )
    return list(plugin.stub.GetPreferredAllocation(request, timeout=5).container_responses[0].deviceIDs)
