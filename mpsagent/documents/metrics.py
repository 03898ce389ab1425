"""What `/metrics` reports, in Prometheus' format (prometheus_client).

The event loop only records: it observes Allocate latencies and publishes its status document (the same one
`--status` prints). Scrapes run in the HTTP server's threads and read the latest published document, so they
never touch the event loop's live structures; GPU processes are read from NVML by the scrape itself.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, Info, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mpsagent import __version__
from mpsagent.base.cgroups import PodContainer, pod_container
from mpsagent.base.devices import GpuUuid
from mpsagent.base.errors import GpuDiscoveryError
from mpsagent.base.logs import get_logger
from mpsagent.base.values import MIB
from mpsagent.documents.status_document import CeilingsStatus, GpuStatus, StatusDocument
from mpsagent.gpu.port import GpuHealthSource

log = get_logger(__name__)

RPC_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
CAP_MODES = ("full", "capped")


class AgentMetrics:
    def __init__(
        self,
        *,
        starting: StatusDocument,
        gpus: tuple[GpuUuid, ...],
        gpu_source: GpuHealthSource | None,
        proc_root: Path,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        rpc_seconds = {
            rpc: Histogram(
                f"mpsagent_{rpc}_duration_seconds",
                f"Time to answer the kubelet's {title}, by resource and outcome (ok, refused, failed)",
                ["resource", "outcome"],
                buckets=RPC_BUCKETS_S,
                registry=self.registry,
            )
            for rpc, title in (("allocate", "Allocate"), ("preferred_allocation", "GetPreferredAllocation"))
        }
        self._rpc_seconds = rpc_seconds
        ProcessCollector(registry=self.registry)
        Info("mpsagent_build", "The running agent's version", registry=self.registry).info(
            {"version": __version__, "python": platform.python_version()}
        )
        self.document: StatusDocument = starting
        """The latest status document; the event loop replaces it whole, scrapes only read it. Until the first
        publish, every resource unregistered with its daemon down, so that every series exists from the start."""
        self.registry.register(_StateCollector(self))
        if gpu_source is not None:
            self.registry.register(_GpuProcessCollector(gpus, gpu_source, proc_root))

    def rpc_timer(self, resource: str) -> Callable[[str, float, str], None]:
        """What the servicer of `resource` calls with each timed RPC, its seconds and its outcome."""

        def observe(rpc: str, seconds: float, outcome: str) -> None:
            self._rpc_seconds[rpc].labels(resource, outcome).observe(seconds)

        return observe


class _StateCollector(Collector):
    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # the families depend on the state; describing none keeps registration cheap

    def collect(self) -> Iterator[Metric]:
        document = self._metrics.document
        replicas = GaugeMetricFamily(
            "mpsagent_replicas", "Advertised replicas by resource, GPU and health", labels=["resource", "gpu", "health"]
        )
        grants = CounterMetricFamily(
            "mpsagent_grants", "Grants made by Allocate, by kind (full, capped)", labels=["resource", "kind"]
        )
        adopted = CounterMetricFamily(
            "mpsagent_grants_adopted", "Grants learned from the kubelet's pod-resources listing", labels=["resource"]
        )
        released = CounterMetricFamily(
            "mpsagent_grants_released", "Grants released because their container is gone", labels=["resource"]
        )
        active = GaugeMetricFamily("mpsagent_active_grants", "Live grants in the ledger", labels=["resource", "kind"])
        daemon_up = GaugeMetricFamily(
            "mpsagent_daemon_up", "1 when the MPS control daemon answers", labels=["resource"]
        )
        restarts = CounterMetricFamily(
            "mpsagent_daemon_restarts",
            "MPS control daemon failures seen (exited or hung); each ended the daemon's clients",
            labels=["resource"],
        )
        restart_attempts = CounterMetricFamily(
            "mpsagent_daemon_restart_attempts",
            "Attempts to start a new MPS control daemon after a failure (a daemon that stays down keeps counting)",
            labels=["resource"],
        )
        cap_mode = GaugeMetricFamily(
            "mpsagent_daemon_cap_mode", "1 for the cap mode the daemon holds", labels=["resource", "mode"]
        )
        multi_user = GaugeMetricFamily(
            "mpsagent_daemon_multi_user",
            "1 when the daemon runs one MPS server for every user (-M), 0 when one per user",
            labels=["resource"],
        )
        busy = GaugeMetricFamily(
            "mpsagent_daemon_busy",
            "1 while another control session keeps the MPS control daemon busy (it lives; cap switches fail)",
            labels=["resource"],
        )
        busy_episodes = CounterMetricFamily(
            "mpsagent_daemon_busy_episodes",
            "Times another control session kept the MPS control daemon busy beyond the agent's bounded wait",
            labels=["resource"],
        )
        cap_tamper = CounterMetricFamily(
            "mpsagent_cap_tamper",
            "Daemon values found changed behind the agent (and restored)",
            labels=["resource"],
        )
        shares = _ShareFamilies()
        registrations = CounterMetricFamily(
            "mpsagent_kubelet_registrations", "Successful registrations with the kubelet", labels=["resource"]
        )
        registered = GaugeMetricFamily(
            "mpsagent_kubelet_registered", "1 while registered with the kubelet", labels=["resource"]
        )
        registration_failures = CounterMetricFamily(
            "mpsagent_kubelet_registration_failures", "Failed registrations with the kubelet", labels=["resource"]
        )
        for res in document.resources:
            name = res.name
            for gpu, counts in res.gpus.items():
                replicas.add_metric([name, gpu, "Healthy"], counts.healthy)
                replicas.add_metric([name, gpu, "Unhealthy"], counts.replicas - counts.healthy)
                shares.add_gpu(name, gpu, counts)
            ledger = res.ledger
            for kind in CAP_MODES:
                grants.add_metric([name, kind], ledger.allocated.get(kind, 0))
                active.add_metric([name, kind], ledger.live.get(kind, 0))
            adopted.add_metric([name], ledger.adopted)
            released.add_metric([name], ledger.released)
            daemon = res.daemon
            daemon_up.add_metric([name], 1 if daemon.up else 0)
            restarts.add_metric([name], daemon.restarts)
            restart_attempts.add_metric([name], daemon.restart_attempts)
            for mode in CAP_MODES:
                cap_mode.add_metric([name, mode], 1 if daemon.cap_mode == mode else 0)
            if daemon.multi_user is not None:
                multi_user.add_metric([name], 1 if daemon.multi_user else 0)
            cap_tamper.add_metric([name], daemon.cap_tamper)
            busy.add_metric([name], 0 if daemon.busy is None else 1)
            busy_episodes.add_metric([name], daemon.busy_episodes)
            shares.add_daemon(name, daemon.ceilings)
            registrations.add_metric([name], res.registrations)
            registered.add_metric([name], 1 if res.registered else 0)
            registration_failures.add_metric([name], res.registration_failures)
        pod_resources = GaugeMetricFamily(
            "mpsagent_pod_resources_up", "1 while the kubelet's pod-resources API answers"
        )
        pod_resources.add_metric([], 1 if document.pod_resources.available else 0)
        pod_resources_failures = CounterMetricFamily(
            "mpsagent_pod_resources_failures", "Failed pod-resources List calls"
        )
        pod_resources_failures.add_metric([], document.pod_resources.failures)
        yield from (replicas, grants, adopted, released, active, daemon_up, restarts, restart_attempts, cap_mode)
        yield from (multi_user, cap_tamper, busy, busy_episodes, registrations, registered, registration_failures)
        yield from shares.families()
        yield from (pod_resources, pod_resources_failures)


class _ShareFamilies:
    """The daemon's ceilings, live grants per GPU and the escape bound (see docs/cap-model.md)."""

    def __init__(self) -> None:
        self.thread_ceiling = GaugeMetricFamily(
            "mpsagent_daemon_thread_ceiling_percent",
            "The thread percentage the MPS daemon allows any client of the resource",
            labels=["resource"],
        )
        self.memory_ceiling = GaugeMetricFamily(
            "mpsagent_daemon_memory_ceiling_bytes",
            "The pinned memory the MPS daemon allows any client on the GPU",
            labels=["resource", "gpu"],
        )
        self.live_grants = GaugeMetricFamily(
            "mpsagent_gpu_live_grants",
            "Live grants (MPS clients) holding a share of the GPU",
            labels=["resource", "gpu"],
        )
        self.memory_escape = GaugeMetricFamily(
            "mpsagent_escape_memory_bytes",
            "Most memory beyond its own cap that a container on the GPU gets by unsetting its variables",
            labels=["resource", "gpu"],
        )
        self.thread_escape = GaugeMetricFamily(
            "mpsagent_escape_thread_percent",
            "Most thread percentage points beyond its own cap that a container on the GPU gets by unsetting them",
            labels=["resource", "gpu"],
        )

    def add_gpu(self, resource: str, gpu: str, status: GpuStatus) -> None:
        bound = status.bound()
        if bound is None:
            return
        self.memory_ceiling.add_metric([resource, gpu], bound.memory_ceiling_mib * MIB)
        self.live_grants.add_metric([resource, gpu], bound.live_grants)
        self.memory_escape.add_metric([resource, gpu], bound.memory_escape_mib * MIB)
        self.thread_escape.add_metric([resource, gpu], bound.thread_escape)

    def add_daemon(self, resource: str, ceilings: CeilingsStatus | None) -> None:
        if ceilings is not None:
            self.thread_ceiling.add_metric([resource], ceilings.thread_percentage)

    def families(self) -> tuple[Metric, ...]:
        return (self.thread_ceiling, self.memory_ceiling, self.live_grants, self.memory_escape, self.thread_escape)


