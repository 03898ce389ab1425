"""Preferred-allocation policies for GetPreferredAllocation, as pure functions over replica IDs."""

from __future__ import annotations

from collections.abc import Sequence

from mpsagent.base.devices import GpuUuid, ReplicaId, gpu_of
from mpsagent.base.errors import RequestError
from mpsagent.base.values import AllocationPolicy
from mpsagent.base.words import counted


def preferred_replicas(
    *,
    gpu_replicas: dict[GpuUuid, tuple[ReplicaId, ...]],
    available: Sequence[ReplicaId],
    must_include: Sequence[ReplicaId],
    size: int,
    policy: AllocationPolicy,
    resource: str,
    memory_units: bool = False,
    equal_grants: bool = False,
    full_gpus: frozenset[GpuUuid] = frozenset(),
) -> list[ReplicaId]:
    """Choose `size` replicas from `available`, `must_include` first.

    `gpu_replicas` lists every ID of each GPU, GPUs in host-index order. GPUs in `full_gpus` (at MPS's client
    limit) are left out while the others suffice. Then, in order:
    - replicas, k whole GPUs' worth: k wholly free GPUs when there are that many (what makes whole-GPU grants
      reachable);
    - replicas, at most one GPU's worth: one GPU that has room (fewest GPUs touched), chosen by the policy;
    - memory units: all on one GPU, best fit (the fullest GPU that still fits), else the fewest GPUs;
    - otherwise one at a time: `distributed` from the GPU with the fewest IDs in use, `packed` the most.
    `equal_grants` (`grants: equal`): always one at a time, as the NVIDIA plugin does: every partial grant is
    1/replicas of each GPU it touches, so keeping a request on few GPUs buys the container nothing, and
    `distributed` spreads the load.
    """
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) > size:
        raise RequestError(
            f"{resource}: {counted(len(chosen), 'replica')} must be included but only {size} "
            f"{'was' if size == 1 else 'were'} requested"
        )
    free = set(available) - set(chosen)
    if len(free) < size - len(chosen):
        available_count = len(free) + len(chosen)
        raise RequestError(
            f"{resource}: {counted(size, 'replica')} requested but only {available_count} "
            f"{'is' if available_count == 1 else 'are'} available"
        )
    remaining = size - len(chosen)
    if not remaining:
        return chosen
    roomy = {r for r in free if gpu_of(r) not in full_gpus} if full_gpus else free
    if len(roomy) >= remaining:
        free = roomy
    per_gpu = {gpu: [r for r in replicas if r in free] for gpu, replicas in gpu_replicas.items()}
    order = list(gpu_replicas)
    in_use = {gpu: len(gpu_replicas[gpu]) - len(per_gpu[gpu]) for gpu in gpu_replicas}
    if memory_units:
        return chosen + _fewest_gpus(per_gpu, order, remaining)
    if equal_grants:
        return chosen + _one_at_a_time(per_gpu, in_use, order, policy, remaining)
    replicas_per_gpu = max((len(r) for r in gpu_replicas.values()), default=0)
    if replicas_per_gpu and remaining % replicas_per_gpu == 0:
        whole = [gpu for gpu, replicas in per_gpu.items() if len(replicas) == len(gpu_replicas[gpu])]
        wanted = remaining // replicas_per_gpu
        if len(whole) >= wanted:
            return chosen + [r for gpu in whole[:wanted] for r in per_gpu[gpu]]
    fits = [gpu for gpu in order if len(per_gpu[gpu]) >= remaining]
    if fits:
        touched = {gpu_of(r) for r in chosen}
        fits = [gpu for gpu in fits if gpu in touched] or fits  # fewest GPUs touched
        return chosen + per_gpu[_by_policy(fits, in_use, order, policy)][:remaining]
    return chosen + _one_at_a_time(per_gpu, in_use, order, policy, remaining)


def _one_at_a_time(
    per_gpu: dict[GpuUuid, list[ReplicaId]],
    in_use: dict[GpuUuid, int],
    order: list[GpuUuid],
    policy: AllocationPolicy,
    wanted: int,
) -> list[ReplicaId]:
    """Replica by replica, each from the GPU the policy picks given the ones taken before it."""
    taken = []
    for _ in range(wanted):
        gpu = _by_policy([gpu for gpu in order if per_gpu[gpu]], in_use, order, policy)
        taken.append(per_gpu[gpu].pop(0))
        in_use[gpu] += 1
    return taken


def _by_policy(
    candidates: list[GpuUuid], in_use: dict[GpuUuid, int], order: list[GpuUuid], policy: AllocationPolicy
) -> GpuUuid:
    if policy is AllocationPolicy.PACKED:
        return max(candidates, key=lambda g: (in_use[g], -order.index(g)))
    return min(candidates, key=lambda g: (in_use[g], order.index(g)))


def _fewest_gpus(per_gpu: dict[GpuUuid, list[ReplicaId]], order: list[GpuUuid], wanted: int) -> list[ReplicaId]:
    """Memory units: the fullest GPU that still has room for all of them, else the roomiest GPUs first."""
    fits = [gpu for gpu in order if len(per_gpu[gpu]) >= wanted]
    if fits:
        best = min(fits, key=lambda g: (len(per_gpu[g]), order.index(g)))
        return per_gpu[best][:wanted]
    taken: list[ReplicaId] = []
    for gpu in sorted(order, key=lambda g: (-len(per_gpu[g]), order.index(g))):
        taken += per_gpu[gpu][: wanted - len(taken)]
        if len(taken) == wanted:
            break
    return taken
