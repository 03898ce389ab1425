"""Shared fixtures: short socket directories, the agent as a real process, the fake kubelet, the fake NVML."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fakes.nvml.build import build_fake_nvml
from tests.kubelet.fake import FakeKubelet, wait_for
from tests.kubelet.podresources import FakePodResources
from tests.processes import kill_processes_using

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BUILD = ROOT / "tests" / ".build"
H100_NODE = EXAMPLES / "node-h100x8.yaml"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (unix socket paths are limited to 107 bytes); every process that a test
    started for it (agents, MPS daemons in their own sessions) is killed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="mpa", dir="/tmp"))
    yield path
    kill_processes_using(path)
    shutil.rmtree(path, ignore_errors=True)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def small_node(
    path: Path, gpus: int = 2, memory_bytes: int = 16 * 1024**3, numa: list[int | None] | None = None
) -> Path:
    numa = numa or [0] * gpus
    document = {
        "driverVersion": "550.54.15",
        "gpus": [
            {
                "uuid": f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd",
                "index": i,
                "name": "Tesla T4",
                "memoryBytes": memory_bytes,
                "computeCapability": "7.5",
                "pciBusId": f"00000000:{i + 1:02X}:00.0",
                "numaNode": numa[i],
            }
            for i in range(gpus)
        ],
    }
    path.write_text(json.dumps(document))
    return path


@dataclass
class AgentProcess:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict[str, object]]:
        """The JSON log lines written so far; a last line still being written is not one yet."""
        text = self.log()
        events = []
        for line in text[: text.rfind("\n") + 1].splitlines():
            if line.startswith("{"):
                events.append(json.loads(line))
        return events

    def wait_log(self, event: str, timeout: float = 10.0) -> dict[str, object]:
        return wait_for(
            lambda: next((e for e in self.log_events() if e.get("event") == event), None), timeout, f"log `{event}`"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise


class AgentLauncher:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[AgentProcess] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> AgentProcess:
        log_path = self.directory / f"agent-{len(self.started)}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mpsagent",
                    "--log-format",
                    "json",
                    "--log-level",
                    "debug",
                    "--pod-resources-socket",
                    str(pod_resources_socket(self.directory)),
                    # Never the node's real features directory: tests that want labels name their own file.
                    "--nfd-features-file",
                    str(self.directory / "nfd-absent" / "mpsagent"),
                    *args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=ROOT,
            )
        agent = AgentProcess(process, log_path)
        self.started.append(agent)
        return agent

    def close(self) -> None:
        for agent in self.started:
            if agent.process.poll() is None:
                agent.process.kill()
                agent.process.wait(5)


@pytest.fixture
def agents(short_dir: Path) -> Iterator[AgentLauncher]:
    launcher = AgentLauncher(short_dir)
    yield launcher
    launcher.close()


@pytest.fixture
def kubelet(short_dir: Path, pod_resources: FakePodResources) -> Iterator[FakeKubelet]:
    (short_dir / "dp").mkdir()
    fake = FakeKubelet(short_dir / "dp" / "kubelet.sock").start()
    yield fake
    fake.stop()


@pytest.fixture
def pod_resources(short_dir: Path) -> Iterator[FakePodResources]:
    """The kubelet's pod-resources endpoint; agents started by `agents` use it (an empty listing by default)."""
    fake = FakePodResources(pod_resources_socket(short_dir)).start()
    yield fake
    fake.stop()


def pod_resources_socket(directory: Path) -> Path:
    return directory / "pr" / "kubelet.sock"


@pytest.fixture(scope="session")
def fake_nvml_library() -> Path:
    return build_fake_nvml(BUILD)