class _GpuProcessCollector(Collector):
    """MPS clients per GPU, and GPU memory per container: NVML's process lists, each PID mapped to its pod and
    container through its cgroup. DCGM cannot attribute GPU use to containers under MPS; NVML's PIDs can."""

    def __init__(self, gpus: tuple[GpuUuid, ...], source: GpuHealthSource, proc_root: Path) -> None:
        self._gpus = gpus
        self._source = source
        self._proc_root = proc_root

    def describe(self) -> list[Metric]:
        return []

    def _container(self, pid: int) -> PodContainer | None:
        try:
            return pod_container((self._proc_root / str(pid) / "cgroup").read_text())
        except OSError:
            return None  # gone since NVML listed it, or not visible from here

    def collect(self) -> Iterator[Metric]:
        clients = GaugeMetricFamily("mpsagent_mps_clients", "MPS client processes on the GPU", labels=["gpu"])
        memory = GaugeMetricFamily(
            "mpsagent_container_gpu_memory_bytes",
            "GPU memory used by a container's processes",
            labels=["gpu", "pod_uid", "container_id"],
        )
        for gpu in self._gpus:
            try:
                processes = self._source.processes(gpu)
            except GpuDiscoveryError as exc:
                log.debug("gpu processes not read", gpu=gpu, reason=str(exc))
                continue
            clients.add_metric([gpu], sum(p.mps_client for p in processes))
            per_container: dict[PodContainer, int] = {}
            for process in processes:
                container = self._container(process.pid)
                if container is not None and process.used_bytes is not None:
                    per_container[container] = per_container.get(container, 0) + process.used_bytes
            for container, used in sorted(per_container.items()):
                memory.add_metric([gpu, container.pod_uid, container.container_id], used)
        yield clients
        yield memory
