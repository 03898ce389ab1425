"""The agent as a real process in tests: `AgentLauncher` starts it (JSON log to a file, never the node's real
pod-resources socket or features file) and ends whatever is still running; `start`, `start_agent` and `serve`
are the usual ways to start it on `node.small_node()`, and `status` runs `mpsagent --status`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.node import config, small_node, write_config
from mpsagent_testing.repo import ROOT

GRACE_S = 10
"""The shortest grace period the agent accepts; it reconciles every GRACE_S / 2."""


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


def pod_resources_socket(directory: Path) -> Path:
    """Where agents started for `directory` look for the kubelet's pod-resources socket."""
    return directory / "pr" / "kubelet.sock"


def spawn_agent(log_path: Path, *args: str, env: dict[str, str] | None = None, level: str = "debug") -> AgentProcess:
    """`python -m mpsagent ARGS` from the checkout, its JSON log (at `level`) in `log_path`; `env` on top of ours."""
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "mpsagent", "--log-format", "json", "--log-level", level, *args],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=ROOT,
        )
    return AgentProcess(process, log_path)


class AgentLauncher:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[AgentProcess] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> AgentProcess:
        agent = spawn_agent(
            self.directory / f"agent-{len(self.started)}.log",
            "--pod-resources-socket",
            str(pod_resources_socket(self.directory)),
            # Never the node's real features directory: tests that want labels name their own file.
            "--nfd-features-file",
            str(self.directory / "nfd-absent" / "mpsagent"),
            *args,
            env=env,
        )
        self.started.append(agent)
        return agent

    def close(self) -> None:
        for agent in self.started:
            if agent.process.poll() is None:
                agent.process.kill()
                agent.process.wait(5)


def start(
    agents: AgentLauncher,
    kubelet: FakeKubelet,
    short_dir: Path,
    *extra: str,
    text: str | None = None,
    env: dict[str, str] | None = None,
    nvml: bool = False,
) -> AgentProcess:
    """Start the agent on a 2-GPU node: from a snapshot, or through NVML when `nvml` (env then loads the fake)."""
    cfg = write_config(short_dir / "config.yaml", text or config())
    gpus = () if nvml else ("--node-snapshot", str(small_node(short_dir / "node.json")))
    return agents.start(
        "--config-file",
        str(cfg),
        "--kubelet-socket",
        str(kubelet.socket_path),
        "--mps-root",
        str(short_dir / "mps"),
        *gpus,
        *extra,
        env=env,
    )


def start_agent(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, config_text: str) -> AgentProcess:
    """Start the agent with `config_text` on a 2-GPU node whose GPUs are on NUMA nodes 0 and 1."""
    node = small_node(short_dir / "node.json", numa=[0, 1])
    cfg = write_config(short_dir / "config.yaml", config_text)
    return agents.start(
        "--config-file",
        str(cfg),
        "--node-snapshot",
        str(node),
        "--kubelet-socket",
        str(kubelet.socket_path),
        "--mps-root",
        str(short_dir / "mps"),
    )


def serve(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, *extra: str, **kw: object
) -> tuple[AgentProcess, str]:
    """`start` with the HTTP endpoint on a free local port; the agent and the endpoint's base URL."""
    agent = start(agents, kubelet, short_dir, "--metrics-address", "127.0.0.1:0", *extra, **kw)  # type: ignore[arg-type]
    address = agent.wait_log("http endpoint serving")["address"]
    return agent, f"http://{address}"


def status(short_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`mpsagent --status` for the agent whose MPS root is `short_dir / "mps"`."""
    return status_of(short_dir / "mps", *extra)


def status_json(short_dir: Path) -> dict[str, Any]:
    """The status document of the agent whose MPS root is `short_dir / "mps"` (`--status --output json`)."""
    shown = status(short_dir, "--output", "json")
    assert shown.returncode == 0, shown.stderr
    found: dict[str, Any] = json.loads(shown.stdout)
    return found


def status_of(mps_root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`mpsagent --status` for the agent whose MPS root is `mps_root`."""
    return subprocess.run(
        [sys.executable, "-m", "mpsagent", "--status", "--mps-root", str(mps_root), *extra],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
