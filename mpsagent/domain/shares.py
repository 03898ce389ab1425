"""Shares: how much of each GPU a grant gets, the caps that say so, and the daemon ceilings of a set of live grants.

Pure and synchronous. The plan builds one `ShareModel` per resource; a container's grant (`container`), allocation,
the ledger, reconciliation, the daemon supervisor and keeper, `--once`, `--status` and metrics all ask it, so a
share is decided in one place.

A grant holding `k` of the `N` IDs of GPU `g` (replicas, or memory units) has the share `k/N` of `g`:
- memory cap on `g`: exactly `floor(bytes_g * k / N / MiB)` MiB (memory units: `floor(k * unit / MiB)`), never
  more than the GPU has; for `k = 1` the NVIDIA device plugin's own figure (`bytes / replicas / 1024 / 1024`);
- thread percentage: one value for all its GPUs (MPS has one per client), `max(1, floor(100 * min_g k/N))`
  (`100 // replicas` for one replica, as the NVIDIA plugin computes it);
- `k = N` on every GPU it holds: a whole-GPU (full) grant, with no cap variables at all.
Under `grants: equal` a grant of every ID of the resource is full and any other gets 1/replicas of every GPU.

The daemon's defaults are ceilings (a client's environment can lower its caps, never raise them): on each ordinal
the largest memory cap of the live grants holding it (full memory when none does), and for threads the largest
thread percentage of the resource's live grants (100 when there are none). A container that unsets its variables
gets at most the ceilings: that is the escape bound.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import assert_never

from mpsagent.base.devices import REPLICA_SEPARATOR, GpuUuid, ReplicaId
from mpsagent.base.values import MAX_CLIENTS_PER_GPU, MIB, GrantRule
from mpsagent.domain.grant_kind import GrantKind, describe_share

FULL_THREAD_PERCENTAGE = 100
MAX_KNOWN_SHARES = 4096
MAX_INDEX_DIGITS = 4
"""A GPU has at most 256 IDs (memory units; replicas 48): a longer index is none of the resource's."""


class Route(enum.StrEnum):
    """How a share was asked for: device-plugin replicas (an Allocate, or adopted from the kubelet's listing), or a
    DRA claim's consumed capacity (a prepare)."""

    DEVICE_PLUGIN = "device-plugin"
    CLAIM = "claim"


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSlots:
    """One GPU of a resource as shares see it: its daemon ordinal, memory and how many device IDs it has."""

    uuid: GpuUuid
    ordinal: int
    memory_bytes: int
    id_count: int
    max_clients: int = MAX_CLIENTS_PER_GPU

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes // MIB


