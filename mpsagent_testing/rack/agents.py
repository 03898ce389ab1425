"""The rack's agents: N agents on one machine, each as the node's systemd unit runs one (`--dra on`, a host process, the
real `nvidia-cuda-mps-control`), with its own fake NVML of GPUS GPUs (or as many as asked), node name, kubelet
directory, MPS root, CDI directory and MPS daemon, and its own identity at the API server: a service account of the
namespace the node audits (`node.AUDITED_NAMESPACE`), so that the API server's audit log tells each agent's requests
apart. No kubelet calls them: the rack's kubelet stand-in (`rack.kubelet`) prepares their claims, and a device-plugin
grant is made through the grpcio kubelet stand-in (`grant`)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsagent_testing.agents import AgentProcess, spawn_agent
from mpsagent_testing.cluster.host_agent import GIB, fake_gpu, fake_nvml_config
from mpsagent_testing.cluster.node import AUDITED_NAMESPACE, write_kubeconfig
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet
from mpsagent_testing.nvml.build import build_fake_nvml, fake_nvml_env
from mpsagent_testing.processes import MARKER_ENV, cpu_times, kill_processes_using, rss_bytes
from mpsagent_testing.rack.rest import Api
from mpsagent_testing.repo import BUILD

GPUS = 8
GPU_MEMORY = 80 * GIB
REPLICAS = 4
RESOURCE = "nvidia.com/gpu"
CONFIG = f"""\
version: v1
sharing:
  mps:
    resources:
    - name: {RESOURCE}
      replicas: {REPLICAS}
"""
"""Every GPU of the agent in one resource of 4 replicas: a device-plugin grant of one replica holds a quarter."""
START_TIMEOUT_S = 120.0
"""Every agent started at once on a 2-core machine takes its turn."""
STOP_TIMEOUT_S = 20.0
TOKEN_SECONDS = 24 * 3600


def user(index: int) -> str:
    """The service account agent `index` runs as, as the API server names it."""
    return f"system:serviceaccount:{AUDITED_NAMESPACE}:{account(index)}"


def account(index: int) -> str:
    return f"agent-{index:02d}"


def rack_gpu(agent: int, index: int) -> dict[str, Any]:
    """GPU `index` of agent `agent`: an 80 GiB H100, its UUID the rack's own."""
    return {**fake_gpu(index, GPU_MEMORY), "uuid": f"GPU-{agent:08d}-{index:04d}-4000-8000-000000000000"}


@dataclass
class RackAgent:
    """One agent of the rack and the files that are its alone."""

    index: int
    node: str
    directory: Path
    process: AgentProcess | None = None

    @property
    def user(self) -> str:
        return user(self.index)

    @property
    def mps_root(self) -> Path:
        return self.directory / "mps"

    @property
    def kubelet_socket(self) -> Path:
        return self.directory / "kubelet" / "device-plugins" / "kubelet.sock"

    @property
    def dra_socket(self) -> Path:
        return self.directory / "kubelet" / "plugins" / "mps.mpsagent.io" / "dra.sock"

    @property
    def pid(self) -> int:
        assert self.process is not None, f"agent {self.index} was not started"
        return self.process.process.pid

    def usage(self) -> Usage:
        return Usage(rss_bytes=rss_bytes(self.pid), cpu_s=cpu_times(self.pid).own_s, at=time.monotonic())


@dataclass(frozen=True)
class Usage:
    """What an agent's process holds and has spent, at a moment (`time.monotonic`)."""

    rss_bytes: int
    cpu_s: float
    at: float


