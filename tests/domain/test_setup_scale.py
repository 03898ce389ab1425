"""A node's set-up (plan, allocator, inventory) costs time in proportion to its replicas, not their square.

The agent refuses nodes of more than MAX_GPUS_PER_NODE GPUs, but the domain code takes any node it is given; a
quadratic step would hide behind that bound until someone raised it.
"""

from __future__ import annotations

import time
from pathlib import Path

from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import build_plan
from mpsagent_testing.domain import gpus_of, node_gpus, sharing

GPUS = 5000  # took 16.7 s when the allocator grouped replicas by scanning every replica for every GPU
SETUP_S = 2.0  # the linear set-up takes about 0.1 s


def test_set_up_of_thousands_of_gpus_is_linear() -> None:
    config = sharing("version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      replicas: 4\n")
    big = node_gpus(*gpus_of(GPUS))
    started = time.perf_counter()
    plan = build_plan(config, big, Path("/run/mps"))
    allocator = ResourceAllocator(plan.resources[0], plan.shm_directory)
    inventory = Inventory(plan.resources[0], daemon_ready=True)
    snapshot = inventory.snapshot()
    elapsed = time.perf_counter() - started
    assert elapsed < SETUP_S, f"set-up of {GPUS} GPUs took {elapsed:.1f} s"
    assert len(snapshot.devices) == GPUS * 4
    last = big.gpus[-1].uuid
    assert allocator.preferred([f"{last}::0", f"{last}::3"], [], 1) == [f"{last}::0"]
