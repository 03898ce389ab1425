"""The agent on the e2e node as the systemd unit runs it: a host process with the kubelet's standard sockets, its
GPUs from the fake NVML library (driven from outside through `FakeNvmlDriver`) and the real
`nvidia-cuda-mps-control`; its MPS root under the node's run directory, so `down` removes it."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any

from mpsagent_testing.agents import AgentProcess, spawn_agent, status_of
from mpsagent_testing.cluster import kubectl
from mpsagent_testing.cluster.layout import KUBECONFIG, RUN
from mpsagent_testing.nvml.build import build_fake_nvml, fake_nvml_env
from mpsagent_testing.nvml.control import CgroupLayout, FakeNvmlDriver
from mpsagent_testing.processes import kill_processes_using
from mpsagent_testing.repo import BUILD

MPS_ROOT = RUN / "mps"
GIB = 1024**3


def fake_gpu(index: int, memory_bytes: int = 16 * GIB) -> dict[str, Any]:
    return {
        "uuid": f"GPU-e2e{index:05d}-aaaa-bbbb-cccc-dddddddddddd",
        "name": "NVIDIA H100 80GB HBM3",
        "memoryTotal": memory_bytes,
        "major": 9,
        "minor": 0,
        "pciBusId": f"00000000:{index + 0x18:02X}:00.0",
        "minorNumber": index,
    }


def fake_nvml_config(
    gpus: list[dict[str, Any]], *, memory_limits: bool = False, cgroup_layout: CgroupLayout = "unified"
) -> str:
    """The fake NVML library's config (FAKE_NVML_CONFIG) for these GPUs, on a driver 580 node; `memory_limits` adds
    the per-cgroup memory limits of driver r615 (nvmlDevice{Set,Get}MemoryLimits_v1) on the node's cgroup v2, which
    `cgroup_layout` places (see the header of fake_nvml.c)."""
    return json.dumps(
        {
            "driverVersion": "580.95.05",
            "cudaDriverVersion": 13000,
            "memoryLimits": memory_limits,
            "cgroupLayout": cgroup_layout,
            "gpus": gpus,
        }
    )


class HostAgents:
    """Starts agents on the node (each with its own JSON log in `directory`) and ends whatever is still running."""

    def __init__(
        self,
        directory: Path,
        gpus: list[dict[str, Any]],
        *,
        memory_limits: bool = False,
        cgroup_layout: CgroupLayout = "unified",
    ) -> None:
        self.directory = directory
        self.gpus = gpus
        self.started: list[AgentProcess] = []
        nvml_config = directory / "nvml.json"
        nvml_config.write_text(fake_nvml_config(gpus, memory_limits=memory_limits, cgroup_layout=cgroup_layout))
        self.driver = FakeNvmlDriver(directory / "nvml-state.json", directory / "nvml-events.jsonl")
        self.env = fake_nvml_env(
            build_fake_nvml(BUILD), nvml_config, self.driver.state_path, events=self.driver.events_path
        )

    def start(self, config_text: str, *extra: str) -> AgentProcess:
        config = self.directory / f"config-{len(self.started)}.yaml"
        config.write_text(config_text)
        agent = spawn_agent(
            self.directory / f"agent-{len(self.started)}.log",
            "--config-file", str(config), "--mps-root", str(MPS_ROOT), "--nfd-features-file", "", *extra,
            env=self.env,
            level="info",
        )  # fmt: skip
        self.started.append(agent)
        return agent

    def start_dra(self, config_text: str, node: str, *extra: str) -> AgentProcess:
        """An agent with `--dra on` as node `node` (the node's kubeconfig, no metrics endpoint), once its DRA driver
        serves and the kubelet has registered it."""
        agent = self.start(
            config_text,
            "--dra", "on", "--kubeconfig", str(KUBECONFIG), "--node-name", node, "--metrics-address", "", *extra,
        )  # fmt: skip
        agent.wait_log("dra driver serving", timeout=30)
        kubectl.wait_for(lambda: dra_status().get("registered"), 30, "the DRA driver to be registered with the kubelet")
        return agent

    def close(self) -> None:
        """Stop every agent still running (SIGTERM, so that it removes its sockets and its ResourceSlice: the
        kubelet keeps calling a registered socket left behind; SIGKILL after 10 s) and end the MPS daemons they
        left (`--mps-on-exit keep`)."""
        for agent in self.started:
            if agent.process.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):  # killed then: the others still stop
                    agent.stop(timeout=10)
        kill_processes_using(MPS_ROOT)


def status() -> dict[str, Any]:
    """`mpsagent --status --output json` for the node's agent."""
    done = status_of(MPS_ROOT, "--output", "json")
    if done.returncode != 0:
        raise AssertionError(f"mpsagent --status exited {done.returncode}: {done.stderr[-2000:]}")
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def dra_status() -> dict[str, Any]:
    """The DRA part of `status()` (empty without `--dra on`)."""
    found: dict[str, Any] = status().get("dra") or {}
    return found


def status_text() -> str:
    done = status_of(MPS_ROOT)
    return done.stdout + done.stderr


def grants(resource: str) -> list[dict[str, Any]]:
    """The agent's live grants of `resource`, from `--status`."""
    for entry in status()["resources"]:
        if entry["name"] == resource:
            found: list[dict[str, Any]] = list(entry.get("grants", []))
            return found
    raise AssertionError(f"--status lists no resource {resource}")


def pipe_directory(resource: str) -> Path:
    vendor, name = resource.split("/")
    return MPS_ROOT / vendor / name / "pipe"
