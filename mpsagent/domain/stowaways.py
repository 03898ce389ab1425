"""Stowaways: processes on a GPU the agent serves whose pod holds no grant or claim on that GPU (a privileged pod
with the MPS pipe mounted, a process on the host). Plain decisions on plain data; the stowaway watch
(`supervisor.stowaway_watch`) reads NVML's process lists and `/proc`, and asks here.

Who may use a GPU is decided per pod: a pod whose container holds a device-plugin grant on the GPU (its owner, as the
kubelet's pod-resources listing names it), or a pod a prepared claim with a share of the GPU is reserved for. The
pod, not the container: the kubelet lists a grant under the last of the containers that share its IDs (an init
container's are handed on), and a claim goes to the containers that name it, which no listing shows.

A process is judged only once its pod is known by name, and only while every grant on its GPU has a known owner: a
container allocated a moment ago is listed within a second or two, and its first process must not be called a
stowaway meanwhile. The MPS servers, children of the daemons the agent runs, are nobody's stowaways.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from mpsagent.base.bounded import Count
from mpsagent.base.cgroups import short_id
from mpsagent.base.devices import ContainerRef, GpuUuid
from mpsagent.domain.claims import PreparedClaim
from mpsagent.domain.ledger import Grant


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuUsers:
    """Who may use one GPU."""

    pods: frozenset[str] = frozenset()
    """`namespace/name` of each pod holding a grant or a claim's share of the GPU."""
    unlisted_grants: int = 0
    """Device-plugin grants of the GPU whose container the kubelet has not listed yet."""
    claims: frozenset[str] = frozenset()
    """The UIDs of the prepared claims with a share of the GPU: a pod that shares a claim prepared for another is
    never told to the driver (the kubelet prepares a claim once per node), so their pods are read again before a
    process of an unknown pod is called a stowaway."""


def gpu_users(grants: Iterable[Grant], claims: Iterable[PreparedClaim]) -> dict[GpuUuid, GpuUsers]:
    """Each GPU's users, from the ledgers' live grants (their claim grants left to `claims`) and the prepared
    claims; a GPU no one holds is absent."""
    pods: dict[GpuUuid, set[str]] = {}
    unlisted: dict[GpuUuid, int] = {}
    claim_uids: dict[GpuUuid, set[str]] = {}
    for grant in grants:
        if grant.claim is not None:
            continue
        owner = grant.owner
        for held in grant.share.gpus:
            if owner is None:
                unlisted[held.uuid] = unlisted.get(held.uuid, 0) + 1
            else:
                pods.setdefault(held.uuid, set()).add(f"{owner.namespace}/{owner.pod}")
    for claim in claims:
        for device in claim.devices:
            pods.setdefault(GpuUuid(device.gpu), set()).update(claim.pods)
            claim_uids.setdefault(GpuUuid(device.gpu), set()).add(claim.claim.uid)
    return {
        uuid: GpuUsers(
            pods=frozenset(pods.get(uuid, ())),
            unlisted_grants=unlisted.get(uuid, 0),
            claims=frozenset(claim_uids.get(uuid, ())),
        )
        for uuid in pods.keys() | unlisted.keys() | claim_uids.keys()
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class SeenProcess:
    """A process on a GPU, with what `/proc` and the kubelet say about where it runs."""

    gpu: GpuUuid
    pid: int
    used_bytes: int | None
    ancestors: tuple[int, ...] = ()
    pod_uid: str | None = None
    """From its cgroup path, or the kubelet's link of its container (a node whose cgroup paths name no pod); None:
    not in a pod (a process on the host, or in a container the kubelet did not start)."""
    container_id: str | None = None
    """The runtime's ID of its container; None: a process on the host."""
    container: ContainerRef | None = None
    """Its pod's and container's names, from the kubelet's container log links; None: the kubelet has none for it."""


class Stowaway(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A process on a GPU whose pod holds no grant or claim on it, as `--status` shows it."""

    gpu: str
    pid: int
    used_bytes: int | None = None
    pod_uid: str | None = None
    """None: not in a pod."""
    container_id: str | None = None
    """None: a process on the host."""
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    """The pod's and container's names; None where the kubelet names no container of that ID (a container it did not
    start)."""
    seen_at: str
    """When the agent first saw it (UTC)."""

    def describe(self) -> str:
        if self.container_id is None:
            return f"PID {self.pid}, a process on the host"
        if self.pod_uid is None:
            return f"PID {self.pid} in container {short_id(self.container_id)}, of no pod"
        if self.pod is None:
            return f"PID {self.pid} in pod {self.pod_uid}, container {short_id(self.container_id or '')}"
        return f"PID {self.pid} in pod {self.namespace}/{self.pod} (container {self.container})"


class StowawayStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What the stowaway watch last found, for `--status` and the metrics."""

    stowaways: tuple[Stowaway, ...] = ()
    found: Count = 0
    """Stowaways found since the start (each process on each GPU once)."""
    unchecked: str | None = None
    """Why processes in pods cannot be judged now (the kubelet's container names unreadable); None while they can."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Judgement:
    """One look at the GPUs' processes."""

    stowaways: tuple[SeenProcess, ...] = ()
    undecided: tuple[SeenProcess, ...] = ()
    """Processes in pods that cannot be judged yet (a grant on their GPU not listed yet, no names readable)."""
    servers: tuple[SeenProcess, ...] = ()
    """The MPS servers of the agent's daemons."""


def judge(
    processes: Sequence[SeenProcess],
    users: Mapping[GpuUuid, GpuUsers],
    *,
    daemon_pids: frozenset[int],
    names_readable: bool,
) -> Judgement:
    """Which of `processes` are stowaways. `daemon_pids`: the MPS control daemons the agent runs (their children
    are the servers); `names_readable`: False when the kubelet's container names could not be read at all."""
    stowaways: list[SeenProcess] = []
    undecided: list[SeenProcess] = []
    servers: list[SeenProcess] = []
    nobody = GpuUsers()
    for process in processes:
        gpu_users_now = users.get(process.gpu, nobody)
        if daemon_pids.intersection(process.ancestors):
            servers.append(process)
        elif process.pod_uid is None:
            stowaways.append(process)
        elif not names_readable or gpu_users_now.unlisted_grants:
            undecided.append(process)
        elif process.container is None:
            stowaways.append(process)  # every container the kubelet starts has its log link before it runs
        elif f"{process.container.namespace}/{process.container.pod}" not in gpu_users_now.pods:
            stowaways.append(process)
    return Judgement(stowaways=tuple(stowaways), undecided=tuple(undecided), servers=tuple(servers))
