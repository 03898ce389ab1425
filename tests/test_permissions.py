"""What the agent creates on the node, and who may touch it: sockets and state owner-only; the pipe and shm
directories only as open as MPS clients in containers need."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.fake import FakeKubelet
from mpsagent_testing.node import RESOURCE


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_sockets_state_and_directories_have_the_intended_modes(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    root = short_dir / "mps"
    resource = root / "nvidia.com" / "gpu"
    # Left too open by someone else: the agent tightens what it owns.
    (root / "shm").mkdir(parents=True)
    (root / "shm").chmod(0o777)
    (resource / "log").mkdir(parents=True)
    (resource / "log").chmod(0o777)
    (resource / "log" / "control.log").write_text("old\n")
    (resource / "log" / "control.log").chmod(0o666)
    old_umask = os.umask(0)  # the agent must not depend on a careful umask
    try:
        start(agents, kubelet, short_dir)
    finally:
        os.umask(old_umask)
    plugin = kubelet.wait_registered(RESOURCE)

    socket = kubelet.socket_path.parent / plugin.request.endpoint
    assert stat.S_ISSOCK(socket.stat().st_mode) and mode(socket) == 0o600
    assert mode(resource / "daemon.json") == 0o600
    assert mode(resource / "agent.lock") == 0o600
    assert mode(resource / "log") == 0o700
    assert mode(resource / "log" / "control.log") == 0o600
    # Clients connect to the daemon's sockets: reach and list the pipe directory, never write it.
    assert mode(resource / "pipe") == 0o755
    # Clients create shared memory there and must not delete each other's.
    assert mode(root / "shm") == 0o1777
    assert mode(root) == 0o755 and mode(resource) == 0o755
