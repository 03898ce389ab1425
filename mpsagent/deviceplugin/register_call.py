"""The device plugin's registration with the kubelet: one Register call over the kubelet's unix socket, made by the
endpoint."""

from __future__ import annotations

from pathlib import Path

from grpclib.client import Channel

from mpsagent._proto import v1beta1 as pb

API_VERSION = "v1beta1"
REGISTER_TIMEOUT_S = 10.0


async def register(
    kubelet_socket: Path,
    *,
    endpoint: str,
    resource_name: str,
    pre_start_required: bool,
    timeout_s: float = REGISTER_TIMEOUT_S,
) -> None:
    """Register one plugin endpoint; raises OSError, GRPCError or StreamTerminatedError when the kubelet refuses."""
    channel = Channel(path=str(kubelet_socket))
    try:
        await pb.RegistrationStub(channel).register(
            pb.RegisterRequest(
                version=API_VERSION,
                endpoint=endpoint,
                resource_name=resource_name,
                options=pb.DevicePluginOptions(
                    pre_start_required=pre_start_required, get_preferred_allocation_available=True
                ),
            ),
            timeout=timeout_s,
        )
    finally:
        channel.close()
