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
from mpsagent.base import procfs
from mpsagent.base.cgroups import PodContainer, pod_container
from mpsagent.base.devices import GpuUuid
from mpsagent.base.errors import GpuDiscoveryError
from mpsagent.base.logs import get_logger
from mpsagent.base.metric_rows import MetricKind
from mpsagent.documents.status_document import STATUS_METRICS, StatusDocument
from mpsagent.gpu.port import GpuHealthSource, GpuProcess

log = get_logger(__name__)

RPC_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
PREPARE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""A prepare reads the claim from the API server and waits for the daemon: milliseconds to tens of them."""


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
        self._prepare_seconds = Histogram(
            "mpsagent_claim_prepare_duration_seconds",
            "Time to prepare one DRA claim for the kubelet (read it, hold its shares and ceilings, write its CDI "
            "spec and the checkpoint), by outcome (ok, refused)",
            ["outcome"],
            buckets=PREPARE_BUCKETS_S,
            registry=self.registry,
        )
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

    def claim_timer(self) -> Callable[[float, str], None]:
        """What the DRA claim server calls with each prepare's seconds and its outcome."""

        def observe(seconds: float, outcome: str) -> None:
            self._prepare_seconds.labels(outcome).observe(seconds)

        return observe


class _StateCollector(Collector):
    """Every family of `status_document.STATUS_METRICS`, read from the latest published document."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # the families depend on the state; describing none keeps registration cheap

    def collect(self) -> Iterator[Metric]:
        document = self._metrics.document
        for row in STATUS_METRICS:
            family = _FAMILIES[row.kind](row.name, row.help, labels=list(row.labels))
            for labels, value in row.samples(document):
                family.add_metric(list(labels), value)
            yield family


_FAMILIES: dict[MetricKind, type[GaugeMetricFamily | CounterMetricFamily]] = {
    "gauge": GaugeMetricFamily,
    "counter": CounterMetricFamily,
}


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
        text = procfs.cgroup_text(pid, self._proc_root)  # None: gone since NVML listed it, or not visible from here
        return None if text is None else pod_container(text)

    def collect(self) -> Iterator[Metric]:
        clients = GaugeMetricFamily("mpsagent_mps_clients", "MPS client processes on the GPU", labels=["gpu"])
        memory = GaugeMetricFamily(
            "mpsagent_container_gpu_memory_bytes",
            "GPU memory used by a container's processes",
            labels=["gpu", "pod_uid", "container_id"],
        )
        sm = GaugeMetricFamily(
            "mpsagent_container_gpu_sm_utilization_percent",
            "How busy a container's processes kept the GPU's SMs, per cent, in their latest NVML samples (where NVML "
            "samples processes)",
            labels=["gpu", "pod_uid", "container_id"],
        )
        for gpu in self._gpus:
            try:
                processes = self._source.processes(gpu)
            except GpuDiscoveryError as exc:
                log.debug("gpu processes not read", gpu=gpu, reason=str(exc))
                continue
            clients.add_metric([gpu], sum(p.mps_client for p in processes))
            per_container: dict[PodContainer, list[GpuProcess]] = {}
            for process in processes:
                container = self._container(process.pid)
                if container is not None:
                    per_container.setdefault(container, []).append(process)
            for container, held in sorted(per_container.items()):
                labels = [gpu, container.pod_uid, container.container_id]
                used = [p.used_bytes for p in held if p.used_bytes is not None]
                if used:
                    memory.add_metric(labels, sum(used))
                busy = [p.sm_percent for p in held if p.sm_percent is not None]
                if busy:
                    sm.add_metric(labels, min(100, sum(busy)))
        yield clients
        yield memory
        yield sm
