"""The HTTP endpoint through a real TCP socket: probes, Prometheus metrics, and GPU memory per container from
NVML's process lists (the fake NVML) mapped through a fake /proc tree."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mpsagent import __version__
from mpsagent_testing.agents import AgentLauncher, serve, start
from mpsagent_testing.kubelet.calls import allocate, preferred
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.metrics import get, samples, value
from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.node import GPU0, GPU1, RESOURCE, config, ids, write_config
from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.nvml.control import FakeNvmlDriver
from mpsagent_testing.repo import ROOT

require_real_control()  # the agents these tests start run the real MPS control daemon


def test_probes_follow_registration_and_metrics_follow_the_ledger(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    kubelet.stop()
    agent, base = serve(agents, kubelet, short_dir)
    assert get(base + "/healthz")[0] == 200
    wait_for(lambda: get(base + "/readyz") == (503, "nvidia.com/gpu: not registered with the kubelet\n"), 5, "503")
    wait_for(
        lambda: (value(base, "mpsagent_kubelet_registration_failures_total", resource=RESOURCE) or 0) >= 1,
        5,
        "a failed registration counted",
    )
    kubelet.start()
    plugin = kubelet.wait_registered(RESOURCE)
    wait_for(lambda: get(base + "/readyz") == (200, "ready\n"), 5, "ready")
    assert get(base + "/nothing")[0] == 404

    allocate(plugin, ids(GPU0, 1))
    wait_for(lambda: value(base, "mpsagent_active_grants", resource=RESOURCE, kind="capped") == 1, 5, "a live grant")
    assert value(base, "mpsagent_active_grants", resource=RESOURCE, kind="full") == 0
    assert value(base, "mpsagent_grants_total", resource=RESOURCE, kind="capped") == 1
    assert value(base, "mpsagent_grants_total", resource=RESOURCE, kind="full") == 0
    assert value(base, "mpsagent_allocate_duration_seconds_count", resource=RESOURCE, outcome="ok") == 1
    with pytest.raises(grpc.RpcError):
        allocate(plugin, ["GPU-nonsense::0"])
    preferred(plugin, ids(GPU0, 0, 2), 1)
    # A scrape shows the state of the last publish (every 0.5 s): rendered once per publish, not per scrape.
    wait_for(
        lambda: value(base, "mpsagent_allocate_duration_seconds_count", resource=RESOURCE, outcome="refused") == 1,
        5,
        "the refused Allocate timed",
    )
    assert value(base, "mpsagent_preferred_allocation_duration_seconds_count", resource=RESOURCE, outcome="ok") == 1
    assert value(base, "mpsagent_daemon_restart_attempts_total", resource=RESOURCE) == 0
    assert value(base, "mpsagent_pod_resources_failures_total") == 0
    assert (value(base, "process_resident_memory_bytes") or 0) > 0
    assert value(base, "mpsagent_build_info", version=__version__, python=platform.python_version()) == 1
    assert value(base, "mpsagent_replicas", resource=RESOURCE, gpu=GPU0, health="Healthy") == 4
    assert value(base, "mpsagent_replicas", resource=RESOURCE, gpu=GPU0, health="Unhealthy") == 0
    assert value(base, "mpsagent_daemon_up", resource=RESOURCE) == 1
    assert value(base, "mpsagent_daemon_cap_mode", resource=RESOURCE, mode="capped") == 1
    # 1/4 of GPU 0 is the only live grant: its ceilings, and no escape beyond them.
    assert value(base, "mpsagent_daemon_thread_ceiling_percent", resource=RESOURCE) == 25
    # Exactly a quarter of 16 GiB (docs/cap-model.md).
    assert value(base, "mpsagent_daemon_memory_ceiling_bytes", resource=RESOURCE, gpu=GPU0) == 4096 * 1024**2
    assert value(base, "mpsagent_daemon_memory_ceiling_bytes", resource=RESOURCE, gpu=GPU1) == 16 * 1024**3
    assert value(base, "mpsagent_gpu_live_grants", resource=RESOURCE, gpu=GPU0) == 1
    assert value(base, "mpsagent_escape_memory_bytes", resource=RESOURCE, gpu=GPU0) == 0
    assert value(base, "mpsagent_escape_thread_percent", resource=RESOURCE, gpu=GPU0) == 0
    assert value(base, "mpsagent_daemon_restarts_total", resource=RESOURCE) == 0
    assert value(base, "mpsagent_kubelet_registrations_total", resource=RESOURCE) == 1
    assert value(base, "mpsagent_kubelet_registered", resource=RESOURCE) == 1
    assert value(base, "mpsagent_pod_resources_up") == 1
    assert agent.stop() == 0


def test_gpu_memory_per_container_and_mps_clients_per_gpu(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fake_nvml_library: Path
) -> None:
    gpu_a, gpu_b = "GPU-aaaaaaaa-1111-2222-3333-444444444444", "GPU-bbbbbbbb-1111-2222-3333-444444444444"
    nvml = short_dir / "nvml.json"
    nvml.write_text(
        json.dumps(
            {
                "gpus": [
                    {"uuid": gpu_a, "memoryTotal": 17179869184, "major": 7, "minor": 5},
                    # A GPU whose driver does not sample processes: memory per container, no SM utilization.
                    {"uuid": gpu_b, "memoryTotal": 17179869184, "major": 7, "minor": 5, "processUtilizationError": 3},
                ]
            }
        )
    )
    driver = FakeNvmlDriver(short_dir / "nvml-state.json")
    pod = "0f3e9b1c-6a2d-4c8e-9f10-2b3c4d5e6f70"
    train, serve_c = "a" * 64, "b" * 64
    proc = short_dir / "proc"
    cgroups = {
        101: f"0::/kubepods.slice/kubepods-pod{pod.replace('-', '_')}.slice/cri-containerd-{train}.scope\n",
        102: f"0::/kubepods.slice/kubepods-pod{pod.replace('-', '_')}.slice/cri-containerd-{train}.scope\n",
        103: f"0::/kubepods/besteffort/pod{pod}/{serve_c}\n",
        200: "0::/system.slice/nvidia-mps.service\n",  # the MPS server: not a container
    }
    for pid, text in cgroups.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(text)
    driver.set_processes(gpu_a, [(200, 300 << 20)])
    driver.set_processes(gpu_a, [(101, 1 << 30), (102, 512 << 20), (103, 256 << 20), (999, 64 << 20)], mps=True)
    driver.set_process_utilization(gpu_a, [(101, 30), (102, 25)])  # 103 ran no kernel lately: no sample, idle
    driver.set_processes(gpu_b, [(103, 128 << 20)], mps=True)
    driver.set_process_utilization(gpu_b, [(103, 50)])
    env = fake_nvml_env(fake_nvml_library, nvml, driver.state_path)
    _, base = serve(agents, kubelet, short_dir, "--proc-root", str(proc), env=env, nvml=True)
    kubelet.wait_registered(RESOURCE)

    memory = {
        (dict(labels)["gpu"], dict(labels)["container_id"]): v
        for (name, labels), v in samples(base).items()
        if name == "mpsagent_container_gpu_memory_bytes"
    }
    assert memory == {(gpu_a, train): (1 << 30) + (512 << 20), (gpu_a, serve_c): 256 << 20, (gpu_b, serve_c): 128 << 20}
    sm = {
        (dict(labels)["gpu"], dict(labels)["container_id"]): v
        for (name, labels), v in samples(base).items()
        if name == "mpsagent_container_gpu_sm_utilization_percent"
    }
    assert sm == {(gpu_a, train): 55, (gpu_a, serve_c): 0}
    assert value(base, "mpsagent_container_gpu_memory_bytes", gpu=gpu_a, pod_uid=pod, container_id=train) > 0
    assert value(base, "mpsagent_mps_clients", gpu=gpu_a) == 4
    assert value(base, "mpsagent_mps_clients", gpu=gpu_b) == 1


def test_a_bad_metrics_address_is_refused_and_a_busy_port_stops_the_start(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    cfg = write_config(short_dir / "config.yaml", config())
    refused = subprocess.run(
        [sys.executable, "-m", "mpsagent", "--config-file", str(cfg), "--metrics-address", "9402", "--once"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    assert refused.returncode == 2
    assert "--metrics-address" in refused.stderr and "`9402`" in refused.stderr

    first, base = serve(agents, kubelet, short_dir)
    port = base.rpartition(":")[2]
    first.stop()
    holder = start(agents, kubelet, short_dir, "--metrics-address", f"127.0.0.1:{port}")
    holder.wait_log("http endpoint serving")
    (short_dir / "other-node").mkdir()  # another kubelet: on the same one, the node guard would refuse it first
    second = agents.start(
        "--config-file",
        str(cfg),
        "--node-snapshot",
        str(short_dir / "node.json"),
        "--metrics-address",
        f"127.0.0.1:{port}",
        "--mps-root",
        str(short_dir / "other"),
        "--kubelet-socket",
        str(short_dir / "other-node" / "kubelet.sock"),
    )
    assert second.process.wait(30) == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in second.log()


def test_every_state_series_and_readiness_line_exists_before_the_first_publish() -> None:
    """Alerts on `mpsagent_daemon_up == 0` or `mpsagent_kubelet_registered == 0` must fire for an agent that never
    got as far as publishing its state: the series exist, at 0, from the first scrape."""
    from mpsagent.documents.metrics import AgentMetrics  # noqa: PLC0415
    from mpsagent.documents.status import readiness_problems, starting_document  # noqa: PLC0415

    starting = starting_document(["nvidia.com/gpu", "nvidia.com/gpu-b"])
    metrics = AgentMetrics(starting=starting, gpus=(), gpu_source=None, proc_root=Path("/proc"))
    from prometheus_client import generate_latest  # noqa: PLC0415

    scraped = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    for resource in ("nvidia.com/gpu", "nvidia.com/gpu-b"):
        for name in ("mpsagent_daemon_up", "mpsagent_kubelet_registered", "mpsagent_daemon_restart_attempts_total"):
            assert scraped[(name, (("resource", resource),))] == 0
    assert scraped[("mpsagent_pod_resources_up", ())] == 0
    assert readiness_problems(starting) == [
        "nvidia.com/gpu: not registered with the kubelet",
        "nvidia.com/gpu: mps daemon down",
        "nvidia.com/gpu-b: not registered with the kubelet",
        "nvidia.com/gpu-b: mps daemon down",
    ]
