"""The stowaway watch: every probe interval, each GPU's processes from NVML, each placed in its pod through its cgroup
(`/proc`) and named through the kubelet's container log links, judged against the live grants and prepared claims
(`domain.stowaways`). A stowaway is logged once as a warning naming its pod, counted, and shown in `--status` and the
metrics until it ends. The supervisor owns it as one task; its reads run off the event loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import anyio

from mpsagent.base import procfs
from mpsagent.base.cgroups import container_id, pod_container
from mpsagent.base.clock import utc
from mpsagent.base.devices import GpuUuid
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import GpuDiscoveryError
from mpsagent.base.host import os_reason
from mpsagent.base.logs import get_logger
from mpsagent.domain.claims import PreparedClaim
from mpsagent.domain.ledger import Grant
from mpsagent.domain.stowaways import Judgement, SeenProcess, Stowaway, StowawayStatus, gpu_users, judge
from mpsagent.gpu.port import GpuHealthSource, GpuProcess
from mpsagent.kubelet.container_logs import NamedContainer, container_names

log = get_logger(__name__)

FOUND_EVENT = "process on a gpu without a grant or claim there"
FOUND_HINT = (
    "its pod holds no share of this GPU, so no cap the agent set is its: delete the pod, or give it a grant or a claim "
    "(a pod must not mount the MPS pipe directory itself)"
)


class StowawayWatch:
    def __init__(
        self,
        *,
        gpus: Sequence[GpuUuid],
        source: GpuHealthSource,
        proc_root: Path,
        container_logs_dir: Path,
        interval_s: float,
        grants: Callable[[], Iterable[Grant]],
        daemon_pids: Callable[[], frozenset[int]],
        claims: Callable[[], Iterable[PreparedClaim]] = tuple,
        read_claim_pods: Callable[[Iterable[str]], Awaitable[None]] | None = None,
    ) -> None:
        """`grants`: every resource's live grants; `daemon_pids`: the MPS control daemons' PIDs; `claims`: the
        prepared claims, and `read_claim_pods` the DRA driver's `read_pods_again` (an awaitable), with --dra on."""
        self._gpus = tuple(gpus)
        self._source = source
        self._proc_root = proc_root
        self._logs_dir = container_logs_dir
        self._interval = interval_s
        self._grants = grants
        self._daemon_pids = daemon_pids
        self._claims = claims
        self._read_claim_pods = read_claim_pods
        self._known: dict[tuple[str, int, str | None], Stowaway] = {}
        self._found = 0
        self._names = FailureEpisodes(
            log,
            failed="processes in pods on the gpus not judged: the kubelet's container names cannot be read",
            again="processes in pods on the gpus judged again",
            level="warning",
            hint="mount the host's /var/log/containers (read-only) where --container-logs-dir says",
        )
        self.status = StowawayStatus()

    async def run(self) -> None:
        """A look every interval, until cancelled."""
        while True:
            await self.look()
            await anyio.sleep(self._interval)

    async def look(self) -> None:
        """Judge every GPU process once; log the stowaways not seen before, forget those that ended."""
        seen, unread, names_problem = await anyio.to_thread.run_sync(self._read)
        judgement = self._judge(seen, names_problem)
        new_in_pods = [p for p in judgement.stowaways if p.pod_uid is not None and _key(p) not in self._known]
        claim_uids = self._claims_to_read(new_in_pods)
        if claim_uids and self._read_claim_pods is not None:
            await self._read_claim_pods(claim_uids)
            judgement = self._judge(seen, names_problem)
        self._update(judgement, unread, names_problem)

    def _judge(self, seen: Sequence[SeenProcess], names_problem: str | None) -> Judgement:
        users = gpu_users(self._grants(), self._claims())
        return judge(seen, users, daemon_pids=self._daemon_pids(), names_readable=names_problem is None)

    def _claims_to_read(self, processes: Sequence[SeenProcess]) -> set[str]:
        gpus = {p.gpu for p in processes}
        return {
            claim.claim.uid for claim in self._claims() if any(GpuUuid(device.gpu) in gpus for device in claim.devices)
        }

    def _read(self) -> tuple[list[SeenProcess], frozenset[GpuUuid], str | None]:
        """Each GPU's processes, placed (blocking); the GPUs NVML could not list; why names cannot be read."""
        seen: list[SeenProcess] = []
        unread: set[GpuUuid] = set()
        names = _Names(self._logs_dir)
        for gpu in self._gpus:
            try:
                processes = self._source.processes(gpu)
            except GpuDiscoveryError as exc:
                log.debug("gpu processes not read", gpu=gpu, reason=str(exc))
                unread.add(gpu)
                continue
            for process in processes:
                placed = self._place(gpu, process, names)
                if placed is not None:
                    seen.append(placed)
        return seen, frozenset(unread), names.problem()

    def _place(self, gpu: GpuUuid, process: GpuProcess, names: _Names) -> SeenProcess | None:
        """Where the process runs; None when it ended since NVML listed it."""
        text = procfs.cgroup_text(process.pid, self._proc_root)
        if text is None:
            return None
        place = pod_container(text)
        container = place.container_id if place is not None else container_id(text)
        named = None if container is None else names.get(container)
        if named is not None and place is not None and named.pod_uid != place.pod_uid:
            named = None  # the link is another pod's: not this container's name
        return SeenProcess(
            gpu=gpu,
            pid=process.pid,
            used_bytes=process.used_bytes,
            ancestors=tuple(procfs.ancestors(process.pid, self._proc_root)),
            pod_uid=place.pod_uid if place is not None else None if named is None else named.pod_uid,
            container_id=container,
            container=None if named is None else named.ref,
        )

    def _update(self, judgement: Judgement, unread: frozenset[GpuUuid], names_problem: str | None) -> None:
        if names_problem is None:
            self._names.works()
        else:
            self._names.failed(names_problem)
        now: dict[tuple[str, int, str | None], Stowaway] = {
            key: stowaway for key, stowaway in self._known.items() if stowaway.gpu in unread
        }  # a GPU NVML could not list this time keeps what it had
        for process in judgement.stowaways:
            key = _key(process)
            known = self._known.get(key)
            now[key] = known if known is not None else self._found_one(process)
        for key, stowaway in self._known.items():
            if key not in now:
                log.info("process on a gpu without a grant or claim there ended", gpu=stowaway.gpu, pid=stowaway.pid)
        self._known = now
        self.status = StowawayStatus(
            stowaways=tuple(sorted(now.values(), key=lambda s: (s.gpu, s.pid))),
            found=self._found,
            unchecked=names_problem,
        )

    def _found_one(self, process: SeenProcess) -> Stowaway:
        ref = process.container
        stowaway = Stowaway(
            gpu=process.gpu,
            pid=process.pid,
            used_bytes=process.used_bytes,
            pod_uid=process.pod_uid,
            container_id=process.container_id,
            namespace=None if ref is None else ref.namespace,
            pod=None if ref is None else ref.pod,
            container=None if ref is None else ref.container,
            seen_at=utc(time.time()),
        )
        self._found += 1
        log.warning(
            FOUND_EVENT,
            gpu=stowaway.gpu,
            process=stowaway.describe(),
            pid=stowaway.pid,
            pod=None if ref is None else f"{ref.namespace}/{ref.pod}",
            pod_uid=stowaway.pod_uid,
            container=stowaway.container,
            container_id=stowaway.container_id,
            used_bytes=stowaway.used_bytes,
            hint=FOUND_HINT,
        )
        return stowaway


def _key(process: SeenProcess) -> tuple[str, int, str | None]:
    """A process on a GPU; the container ID tells a reused PID apart."""
    return (process.gpu, process.pid, process.container_id)


class _Names:
    """The kubelet's container names for one look: read once, and only when a process runs in a container."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._found: dict[str, NamedContainer] | None = None
        self._problem: str | None = None

    def get(self, container: str) -> NamedContainer | None:
        if self._found is None:
            try:
                self._found = container_names(self._directory)
            except OSError as exc:
                self._found = {}
                self._problem = f"{self._directory}: {os_reason(exc)}"
        return self._found.get(container)

    def problem(self) -> str | None:
        """Why the names cannot be read; asked of the directory even when no process needed them, so that a missing
        mount shows at once, not with the first process in a pod."""
        if self._found is None:
            try:
                with os.scandir(self._directory):
                    pass
            except OSError as exc:
                return f"{self._directory}: {os_reason(exc)}"
        return self._problem
