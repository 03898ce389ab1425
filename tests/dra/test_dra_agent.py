"""The agent as a real process with `--dra on`, its API server the test's own: the way out when that server takes
connections and never answers (paused, as by SIGSTOP), timed from SIGTERM to the process's exit as docs/dra.md
promises."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.fake import FakeKubelet

NODE = "node-a"
SIGTERM_EXIT_S = 5.0
"""docs/dra.md: the agent exits within 5 s of SIGTERM, the API server not answering included."""
START_S = 20.0
"""The agent's start, its MPS daemon's included, on a loaded machine."""


@pytest.fixture
def paused_api_server() -> Iterator[str]:
    """The URL of an API server that takes connections and never answers: as one stopped with SIGSTOP (the kernel
    completes the handshake and queues the requests; nobody reads them)."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters: [{{name: test, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: agent, user: {token: t0ken}}]\n"
        "contexts: [{name: test, context: {cluster: test, user: agent}}]\n"
    )
    return path


def test_sigterm_with_the_api_server_paused_exits_within_5_s_naming_the_slice_left(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, paused_api_server: str
) -> None:
    """The slice's deletion is given up in time for the agent's exit, with one warning that says what removes it."""
    agent = start(
        agents,
        kubelet,
        short_dir,
        "--dra",
        "on",
        "--kubeconfig",
        str(kubeconfig(short_dir / "kubeconfig", paused_api_server)),
        "--node-name",
        NODE,
        "--cdi-spec-dir",
        str(short_dir / "cdi"),
    )
    agent.wait_log("dra driver serving", timeout=START_S)
    signalled = time.monotonic()
    assert agent.stop() == 0
    took = time.monotonic() - signalled
    assert took < SIGTERM_EXIT_S, f"the agent exited {took:.2f} s after SIGTERM"
    events = agent.log_events()
    left = [e for e in events if e["event"] == "resource slices not removed"]
    assert [(e["slices"], e["reason"]) for e in left] == [([f"{NODE}-mps-mpsagent-io"], "no answer within 3 s")]
    assert str(left[0]["hint"]).endswith(f"kubectl delete resourceslice {NODE}-mps-mpsagent-io")
    assert events[-1]["event"] == "agent stopped"
