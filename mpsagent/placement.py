"""Preferred-allocation policies for GetPreferredAllocation, as pure functions over replica IDs."""

from __future__ import annotations

from collections.abc import Sequence

from mpsagent.config import AllocationPolicy
from mpsagent.devices import GpuUuid, ReplicaId
from mpsagent.errors import RequestError


def preferred_replicas(
    *,
    gpu_replicas: dict[GpuUuid, tuple[ReplicaId, ...]],
    available: Sequence[ReplicaId],
    must_include: Sequence[ReplicaId],
    size: int,
    policy: AllocationPolicy,
    resource: str,
) -> list[ReplicaId]:
    """Choose `size` replicas from `available`, `must_include` first.

    `gpu_replicas` lists every replica of each GPU, GPUs in host-index order. A request of k whole GPUs' worth
    takes k wholly free GPUs when there are that many: this is what makes full-GPU grants reachable. Otherwise
    `distributed` takes from the GPU with the fewest replicas in use, `packed` from the one with the most.
    """
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) > size:
        raise RequestError(f"{resource}: {len(chosen)} replicas must be included but only {size} were requested")
    free = set(available) - set(chosen)
    if len(free) < size - len(chosen):
        raise RequestError(f"{resource}: {size} replicas requested but only {len(free) + len(chosen)} are available")
    per_gpu = {gpu: [r for r in replicas if r in free] for gpu, replicas in gpu_replicas.items()}
    remaining = size - len(chosen)
    replicas_per_gpu = max((len(r) for r in gpu_replicas.values()), default=0)
    if remaining and replicas_per_gpu and remaining % replicas_per_gpu == 0:
        whole = [gpu for gpu, replicas in per_gpu.items() if len(replicas) == len(gpu_replicas[gpu])]
        wanted = remaining // replicas_per_gpu
        if len(whole) >= wanted:
            return chosen + [r for gpu in whole[:wanted] for r in per_gpu[gpu]]
    in_use = {gpu: len(gpu_replicas[gpu]) - len(per_gpu[gpu]) for gpu in gpu_replicas}
    order = list(gpu_replicas)
    for _ in range(remaining):
        candidates = [gpu for gpu in order if per_gpu[gpu]]
        if policy is AllocationPolicy.PACKED:
            gpu = max(candidates, key=lambda g: (in_use[g], -order.index(g)))
        else:
            gpu = min(candidates, key=lambda g: (in_use[g], order.index(g)))
        chosen.append(per_gpu[gpu].pop(0))
        in_use[gpu] += 1
    return chosen
