"""The node the tests describe: a 2-GPU snapshot, its GPU UUIDs and replica IDs, and the config files for it."""

from __future__ import annotations

import json
from pathlib import Path

from mpsagent_testing.domain import DRIVER_VERSION, T4, uuid

RESOURCE = "nvidia.com/gpu"
GPU0 = uuid(0)
GPU1 = uuid(1)


def ids(gpu: str, *replicas: int) -> list[str]:
    return [f"{gpu}::{i}" for i in replicas]


ALL = ids(GPU0, 0, 1, 2, 3) + ids(GPU1, 0, 1, 2, 3)
"""Every replica ID of `config()`'s resource on `small_node()`'s two GPUs."""


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def small_node(
    path: Path, gpus: int = 2, memory_bytes: int = T4.memory_bytes, numa: list[int | None] | None = None
) -> Path:
    """A node snapshot file of `gpus` T4s (GPU0, GPU1, ...): the GPUs of `domain.gpus_of(gpus)`."""
    numa = numa or [0] * gpus
    document = {
        "driverVersion": DRIVER_VERSION,
        "gpus": [
            {
                "uuid": uuid(i),
                "index": i,
                "name": T4.name,
                "memoryBytes": memory_bytes,
                "computeCapability": "{}.{}".format(*T4.compute_capability),
                "pciBusId": f"00000000:{i + 1:02X}:00.0",
                "numaNode": numa[i],
            }
            for i in range(gpus)
        ],
    }
    path.write_text(json.dumps(document))
    return path


def config(
    fail_gt_one: bool | None = False, policy: str = "distributed", replicas: int = 4, grants: str | None = None
) -> str:
    """A config file's text: one MPS resource `gpu` of `replicas` replicas per GPU."""
    fail = "" if fail_gt_one is None else f"    failRequestsGreaterThanOne: {str(fail_gt_one).lower()}\n"
    fail += "" if grants is None else f"    grants: {grants}\n"
    return (
        "version: v1\n"
        f"flags:\n  plugin:\n    sharedDevicesAllocationPolicy: {policy}\n"
        f"sharing:\n  mps:\n{fail}    resources:\n    - name: gpu\n      replicas: {replicas}\n"
    )