class RackAgents:
    """Starts the rack's agents in `directory` (one folder each) and ends them and their MPS daemons."""

    def __init__(self, api: Api, directory: Path, nodes: list[str], *, gpus: int = GPUS) -> None:
        self._api = api
        self.directory = directory
        self.gpus = gpus
        self.agents = [RackAgent(index, node, directory / f"a{index:02d}") for index, node in enumerate(nodes)]
        self._library = build_fake_nvml(BUILD)

    def start(self) -> list[float]:
        """Start every agent at once (each with its service account's token); the time each was started at
        (`time.time`). Returns before they serve."""
        started = []
        for agent in self.agents:
            agent.kubelet_socket.parent.mkdir(parents=True)  # the kubelet makes its directory
            kubeconfig = self._kubeconfig(agent)
            started.append(time.time())
            agent.process = self._spawn(agent, kubeconfig)
        return started

    def _kubeconfig(self, agent: RackAgent) -> Path:
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": TOKEN_SECONDS},
        }
        path = f"/api/v1/namespaces/{AUDITED_NAMESPACE}/serviceaccounts/{account(agent.index)}/token"
        token = self._api.create(path, request)["status"]["token"]
        kubeconfig = agent.directory / "kubeconfig"
        write_kubeconfig(kubeconfig, account(agent.index), token)
        return kubeconfig

    def _spawn(self, agent: RackAgent, kubeconfig: Path) -> AgentProcess:
        nvml = agent.directory / "nvml.json"
        nvml.write_text(fake_nvml_config([rack_gpu(agent.index, i) for i in range(self.gpus)]))
        config = agent.directory / "config.yaml"
        config.write_text(CONFIG)
        env = fake_nvml_env(self._library, nvml, agent.directory / "nvml-state.json")
        env[MARKER_ENV] = str(agent.directory)
        return spawn_agent(
            agent.directory / "agent.log",
            "--config-file",
            str(config),
            "--dra",
            "on",
            "--kubeconfig",
            str(kubeconfig),
            "--node-name",
            agent.node,
            "--mps-root",
            str(agent.mps_root),
            "--mps-on-exit",
            "quit",
            "--kubelet-socket",
            str(agent.kubelet_socket),
            "--pod-resources-socket",
            str(agent.directory / "kubelet" / "pod-resources" / "kubelet.sock"),
            "--cdi-spec-dir",
            str(agent.directory / "cdi"),
            "--cdi-hook",
            "",
            "--container-logs-dir",
            str(agent.directory / "containers"),
            "--nfd-features-file",
            "",
            "--metrics-address",
            "",
            env=env,
            level="info",
        )

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Every agent's DRA driver serving; AssertionError naming those that are not, with a log's tail."""
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            assert agent.process is not None
            while not any(e.get("event") == "dra driver serving" for e in agent.process.log_events()):
                if agent.process.process.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(agent.process.log().splitlines()[-20:])
                    raise AssertionError(f"agent {agent.index} ({agent.node}) is not serving:\n{tail}")
                time.sleep(0.2)

    def usage(self) -> list[Usage]:
        return [agent.usage() for agent in self.agents]

    def close(self) -> None:
        """SIGTERM every agent still running (each removes its slice and quits its MPS daemon), SIGKILL after
        STOP_TIMEOUT_S; then SIGKILL whatever still names an agent's directory (a daemon left behind)."""
        running = [a.process for a in self.agents if a.process is not None and a.process.process.poll() is None]
        for process in running:
            process.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.process.wait(max(0.1, deadline - time.monotonic()))
            if process.process.poll() is None:
                process.process.kill()
                process.process.wait(5)
        for agent in self.agents:
            kill_processes_using(agent.directory)


def grant(agent: RackAgent, gpu: int, replicas: int = 1) -> float:
    """A device-plugin grant on agent `agent`'s GPU `gpu`, as a kubelet makes one: the grpcio kubelet stand-in on
    the agent's kubelet socket, the agent registered with it, then `Allocate` of `replicas` of that GPU's IDs. The
    time (`time.time`) the Allocate was sent. The stand-in is stopped after, and its socket removed (the agent then
    waits for a kubelet again); the grant stays in the agent's ledger, since no pod-resources API says otherwise."""
    kubelet = FakeKubelet(agent.kubelet_socket).start()
    try:
        plugin = kubelet.wait_registered(RESOURCE, timeout=30)
        uuid = rack_gpu(agent.index, gpu)["uuid"]
        ids = [device for device, _, _ in plugin.latest() if device.startswith(f"{uuid}::")][:replicas]
        assert len(ids) == replicas, f"agent {agent.index} lists {len(ids)} IDs of GPU {gpu}"
        sent = time.time()
        allocate(plugin, ids)
        return sent
    finally:
        kubelet.stop(remove_sockets=False)
        agent.kubelet_socket.unlink(missing_ok=True)
