"""What `/metrics` reports, in Prometheus' format (prometheus_client).

The event loop only records: it observes Allocate latencies and publishes its status document (the same one
`--status` prints). Scrapes run in the HTTP server's threads and read the latest published document, so they
never touch the event loop's live structures; GPU processes are read from NVML by the scrape itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mpsagent.cgroups import PodContainer, pod_container
from mpsagent.devices import GpuUuid
from mpsagent.errors import GpuDiscoveryError
from mpsagent.gpu.port import GpuHealthSource
from mpsagent.logs import get_logger

log = get_logger(__name__)

ALLOCATE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class AgentMetrics:
    def __init__(self, *, gpus: tuple[GpuUuid, ...], gpu_source: GpuHealthSource | None, proc_root: Path) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.allocate_seconds = Histogram(
            "mpsagent_allocate_duration_seconds",
            "Time to answer the kubelet's Allocate, by resource",
            ["resource"],
            buckets=ALLOCATE_BUCKETS_S,
            registry=self.registry,
        )
        self.document: dict[str, Any] | None = None
        """The latest status document; the event loop replaces it whole, scrapes only read it."""
        self.registry.register(_StateCollector(self))
        if gpu_source is not None:
            self.registry.register(_GpuProcessCollector(gpus, gpu_source, proc_root))


class _StateCollector(Collector):
    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # the families depend on the state; describing none keeps registration cheap

    def collect(self) -> Iterator[Metric]:
        document = self._metrics.document
        if document is None:
            return
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
            "mpsagent_daemon_restarts", "MPS control daemon restarts after a failure", labels=["resource"]
        )
        cap_mode = GaugeMetricFamily(
            "mpsagent_daemon_cap_mode", "1 for the cap mode the daemon holds", labels=["resource", "mode"]
        )
        multi_user = GaugeMetricFamily(
            "mpsagent_daemon_multi_user",
            "1 when the daemon runs one MPS server for every user (-M), 0 when one per user",
            labels=["resource"],
        )
        cap_tamper = CounterMetricFamily(
            "mpsagent_cap_tamper",
            "Daemon values found changed behind the agent (and restored)",
            labels=["resource"],
        )
        registrations = CounterMetricFamily(
            "mpsagent_kubelet_registrations", "Successful registrations with the kubelet", labels=["resource"]
        )
        registered = GaugeMetricFamily(
            "mpsagent_kubelet_registered", "1 while registered with the kubelet", labels=["resource"]
        )
        for res in document["resources"]:
            name = res["name"]
            for gpu, counts in res["gpus"].items():
                replicas.add_metric([name, gpu, "Healthy"], counts["healthy"])
                replicas.add_metric([name, gpu, "Unhealthy"], counts["replicas"] - counts["healthy"])
            ledger = res["ledger"]
            for kind, count in ledger["allocated"].items():
                grants.add_metric([name, kind], count)
            for kind, count in ledger["live"].items():
                active.add_metric([name, kind], count)
            adopted.add_metric([name], ledger["adopted"])
            released.add_metric([name], ledger["released"])
            daemon = res["daemon"]
            daemon_up.add_metric([name], 1 if daemon["up"] else 0)
            restarts.add_metric([name], daemon["restarts"])
            for mode in ("full", "capped"):
                cap_mode.add_metric([name, mode], 1 if daemon["capMode"] == mode else 0)
            if daemon["multiUser"] is not None:
                multi_user.add_metric([name], 1 if daemon["multiUser"] else 0)
            cap_tamper.add_metric([name], daemon["capTamper"])
            registrations.add_metric([name], res["registrations"])
            registered.add_metric([name], 1 if res["registered"] else 0)
        pod_resources = GaugeMetricFamily(
            "mpsagent_pod_resources_up", "1 while the kubelet's pod-resources API answers"
        )
        pod_resources.add_metric([], 1 if document["podResources"]["available"] else 0)
        yield from (replicas, grants, adopted, released, active, daemon_up, restarts, cap_mode, multi_user, cap_tamper)
        yield from (registrations, registered, pod_resources)


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
