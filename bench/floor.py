"""The floor: a minimal grpclib server, with the same messages (upb protobuf) and codec as the agent, that answers
Allocate with a pre-built response (real agent answers, replayed, chosen by the number of IDs asked for) and
GetPreferredAllocation with the first IDs offered. It does what any server of this kind must (parse the request,
send an answer of the same size) and nothing else. Run as `python -m bench.floor SOCKET COUNT=FILE...`;
`FloorProcess` starts it the way the bench starts the agent."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from grpclib.const import Cardinality, Handler
from grpclib.server import Server, Stream

from mpsagent._proto.upb.deviceplugin.v1beta1 import api_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 30.0


class FloorServicer:
    def __init__(self, responses: Mapping[int, pb.AllocateResponse]) -> None:
        self._responses = dict(responses)
        self._default = next(iter(self._responses.values()))

    async def _allocate(self, stream: Stream[Any, Any]) -> None:
        message = await stream.recv_message()
        count = len(message.container_requests[0].devices_ids) if message and message.container_requests else 0
        await stream.send_message(self._responses.get(count, self._default))

    async def _get_preferred_allocation(self, stream: Stream[Any, Any]) -> None:
        message = await stream.recv_message()
        assert message is not None
        await stream.send_message(
            pb.PreferredAllocationResponse(
                container_responses=[
                    pb.ContainerPreferredAllocationResponse(deviceIDs=r.available_deviceIDs[: r.allocation_size])
                    for r in message.container_requests
                ]
            )
        )

    def __mapping__(self) -> dict[str, Handler]:
        service = "/v1beta1.DevicePlugin/"
        return {
            service + "Allocate": Handler(
                self._allocate, Cardinality.UNARY_UNARY, pb.AllocateRequest, pb.AllocateResponse
            ),
            service + "GetPreferredAllocation": Handler(
                self._get_preferred_allocation,
                Cardinality.UNARY_UNARY,
                pb.PreferredAllocationRequest,
                pb.PreferredAllocationResponse,
            ),
        }


async def serve(socket_path: Path, responses: Mapping[int, pb.AllocateResponse]) -> None:
    server = Server([FloorServicer(responses)])
    await server.start(path=str(socket_path))
    await server.wait_closed()


class FloorProcess:
    """The floor server as a process of its own; `responses`: serialized AllocateResponse by the number of IDs
    requested (the first one answers any other count)."""

    def __init__(self, socket_path: Path, responses: Mapping[int, bytes], env: dict[str, str]) -> None:
        self.socket_path = socket_path
        argv = [sys.executable, "-m", "bench.floor", str(socket_path)]
        for count, response in responses.items():
            response_file = socket_path.with_suffix(f".{count}.response")
            response_file.write_bytes(response)
            argv.append(f"{count}={response_file}")
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not socket_path.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the floor server did not start (status {self.process.returncode})")
            time.sleep(0.02)

    def __enter__(self) -> FloorProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)
        self.socket_path.unlink(missing_ok=True)


def main() -> None:
    socket_path = Path(sys.argv[1])
    responses = {}
    for argument in sys.argv[2:]:
        count, _, response_file = argument.partition("=")
        responses[int(count)] = pb.AllocateResponse.FromString(Path(response_file).read_bytes())
    os.umask(0o177)
    socket_path.unlink(missing_ok=True)
    asyncio.run(serve(socket_path, responses))


if __name__ == "__main__":
    main()
