"""The agent's own Allocate work without sockets: the servicer's `allocate` (the request parsed, the allocator, the
answer serialized; no daemon, no log line) on the bench's nodes, repeated as the kubelet would, in microseconds.

    .venv/bin/python bench/allocate_inprocess.py              # a few seconds
    .venv/bin/python bench/allocate_inprocess.py --calls 500

Rows: the 768-ID full grant of the 16x48 node again and again, its IDs in the same order and shuffled (the kubelet
lists a container's devices in no set order), and 1-replica grants across the 8x48 node's IDs as the bench makes
them. Quick to re-run after a change to the ledger, the allocator, the shares or the servicer; `bench/run.py` and
`bench/profile_agent.py` show what the agent process as a whole does.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agent import NodeShape, replica_ids, spread_ids, write_config, write_snapshot
from params import BASE, SCALE

from mpsagent._proto.upb.deviceplugin.v1beta1 import api_pb2 as pb
from mpsagent.base.config import check_config, parse_config
from mpsagent.deviceplugin.servicer import DevicePluginServicer
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import build_plan
from mpsagent.gpu.snapshot import SnapshotGpuSource

SHUFFLED_REQUESTS = 64


def servicer_for(shape: NodeShape, directory: Path) -> DevicePluginServicer:
    node = SnapshotGpuSource(write_snapshot(directory / f"{shape}.json", shape)).discover()
    config = write_config(directory / f"{shape}.yaml", shape)
    plan = build_plan(check_config(parse_config(config.read_text(), str(config))), node, Path("/run/mps"))
    allocator = ResourceAllocator(plan.resources[0], plan.shm_directory)
    return DevicePluginServicer(allocator, Inventory(allocator.resource))


def request_bytes(ids: list[str]) -> bytes:
    message = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    return message.SerializeToString()


def timed(call: Callable[[], None], calls: int) -> str:
    samples = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - started)
    samples.sort()
    p10, median, p99 = (samples[int(len(samples) * q)] / 1000 for q in (0.1, 0.5, 0.99))
    return f"p10 {p10:7.1f}  median {median:7.1f}  p99 {p99:8.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/allocate_inprocess.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per row (full grants: a quarter)")
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory() as work:
        scale, base = servicer_for(SCALE, Path(work)), servicer_for(BASE, Path(work))
    full_ids = replica_ids(SCALE)
    shuffle = random.Random(20)
    calls = iter(range(sys.maxsize))

    def answer(servicer: DevicePluginServicer, bodies: list[bytes]) -> Callable[[], None]:
        def call() -> None:
            body = bodies[next(calls) % len(bodies)]
            loop.run_until_complete(servicer.allocate(pb.AllocateRequest.FromString(body))).SerializeToString()

        return call

    def shuffled() -> list[bytes]:
        return [request_bytes(shuffle.sample(full_ids, len(full_ids))) for _ in range(SHUFFLED_REQUESTS)]

    # Each row's requests are made just before it, and it warms first; the 1-replica row grants every ID once, so
    # that each timed grant ends an earlier one.
    singles = spread_ids(BASE)
    rows: list[tuple[str, Callable[[], list[bytes]], DevicePluginServicer, int, int]] = [
        ("768 IDs, the same order", lambda: [request_bytes(full_ids)], scale, 50, args.calls // 4),
        ("768 IDs, shuffled", shuffled, scale, 50, args.calls // 4),
        ("1 replica", lambda: [request_bytes([replica]) for replica in singles], base, len(singles), args.calls),
    ]
    print("Allocate through the servicer, in-process, microseconds")
    for name, bodies, servicer, warm, count in rows:
        call = answer(servicer, bodies())
        for _ in range(warm):
            call()
        print(f"{name:<26} {timed(call, count)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