@dataclass(frozen=True, kw_only=True, slots=True)
class Ceilings:
    """What the daemon's defaults hold: the hard ceilings of every client of the resource."""

    thread_percentage: int
    memory_mib: tuple[int, ...]
    """Pinned-memory limit per daemon ordinal (index = ordinal)."""

    def describe(self) -> str:
        memory = ",".join(f"{ordinal}={mib}M" for ordinal, mib in enumerate(self.memory_mib))
        return f"threads {self.thread_percentage}%, memory {memory}"


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuShare:
    """k of N IDs of one GPU, and the memory and compute that is (what it holds of the GPU, so that nothing else is
    given it: `accounting`)."""

    uuid: GpuUuid
    ordinal: int
    held: int
    of: int
    memory_mib: int
    compute: int
    """Per cent of the GPU's SMs it holds: k/N of them for replicas; what a claim consumed (0 when its threads follow
    its memory: a claim that asks no compute holds none)."""

    def describe(self) -> str:
        return f"{self.held}/{self.of} of GPU {self.ordinal}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Share:
    """What one grant gets: its share of each GPU it holds, and the caps (None for a full grant)."""

    gpus: tuple[GpuShare, ...]
    """The GPUs it holds, by ordinal."""
    kind: GrantKind
    thread_percentage: int
    """Its thread cap; 100 for a full grant."""
    container_memory_mib: tuple[int, ...]
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT of each GPU the container holds, in `gpus`' order (the daemon's, which is how
    the container's CUDA numbers the GPUs it sees: the k-th is its ordinal k); empty for a full grant. Never an entry
    for a GPU the container does not see: a client naming one drops every pinned limit (driver 615, measured by
    NVIDIA)."""
    bounds: tuple[tuple[int, int], ...]
    """(ordinal, MiB) it needs the daemon's ceilings to allow: its held GPUs (under `equal`, a capped grant's
    uniform value on every GPU of the resource, as the NVIDIA rule sets it)."""
    route: Route = Route.DEVICE_PLUGIN

    def memory_caps(self) -> tuple[tuple[GpuShare, int], ...]:
        """Each GPU it holds with its pinned-memory cap there, in `gpus`' order; none for a full grant."""
        return tuple(zip(self.gpus, self.container_memory_mib, strict=False))

    def memory_cap(self, ordinal: int) -> int | None:
        """Its pinned-memory cap on the daemon's GPU `ordinal`; None where it has none (a full grant, a GPU it
        does not hold)."""
        return next((mib for gpu, mib in self.memory_caps() if gpu.ordinal == ordinal), None)

    def memory_limit_env(self) -> str:
        """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT as the container gets it (`0=20389M`): one entry per GPU it holds, keyed
        by the ordinal the container sees; empty for a full grant."""
        return ",".join(f"{ordinal}={mib}M" for ordinal, mib in enumerate(self.container_memory_mib))

    def describe(self) -> str:
        """In words (`grant_kind.describe_share`): what it holds of each GPU (`1/4 of GPU 0`), then its kind's."""
        held = ", ".join(gpu.describe() for gpu in self.gpus)
        return describe_share(self.kind, held=held, thread_percentage=self.thread_percentage)


@dataclass(frozen=True, kw_only=True, slots=True)
class EscapeBound:
    """What a container holding a share of one GPU can get by unsetting its variables: the ceilings."""

    uuid: GpuUuid
    ordinal: int
    live_grants: int
    memory_ceiling_mib: int
    thread_ceiling: int
    memory_escape_mib: int
    """How much more memory than its own cap the smallest live share on the GPU can take (0: none can)."""
    thread_escape: int
    """How many more percentage points of threads than its own cap the smallest live share can take."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientLimit:
    """A GPU an Allocate would push past MPS's client limit."""

    uuid: GpuUuid
    ordinal: int
    grants: int
    limit: int


class ShareTally:
    """Live shares counted by what the ceilings and the client limit need, kept up to date as grants come and go
    (by the ledger), so that neither costs a pass over every live grant on each Allocate."""

    def __init__(self, shares: Iterable[Share] = ()) -> None:
        self._memory: dict[int, Counter[int]] = {}
        self._threads: Counter[int] = Counter()
        self._held: dict[Route, dict[int, list[int]]] = {route: {} for route in Route}
        """Per route and ordinal: [memory MiB, compute per cent, MPS clients] the live shares hold of the GPU."""
        self.changes = 0
        """Moves whenever a share is added or removed: what is worked out from the tally holds until it moves."""
        for share in shares:
            self.add(share)

    def add(self, share: Share) -> None:
        self.changes += 1
        for ordinal, mib in share.bounds:
            self._memory.setdefault(ordinal, Counter())[mib] += 1
        self._threads[share.thread_percentage] += 1
        held = self._held[share.route]
        for gpu in share.gpus:
            use = held.setdefault(gpu.ordinal, [0, 0, 0])
            use[0] += gpu.memory_mib
            use[1] += gpu.compute
            use[2] += 1

    def remove(self, share: Share) -> None:
        self.changes += 1
        for ordinal, mib in share.bounds:
            _take(self._memory[ordinal], mib)
        _take(self._threads, share.thread_percentage)
        held = self._held[share.route]
        for gpu in share.gpus:
            use = held[gpu.ordinal]
            use[0] -= gpu.memory_mib
            use[1] -= gpu.compute
            use[2] -= 1

    def clients(self, ordinal: int, route: Route | None = None) -> int:
        """The MPS clients the live shares of `route` (None: both) make of the GPU: one each."""
        return sum(use[2] for use in self._uses(ordinal, route))

    def held(self, ordinal: int, route: Route | None = None) -> tuple[int, int]:
        """The memory (MiB) and compute (per cent) the live shares of `route` (None: both) hold of the GPU."""
        uses = self._uses(ordinal, route)
        return sum(use[0] for use in uses), sum(use[1] for use in uses)

    def _uses(self, ordinal: int, route: Route | None) -> list[list[int]]:
        routes = tuple(Route) if route is None else (route,)
        return [self._held[r].get(ordinal, [0, 0, 0]) for r in routes]

    def largest_memory(self, ordinal: int) -> int | None:
        values = self._memory.get(ordinal)
        return max(values) if values else None

    def largest_thread(self) -> int | None:
        return max(self._threads) if self._threads else None


