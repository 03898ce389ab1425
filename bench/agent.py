"""One benchmark node: a short directory with a node snapshot, a config, a timed fake kubelet, and the agent
started in it as a real process (its MPS daemon started by the agent). Closing the node ends every process that
was started for it, whatever happened before."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType

from kubelet import TimedKubelet

from mpsagent_testing.kubelet.fake import Plugin, wait_for
from mpsagent_testing.processes import end_group, kill_processes_using, marked_env

ROOT = Path(__file__).resolve().parents[1]
RESOURCE = "nvidia.com/gpu"
SOCKET_PATH_MAX = 107
GPU_MEMORY_BYTES = 85520809984  # H100 80GB
START_TIMEOUT_S = 30.0
FAILED_LOGS = ROOT / "bench" / "results" / "failed"


@dataclass(frozen=True, slots=True)
class NodeShape:
    gpus: int
    replicas: int

    def __str__(self) -> str:
        return f"{self.gpus}x{self.replicas}"


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-b3c4-4d5e-8f60-{index:012x}"


def replica_ids(shape: NodeShape) -> list[str]:
    """Every advertised ID, GPU by GPU."""
    return [f"{gpu_uuid(g)}::{r}" for g in range(shape.gpus) for r in range(shape.replicas)]


def spread_ids(shape: NodeShape) -> list[str]:
    """Every ID in the order the kubelet would hand out single replicas under `distributed`: across the GPUs."""
    return [f"{gpu_uuid(g)}::{r}" for r in range(shape.replicas) for g in range(shape.gpus)]


def write_snapshot(path: Path, shape: NodeShape) -> Path:
    gpus = [
        {
            "uuid": gpu_uuid(i),
            "index": i,
            "name": "NVIDIA H100 80GB HBM3",
            "memoryBytes": GPU_MEMORY_BYTES,
            "computeCapability": "9.0",
            "pciBusId": f"00000000:{i + 0x18:02X}:00.0",
            "numaNode": 0 if i < shape.gpus // 2 else 1,
            "migEnabled": False,
        }
        for i in range(shape.gpus)
    ]
    path.write_text(json.dumps({"driverVersion": "550.90.07", "gpus": gpus}))
    return path


def write_config(path: Path, shape: NodeShape) -> Path:
    path.write_text(
        "version: v1\n"
        "flags:\n  plugin:\n    deviceListStrategy: envvar\n    deviceIDStrategy: uuid\n"
        "    sharedDevicesAllocationPolicy: distributed\n"
        "sharing:\n  mps:\n    failRequestsGreaterThanOne: false\n"
        f"    resources:\n    - name: {RESOURCE}\n      replicas: {shape.replicas}\n"
    )
    return path


@dataclass
class AgentProcess:
    process: subprocess.Popen[bytes]
    started_ns: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def endpoint_suffix(self) -> str:
        return f"-{self.pid}.sock"

    def check_running(self) -> None:
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the agent exited with status {self.process.returncode}:\n{tail}")

    def log_events(self) -> list[dict[str, object]]:
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                events.append(json.loads(line))
        return events

    def count_events(self, event: str) -> int:
        """How many log lines carry this event (a plain text search: cheap on a long log)."""
        return self.log_path.read_text(errors="replace").count(f'"event": "{event}"')

    def log_time_ns(self, event: str, pid: int) -> int:
        """Wall-clock time (ns) of the agent's log event `event` that names the daemon `pid`."""

        def found() -> dict[str, object] | None:
            return next((e for e in self.log_events() if e.get("event") == event and e.get("pid") == pid), None)

        record = wait_for(found, 5.0, f"log `{event}` for PID {pid}")
        stamp = datetime.fromisoformat(str(record["timestamp"]))
        return round(stamp.timestamp() * 1e6) * 1000

    def stop(self) -> int | None:
        return end_group(self.process)


class BenchNode:
    """A node directory with its own fake kubelet; agents started here share the MPS root (so one can adopt the
    daemon the previous one left running)."""

    def __init__(self, directory: Path, shape: NodeShape) -> None:
        self.directory = directory
        self.shape = shape
        directory.mkdir(parents=True)
        (directory / "dp").mkdir()
        self.snapshot = write_snapshot(directory / "node.json", shape)
        self.config = write_config(directory / "config.yaml", shape)
        self.mps_root = directory / "mps"
        self.kubelet = TimedKubelet(directory / "dp" / "kubelet.sock")
        longest = directory / "dp" / f"mpsagent-{RESOURCE.replace('/', '_')}-4194304.sock"
        if len(str(longest)) > SOCKET_PATH_MAX:
            raise ValueError(f"{directory} is too long for unix socket paths; use a shorter --work-dir")
        self.agents: list[AgentProcess] = []
        self.kubelet.start()

    def __enter__(self) -> BenchNode:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is not None and not issubclass(kind, KeyboardInterrupt):
            self.keep_logs()
        self.close()

    def keep_logs(self) -> Path:
        """Copy the agents' and the daemon's logs out of the node directory (which `close` removes)."""
        target = FAILED_LOGS / f"{time.strftime('%Y%m%d-%H%M%S')}-{self.directory.name}"
        target.mkdir(parents=True, exist_ok=True)
        for log in (*self.directory.glob("*.log"), *self.mps_root.glob("*/*/log/control.log")):
            shutil.copy(log, target / log.name)
        print(f"\nlogs of the failed node: {target}", file=sys.stderr)
        return target

    @property
    def state_file(self) -> Path:
        return self.mps_root / RESOURCE / "daemon.json"

    def daemon_pid(self) -> int:
        return int(json.loads(self.state_file.read_text())["pid"])

    def start_agent(self, *, on_exit: str = "quit", log_level: str = "info") -> AgentProcess:
        log_path = self.directory / f"agent-{len(self.agents)}.log"
        argv = [sys.executable, "-m", "mpsagent", "--log-format", "json", "--log-level", log_level]
        argv += ["--config-file", str(self.config), "--node-snapshot", str(self.snapshot)]
        argv += ["--kubelet-socket", str(self.kubelet.socket_path), "--mps-root", str(self.mps_root)]
        argv += ["--mps-on-exit", on_exit]
        with log_path.open("wb") as log_file:
            started_ns = time.perf_counter_ns()
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=marked_env(self.directory),
                cwd=ROOT,
                start_new_session=True,
            )
        agent = AgentProcess(process, started_ns, log_path)
        self.agents.append(agent)
        return agent

    def wait_registered(self, agent: AgentProcess, since_ns: int | None = None) -> tuple[Plugin, int]:
        """The plugin the kubelet sees for `agent`, with its first ListAndWatch message, and when Register came."""
        since = agent.started_ns if since_ns is None else since_ns
        try:
            registration = self.kubelet.registration_after(since, agent.endpoint_suffix, START_TIMEOUT_S)
            plugin = self.kubelet.plugin_for(agent.endpoint_suffix, START_TIMEOUT_S)
        except AssertionError:
            agent.check_running()
            raise
        return plugin, registration.ns

    def close(self) -> None:
        for agent in self.agents:
            agent.stop()
        self.kubelet.stop()
        for _ in range(3):  # the MPS daemon runs in its own session: find it by the environment marker
            if not kill_processes_using(self.directory):
                break
            time.sleep(0.05)
        shutil.rmtree(self.directory, ignore_errors=True)


def interrupt_on_sigterm() -> None:
    """SIGTERM ends the bench like Ctrl-C, so every node's `close` still runs."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
