"""The agent's own DRA prepare in one process, with and without the daemon's front-end started while the claims are
read, interleaved: the claim server over a real resource server and the real MPS control daemon (the harness of
tests/test_claim_server.py: two 80 GiB GPUs, a temporary MPS root and CDI directory), the API server's read of the
claim a fixed delay. Each round prepares one 8Gi claim and unprepares it, so that every prepare changes the
daemon's ceilings, as on an idle node; rounds alternate the two kinds. Prints the medians and p90s.

    .venv/bin/python bench/dra_prepare_inprocess.py [--rounds 200] [--read-ms 3]

A few seconds; no node, no GPU."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from mpsagent.base.logs import configure_logging
from mpsagent.domain.claims import ClaimAllocation, ClaimRef
from mpsagent.mps.daemon import DaemonSupervisor
from mpsagent_testing.repo import ROOT

sys.path.insert(0, str(ROOT / "tests"))
import test_claim_server as harness  # the tests' harness, from the checkout

WARM_UP = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--read-ms", type=float, default=3.0, help="the API server's read of a claim")
    args = parser.parse_args()
    configure_logging(level="warning")  # the agent's lines per prepare would cost more than the prepare
    read_s = args.read_ms / 1000

    async def read_claim(self: Any, ref: ClaimRef, *, driver: str, node: str) -> ClaimAllocation:
        await anyio.sleep(read_s)
        found: ClaimAllocation = self.claims[ref.uid]
        return found

    harness.FakeKubeApi.read_claim = read_claim  # type: ignore[method-assign]
    ahead = DaemonSupervisor.ceilings_expected

    @contextlib.asynccontextmanager
    async def not_ahead(self: DaemonSupervisor) -> AsyncIterator[None]:
        yield

    times: dict[str, list[float]] = {"front-end started ahead": [], "front-end started when needed": []}
    with tempfile.TemporaryDirectory(prefix="dra-prep", dir="/tmp") as directory:
        node = harness.Node(Path(directory))
        agent = node.agent()

        async def rounds() -> None:
            async with agent.running():
                node.api.allocate(harness.allocation(harness.CLAIM_A, memory_bytes=8 * harness.GIB))
                for index in range(args.rounds + WARM_UP):
                    kind = list(times)[index % 2]
                    DaemonSupervisor.ceilings_expected = ahead if index % 2 == 0 else not_ahead  # type: ignore[method-assign]
                    began = time.perf_counter()
                    await agent.claims.prepare([harness.CLAIM_A])
                    if index >= WARM_UP:
                        times[kind].append(time.perf_counter() - began)
                    await agent.claims.unprepare([harness.CLAIM_A])
                    await anyio.sleep(0.02)

        node.run(rounds)
    print(f"prepare of one 8Gi claim, the claim's read {args.read_ms:g} ms, {args.rounds} rounds interleaved:")
    for kind, values in times.items():
        values.sort()
        print(
            f"  {kind:32} median {statistics.median(values) * 1000:6.2f} ms   "
            f"p90 {values[int(len(values) * 0.9)] * 1000:6.2f} ms"
        )


if __name__ == "__main__":
    main()