def _covers(share: Share, other: Share) -> bool:
    """Whether `share` asks the ceilings for at least what `other` does, and is a client of every GPU it is."""
    bounds = dict(share.bounds)
    return (
        share.thread_percentage >= other.thread_percentage
        and all(bounds.get(ordinal, -1) >= mib for ordinal, mib in other.bounds)
        and {gpu.ordinal for gpu in other.gpus} <= {gpu.ordinal for gpu in share.gpus}
    )


def _capped_mib(gpu: GpuSlots, mib: int) -> int:
    """A memory cap on `gpu`: the exact figure, never more than the GPU has."""
    return min(mib, gpu.memory_mib)


def _take(counter: Counter[int], key: int) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShareModel:
    """How one resource's device IDs turn into shares; built by the plan."""

    gpus: tuple[GpuSlots, ...]
    """By daemon ordinal."""
    rule: GrantRule
    unit_bytes: int | None
    """Memory per device ID for a memory-unit resource; None for replicas."""
    enforce: bool
    """Whether the daemon holds ceilings (`enforceCaps`); without, its defaults stay at the full hardware."""
    _by_uuid: dict[GpuUuid, GpuSlots] = field(init=False, compare=False, repr=False)
    _advertised: dict[str, GpuSlots] = field(init=False, compare=False, repr=False)
    _ordinal_of: dict[str, int] = field(init=False, compare=False, repr=False)
    _known_shares: dict[tuple[tuple[int, int], ...], Share] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_uuid", {gpu.uuid: gpu for gpu in self.gpus})
        # Every ID the resource advertises, to its GPU: an Allocate of a node's 768 IDs places each with one lookup.
        advertised = {f"{gpu.uuid}{REPLICA_SEPARATOR}{i}": gpu for gpu in self.gpus for i in range(gpu.id_count)}
        object.__setattr__(self, "_advertised", advertised)
        object.__setattr__(self, "_ordinal_of", {replica: gpu.ordinal for replica, gpu in advertised.items()})
        object.__setattr__(self, "_known_shares", {})

    @property
    def equal(self) -> bool:
        return self.rule is GrantRule.EQUAL and self.unit_bytes is None

    def _memory_mib(self, gpu: GpuSlots, held: int) -> int:
        """A share's memory on `gpu` (see `_capped_mib`)."""
        if self.unit_bytes is not None:
            return _capped_mib(gpu, held * self.unit_bytes // MIB)
        return _capped_mib(gpu, gpu.memory_bytes * held // gpu.id_count // MIB)

    def _place(self, replica: ReplicaId) -> tuple[GpuSlots | None, bool]:
        """The GPU of the resource an ID names (None: none), and whether the resource advertises the ID: its index is
        one of that GPU's, written as the agent writes it."""
        known = self._advertised.get(replica)
        if known is not None:
            return known, True
        uuid, separator, index = replica.rpartition(REPLICA_SEPARATOR)
        gpu = self._by_uuid.get(GpuUuid(uuid)) if separator else None
        if gpu is None:
            return None, False
        canonical = index.isascii() and index.isdigit() and len(index) <= MAX_INDEX_DIGITS and str(int(index)) == index
        return gpu, canonical and int(index) < gpu.id_count

    def _unplaced_key(self, replica_ids: Iterable[ReplicaId]) -> tuple[tuple[int, int], ...]:
        """The share key of IDs not all advertised: one ID of each of the resource's GPUs they name."""
        named = {gpu.ordinal for gpu, _ in map(self._place, replica_ids) if gpu is not None}
        return tuple((ordinal, 1) for ordinal in sorted(named))

    def ordinal_of(self, uuid: str) -> int | None:
        """The daemon ordinal of the resource's GPU with this UUID; None when the resource has no such GPU."""
        gpu = self._by_uuid.get(GpuUuid(uuid))
        return None if gpu is None else gpu.ordinal

    def advertises(self, replica: ReplicaId) -> bool:
        return self._place(replica)[1]

    def share_of(self, replica_ids: Iterable[ReplicaId], *, distinct: bool = False) -> Share:
        """The share of a grant of these IDs. A grant naming any ID the resource does not advertise (of a GPU outside
        it, or an index beyond its GPU's IDs: a grant of an older configuration, adopted from the kubelet) cannot be
        placed: it counts as the smallest share of the resource's GPUs it names (one ID of each; every GPU's smallest
        caps when it names none), so that it never lifts the ceilings nor counts for more than a GPU.

        `distinct`: a tuple of IDs the caller has deduplicated (an Allocate's checked request) is counted as given,
        without a pass of its own to deduplicate it."""
        unique = replica_ids if distinct and isinstance(replica_ids, tuple) else dict.fromkeys(replica_ids)
        # IDs the resource advertises: one lookup each (None for any other).
        counts: Counter[int | None] = Counter(map(self._ordinal_of.get, unique))
        if None in counts:
            key = self._unplaced_key(unique)
        else:
            key = tuple(sorted((ordinal, held) for ordinal, held in counts.items() if ordinal is not None))
        # Allocate asks this on every request, and a resource has few distinct shares: each is worked out once.
        share = self._known_shares.get(key)
        if share is None:
            if len(self._known_shares) >= MAX_KNOWN_SHARES:
                self._known_shares.clear()
            share = self._known_shares[key] = self._share(key)
        return share

    def share_of_one(self, ordinal: int) -> Share:
        """The share of one ID of the GPU: what each of its free IDs would take of it."""
        key = ((ordinal, 1),)
        share = self._known_shares.get(key)
        if share is None:
            share = self._known_shares[key] = self._share(key)
        return share

    def _share(self, counts: tuple[tuple[int, int], ...]) -> Share:
        held = tuple(
            GpuShare(
                uuid=self.gpus[ordinal].uuid,
                ordinal=ordinal,
                held=k,
                of=self.gpus[ordinal].id_count,
                memory_mib=self._memory_mib(self.gpus[ordinal], k),
                compute=min(FULL_THREAD_PERCENTAGE, FULL_THREAD_PERCENTAGE * k // self.gpus[ordinal].id_count),
            )
            for ordinal, k in counts
        )
        if self.equal or not held:
            # No GPU of the resource (IDs of an older configuration, adopted): every GPU's smallest caps.
            return self._equal_share(held)
        if all(share.held >= share.of for share in held):
            full_bounds = tuple((share.ordinal, self.gpus[share.ordinal].memory_mib) for share in held)
            return Share(
                gpus=held, kind=GrantKind.FULL, thread_percentage=100, container_memory_mib=(), bounds=full_bounds
            )
        thread = max(1, min(FULL_THREAD_PERCENTAGE * share.held // share.of for share in held))
        return Share(
            gpus=held,
            kind=GrantKind.CAPPED,
            thread_percentage=thread,
            container_memory_mib=tuple(share.memory_mib for share in held),
            bounds=tuple((share.ordinal, share.memory_mib) for share in held),
        )

    def capacity_share(self, ordinal: int, memory_mib: int, thread_percentage: int, *, compute: int = 0) -> Share:
        """The share of a DRA claim that consumed `memory_mib` of one GPU and `compute` per cent of its SMs, with
        `thread_percentage` for its threads (the compute, or in proportion to its memory when it asks none):
        capped at exactly that memory, whole when it is all of both."""
        gpu = self.gpus[ordinal]
        memory = max(1, min(memory_mib, gpu.memory_mib))
        threads = max(1, min(thread_percentage, FULL_THREAD_PERCENTAGE))
        held = (
            GpuShare(
                uuid=gpu.uuid,
                ordinal=ordinal,
                held=memory,
                of=gpu.memory_mib,
                memory_mib=memory,
                compute=max(0, min(compute, FULL_THREAD_PERCENTAGE)),
            ),
        )
        if memory >= gpu.memory_mib and threads >= FULL_THREAD_PERCENTAGE:
            bounds = ((ordinal, gpu.memory_mib),)
            return Share(
                gpus=held,
                kind=GrantKind.FULL,
                thread_percentage=100,
                container_memory_mib=(),
                bounds=bounds,
                route=Route.CLAIM,
            )
        return Share(
            gpus=held,
            kind=GrantKind.CAPPED,
            thread_percentage=threads,
            container_memory_mib=(memory,),
            bounds=((ordinal, memory),),
            route=Route.CLAIM,
        )

    def joined(self, shares: Sequence[Share]) -> Share:
        """The share of containers that hold some IDs together (the kubelet hands the IDs of a pod's init containers
        on to its later containers, and lists both): one that covers each of theirs and no more. The one among them
        that covers all the others, when there is one (the later container holds all of the earlier one's IDs, or a
        part of them); else on each GPU the largest of their memory caps, and the largest thread percentage."""
        for candidate in shares:
            if all(_covers(candidate, other) for other in shares):
                return candidate
        memory: dict[int, int] = {}
        held: dict[int, GpuShare] = {}
        for share in shares:
            for ordinal, mib in share.bounds:
                memory[ordinal] = max(mib, memory.get(ordinal, 0))
            for gpu in share.gpus:
                if gpu.ordinal not in held or gpu.held > held[gpu.ordinal].held:
                    held[gpu.ordinal] = gpu
        kind = GrantKind.FULL
        caps: tuple[int, ...] = ()
        for share in shares:
            match share.kind:
                case GrantKind.FULL:
                    pass
                case GrantKind.CAPPED:  # one capped container among them: the joined share is capped
                    kind, caps = GrantKind.CAPPED, tuple(memory[ordinal] for ordinal in sorted(held))
                case _:
                    assert_never(share.kind)
        return Share(
            gpus=tuple(held[ordinal] for ordinal in sorted(held)),
            kind=kind,
            thread_percentage=max(share.thread_percentage for share in shares),
            container_memory_mib=caps,
            bounds=tuple(sorted(memory.items())),
        )

    def _equal_share(self, held: tuple[GpuShare, ...]) -> Share:
        """The NVIDIA rule: every ID of the resource is a full grant; anything else 1/replicas of every GPU."""
        if held and sum(share.held for share in held) >= sum(gpu.id_count for gpu in self.gpus):
            bounds = tuple((gpu.ordinal, gpu.memory_mib) for gpu in self.gpus)
            return Share(gpus=held, kind=GrantKind.FULL, thread_percentage=100, container_memory_mib=(), bounds=bounds)
        smallest = self.smallest_caps()
        return Share(
            gpus=held,
            kind=GrantKind.CAPPED,
            thread_percentage=smallest.thread_percentage,
            container_memory_mib=tuple(smallest.memory_mib[share.ordinal] for share in held),
            bounds=tuple(enumerate(smallest.memory_mib)),
        )

    def full_hardware(self) -> Ceilings:
        return Ceilings(thread_percentage=FULL_THREAD_PERCENTAGE, memory_mib=tuple(g.memory_mib for g in self.gpus))

    def smallest_caps(self) -> Ceilings:
        """The caps of the smallest share: one ID of each GPU."""
        if self.equal:
            replicas = self.gpus[0].id_count
            return Ceilings(
                thread_percentage=FULL_THREAD_PERCENTAGE // replicas,
                memory_mib=tuple(_capped_mib(gpu, gpu.memory_bytes // replicas // MIB) for gpu in self.gpus),
            )
        return Ceilings(
            thread_percentage=max(1, min(FULL_THREAD_PERCENTAGE // gpu.id_count for gpu in self.gpus)),
            memory_mib=tuple(self._memory_mib(gpu, 1) for gpu in self.gpus),
        )

    def unreconciled_ceilings(self) -> Ceilings:
        """What a new daemon holds while the live grants are not known: the smallest share's caps, so that no
        container started before the agent escapes its caps (the first reconciliation or Allocate moves them)."""
        return self.smallest_caps() if self.enforce else self.full_hardware()

    def ceilings(self, live: Iterable[Share] | ShareTally) -> Ceilings:
        """The daemon ceilings these live grants need."""
        full = self.full_hardware()
        if not self.enforce:
            return full
        tally = live if isinstance(live, ShareTally) else ShareTally(live)
        return Ceilings(
            thread_percentage=tally.largest_thread() or FULL_THREAD_PERCENTAGE,
            memory_mib=tuple(
                mib if (mib := tally.largest_memory(ordinal)) is not None else whole
                for ordinal, whole in enumerate(full.memory_mib)
            ),
        )

    def escape_bounds(self, ceilings: Ceilings, live: Sequence[Share]) -> tuple[EscapeBound, ...]:
        """Per GPU: its live grants, the ceilings, and how far its smallest live share can exceed its caps."""
        by_ordinal: dict[int, list[Share]] = {gpu.ordinal: [] for gpu in self.gpus}
        for share in live:  # one pass: a node's hundreds of grants, each on one GPU or a few
            for ordinal in {held.ordinal for held in share.gpus}:
                if ordinal in by_ordinal:
                    by_ordinal[ordinal].append(share)
        bounds = []
        for gpu in self.gpus:
            on_gpu = by_ordinal[gpu.ordinal]
            memory_ceiling = ceilings.memory_mib[gpu.ordinal]
            own_memory = [self._cap_on(share, gpu.ordinal) for share in on_gpu]
            bounds.append(
                EscapeBound(
                    uuid=gpu.uuid,
                    ordinal=gpu.ordinal,
                    live_grants=len(on_gpu),
                    memory_ceiling_mib=memory_ceiling,
                    thread_ceiling=ceilings.thread_percentage,
                    memory_escape_mib=max(0, memory_ceiling - min(own_memory)) if own_memory else 0,
                    thread_escape=max(0, ceilings.thread_percentage - min(s.thread_percentage for s in on_gpu))
                    if on_gpu
                    else 0,
                )
            )
        return tuple(bounds)

    def _cap_on(self, share: Share, ordinal: int) -> int:
        cap = share.memory_cap(ordinal)
        return self.gpus[ordinal].memory_mib if cap is None else cap

    def clients_over_limit(
        self, live: ShareTally, ending: Iterable[Share], added: Iterable[Share]
    ) -> tuple[ClientLimit, ...]:
        """The GPUs that `added` grants would push past MPS's client limit, with the `live` ones but those `ending`
        (the grants whose replicas they take)."""
        # Every Allocate asks (a full grant's shares hold every GPU): plain loops over a dict.
        change: dict[int, int] = {}
        for share in ending:
            for held in share.gpus:
                change[held.ordinal] = change.get(held.ordinal, 0) - 1
        touched: set[int] = set()
        for share in added:
            for held in share.gpus:
                change[held.ordinal] = change.get(held.ordinal, 0) + 1
                touched.add(held.ordinal)
        over = []
        for ordinal in sorted(touched):
            gpu = self.gpus[ordinal]
            count = live.clients(ordinal) + change[ordinal]
            if count > gpu.max_clients:
                over.append(ClientLimit(uuid=gpu.uuid, ordinal=ordinal, grants=count, limit=gpu.max_clients))
        return tuple(over)

    def full_gpus(self, live: ShareTally) -> frozenset[GpuUuid]:
        """GPUs at MPS's client limit."""
        return frozenset(gpu.uuid for gpu in self.gpus if live.clients(gpu.ordinal) >= gpu.max_clients)
