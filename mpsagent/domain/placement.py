"""Preferred-allocation policies for GetPreferredAllocation, as pure functions over replica IDs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    free = set(available) - set(chosen)
    _check_counts(resource, size, included=len(chosen), free=len(free))
    remaining = size - len(chosen)
    if not remaining:
        return chosen
    roomy = {r for r in free if gpu_of(r) not in full_gpus} if full_gpus else free
    gpus = _FreeReplicas.of(gpu_replicas, roomy if len(roomy) >= remaining else free)
    if memory_units:
        return chosen + _fewest_gpus(gpus, remaining)
    if equal_grants:
        return chosen + _one_at_a_time(gpus, policy, remaining)
    picked = _whole_gpus(gpus, remaining)
    if picked is None:
        picked = _one_gpu(gpus, policy, remaining, touched={gpu_of(r) for r in chosen})
    return chosen + (_one_at_a_time(gpus, policy, remaining) if picked is None else picked)


def _check_counts(resource: str, size: int, *, included: int, free: int) -> None:
    """Refuse a request that must include more IDs than it asks for, or for which fewer IDs are available."""
    if included > size:
        raise RequestError(
            f"{resource}: {counted(included, 'replica')} must be included but only {size} "
            f"{'was' if size == 1 else 'were'} requested"
        )
    if free < size - included:
        available = free + included
        raise RequestError(
            f"{resource}: {counted(size, 'replica')} requested but only {available} "
            f"{'is' if available == 1 else 'are'} available"
        )


@dataclass(slots=True)
class _FreeReplicas:
    """The free replicas of each GPU (GPUs in host-index order) and how many of its IDs are in use, as the choice
    goes on."""

    per_gpu: dict[GpuUuid, list[ReplicaId]]
    in_use: dict[GpuUuid, int]
    order: list[GpuUuid]
    id_count: dict[GpuUuid, int]
    """Every GPU's number of IDs, free or not."""

    @classmethod
    def of(cls, gpu_replicas: dict[GpuUuid, tuple[ReplicaId, ...]], free: set[ReplicaId]) -> _FreeReplicas:
        per_gpu = {gpu: [r for r in replicas if r in free] for gpu, replicas in gpu_replicas.items()}
        id_count = {gpu: len(replicas) for gpu, replicas in gpu_replicas.items()}
        in_use = {gpu: id_count[gpu] - len(per_gpu[gpu]) for gpu in gpu_replicas}
        return cls(per_gpu=per_gpu, in_use=in_use, order=list(gpu_replicas), id_count=id_count)


def _whole_gpus(gpus: _FreeReplicas, wanted: int) -> list[ReplicaId] | None:
    """k wholly free GPUs, for a request of k whole GPUs' worth when there are that many; else None."""
    replicas_per_gpu = max(gpus.id_count.values(), default=0)
    if not replicas_per_gpu or wanted % replicas_per_gpu:
        return None
    whole = [gpu for gpu, replicas in gpus.per_gpu.items() if len(replicas) == gpus.id_count[gpu]]
    if len(whole) < wanted // replicas_per_gpu:
        return None
    return [r for gpu in whole[: wanted // replicas_per_gpu] for r in gpus.per_gpu[gpu]]


def _one_gpu(
    gpus: _FreeReplicas, policy: AllocationPolicy, wanted: int, *, touched: set[GpuUuid]
) -> list[ReplicaId] | None:
    """All from one GPU that has room, one already `touched` if any (fewest GPUs touched), chosen by the policy;
    None when no GPU has room."""
    fits = [gpu for gpu in gpus.order if len(gpus.per_gpu[gpu]) >= wanted]
    if not fits:
        return None
    fits = [gpu for gpu in fits if gpu in touched] or fits
    return gpus.per_gpu[_by_policy(fits, gpus, policy)][:wanted]


def _one_at_a_time(gpus: _FreeReplicas, policy: AllocationPolicy, wanted: int) -> list[ReplicaId]:
    """Replica by replica, each from the GPU the policy picks given the ones taken before it."""
    taken = []
    for _ in range(wanted):
        gpu = _by_policy([gpu for gpu in gpus.order if gpus.per_gpu[gpu]], gpus, policy)
        taken.append(gpus.per_gpu[gpu].pop(0))
        gpus.in_use[gpu] += 1
    return taken


def _by_policy(candidates: list[GpuUuid], gpus: _FreeReplicas, policy: AllocationPolicy) -> GpuUuid:
    in_use, order = gpus.in_use, gpus.order
    if policy is AllocationPolicy.PACKED:
        return max(candidates, key=lambda g: (in_use[g], -order.index(g)))
    return min(candidates, key=lambda g: (in_use[g], order.index(g)))


def _fewest_gpus(gpus: _FreeReplicas, wanted: int) -> list[ReplicaId]:
    """Memory units: the fullest GPU that still has room for all of them, else the roomiest GPUs first."""
    per_gpu, order = gpus.per_gpu, gpus.order
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
