"""One accounting per GPU across both routes: what the live shares hold of each GPU's memory and compute, what is
left, whether a new share fits beside them, and what each route may still be offered.

Pure and synchronous: the live shares are the ledger's tally (`shares.ShareTally`, which counts what each share
holds by route). A device-plugin replica holds k/N of its GPU's memory and SMs; a DRA claim holds the memory and
compute it consumed. An Allocate and a prepare are admitted only when every GPU they touch keeps within its memory,
its SMs and MPS's client limit, and is healthy (`admit`); the ResourceSlice offers the claims what the device-plugin
grants leave (`claim_capacity`), and ListAndWatch withholds the free replicas that no longer fit beside the claims
(`withheld_replicas`). The refusal's wording is here, once, for both routes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mpsagent.base.devices import GpuUuid, ReplicaId
from mpsagent.domain.shares import FULL_THREAD_PERCENTAGE, GpuSlots, Route, Share, ShareModel, ShareTally

GpuProblem = Callable[[GpuUuid], str | None]
"""Why a GPU is unhealthy now (a critical Xid, its MPS daemon down), or None while it is healthy."""


def healthy(uuid: GpuUuid) -> str | None:
    """The GPU problem of a node whose health is not watched: none."""
    return None


class RefusalKind(enum.StrEnum):
    CLIENTS = "clients"
    MEMORY = "memory"
    COMPUTE = "compute"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuRefusal:
    """Why a share does not fit on one GPU: the kind, and the GPU's side of it in words (the route says the rest)."""

    kind: RefusalKind
    uuid: GpuUuid
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuUse:
    """What the live shares hold of one GPU, by route, and what is left."""

    gpu: GpuSlots
    grant_memory_mib: int
    grant_compute: int
    claim_memory_mib: int
    claim_compute: int

    @property
    def free_memory_mib(self) -> int:
        return max(0, self.gpu.memory_mib - self.grant_memory_mib - self.claim_memory_mib)

    @property
    def free_compute(self) -> int:
        return max(0, FULL_THREAD_PERCENTAGE - self.grant_compute - self.claim_compute)

    def held(self) -> str:
        return (
            f"device-plugin grants hold {self.grant_memory_mib} MiB and {self.grant_compute} % of its SMs, claims "
            f"{self.claim_memory_mib} MiB and {self.claim_compute} %"
        )


def gpu_use(shares: ShareModel, tally: ShareTally, ordinal: int) -> GpuUse:
    grant_memory, grant_compute = tally.held(ordinal, Route.DEVICE_PLUGIN)
    claim_memory, claim_compute = tally.held(ordinal, Route.CLAIM)
    return GpuUse(
        gpu=shares.gpus[ordinal],
        grant_memory_mib=grant_memory,
        grant_compute=grant_compute,
        claim_memory_mib=claim_memory,
        claim_compute=claim_compute,
    )


def admit(
    shares: ShareModel,
    tally: ShareTally,
    added: Sequence[Share],
    *,
    ending: Iterable[Share] = (),
    problem: GpuProblem = healthy,
) -> GpuRefusal | None:
    """Whether the `added` shares may join the live ones (but those `ending`: the grants whose replicas they take
    over): every GPU they touch healthy, within MPS's client limit, its memory and its SMs. The first GPU that
    refuses, or None."""
    ending = tuple(ending)
    over = shares.clients_over_limit(tally, ending, added)
    if over:
        first = over[0]
        return GpuRefusal(
            kind=RefusalKind.CLIENTS,
            uuid=first.uuid,
            reason=f"GPU {first.uuid} would hold {first.grants} MPS clients (device-plugin grants and claims), but "
            f"MPS serves at most {first.limit}",
        )
    asked: dict[int, list[int]] = {}
    for share in added:
        for gpu in share.gpus:
            need = asked.setdefault(gpu.ordinal, [0, 0])
            need[0] += gpu.memory_mib
            need[1] += gpu.compute
    for share in ending:
        for gpu in share.gpus:
            if gpu.ordinal in asked:
                asked[gpu.ordinal][0] -= gpu.memory_mib
                asked[gpu.ordinal][1] -= gpu.compute
    for ordinal in sorted(asked):
        memory, compute = asked[ordinal]
        if memory <= 0 and compute <= 0:
            continue  # asks nothing more of it (the kubelet granting a container's IDs again, after a restart)
        refusal = _refusal(gpu_use(shares, tally, ordinal), memory, compute, problem)
        if refusal is not None:
            return refusal
    return None


def _refusal(use: GpuUse, memory_mib: int, compute: int, problem: GpuProblem) -> GpuRefusal | None:
    uuid = use.gpu.uuid
    unhealthy = problem(uuid)
    if unhealthy is not None:
        return GpuRefusal(kind=RefusalKind.UNHEALTHY, uuid=uuid, reason=f"GPU {uuid} is unhealthy ({unhealthy})")
    if memory_mib > use.free_memory_mib:
        return GpuRefusal(
            kind=RefusalKind.MEMORY,
            uuid=uuid,
            reason=f"GPU {uuid} has {use.free_memory_mib} MiB of its {use.gpu.memory_mib} MiB free ({use.held()}); "
            f"{memory_mib} MiB were asked",
        )
    if compute > use.free_compute:
        return GpuRefusal(
            kind=RefusalKind.COMPUTE,
            uuid=uuid,
            reason=f"GPU {uuid} has {use.free_compute} % of its SMs free ({use.held()}); {compute} % were asked",
        )
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaimCapacity:
    """What the ResourceSlice offers the claims of one GPU: its memory (MiB), SMs (per cent) and MPS clients less
    what the device-plugin grants hold (the scheduler counts the claims it allocated itself)."""

    memory_mib: int
    compute: int
    clients: int


def claim_capacity(shares: ShareModel, tally: ShareTally, ordinal: int) -> ClaimCapacity:
    use = gpu_use(shares, tally, ordinal)
    return ClaimCapacity(
        memory_mib=max(0, use.gpu.memory_mib - use.grant_memory_mib),
        compute=max(0, FULL_THREAD_PERCENTAGE - use.grant_compute),
        clients=max(0, use.gpu.max_clients - tally.clients(ordinal, Route.DEVICE_PLUGIN)),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Withheld:
    """Free device IDs of one GPU that ListAndWatch does not offer, since their share no longer fits beside what
    the claims (and the other grants) hold of the GPU."""

    uuid: GpuUuid
    replica_ids: tuple[ReplicaId, ...]
    reason: str


def withheld_replicas(
    shares: ShareModel, tally: ShareTally, ordinal: int, free_ids: Sequence[ReplicaId]
) -> Withheld | None:
    """Which of the GPU's `free_ids` (its IDs no live grant holds, in order) must not be offered: one ID's share is
    k=1's memory and SMs, and only as many as fit beside the live shares are offered, the first ones."""
    if not free_ids:
        return None
    use = gpu_use(shares, tally, ordinal)
    one = shares.share_of_one(ordinal)
    memory, compute = one.gpus[0].memory_mib, one.gpus[0].compute
    fit_memory = use.free_memory_mib // memory if memory else len(free_ids)
    fit_compute = use.free_compute // compute if compute else len(free_ids)
    offered = min(len(free_ids), fit_memory, fit_compute)
    if offered >= len(free_ids):
        return None
    return Withheld(
        uuid=use.gpu.uuid,
        replica_ids=tuple(free_ids[offered:]),
        reason=f"{use.free_memory_mib} MiB and {use.free_compute} % of its SMs are free ({use.held()}); one ID "
        f"needs {memory} MiB and {compute} %",
    )
