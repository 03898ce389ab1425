"""What the agent creates on the node, and who may touch it: sockets and state owner-only; the pipe and shm
directories only as open as MPS clients in containers need."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mpsagent.base.config import check_config, parse_config
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.container import share_edits
from mpsagent.domain.plan import build_plan
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.fake import FakeKubelet
from mpsagent_testing.node import RESOURCE
from mpsagent_testing.repo import EXAMPLES


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


@pytest.mark.parametrize(
    "entry", ["{name: gpu, replicas: 4}", "{name: gpu-mem, memoryUnit: 4Gi}", "{name: gpu, replicas: 1}"]
)
@pytest.mark.parametrize("strategy", ["envvar", "cdi-cri"])
def test_no_route_mounts_the_daemon_log_into_a_container(entry: str, strategy: str) -> None:
    """The daemon's control.log is the agent's instrument: neither an Allocate's mounts nor a claim's CDI spec (the
    same edits, `share_edits`) give a container its log directory, or anything under or above it but the pipe
    directory and shm."""
    text = (
        f"version: v1\nflags:\n  plugin:\n    deviceListStrategy: {strategy}\nsharing:\n  mps:\n"
        f"    failRequestsGreaterThanOne: false\n    resources:\n    - {entry}\n"
    )
    plan = build_plan(
        check_config(parse_config(text, "config.yaml")),
        SnapshotGpuSource(EXAMPLES / "node-h100x8.yaml").discover(),
        Path("/run/nvidia/mps"),
    )
    (resource,) = plan.resources
    allocator = ResourceAllocator(resource, plan.shm_directory)
    requests = [list(resource.device_ids[:1]), list(resource.device_ids[:3]), list(resource.device_ids)]
    setups = [allocator.grant_for(tuple(ids)) for ids in requests]
    claim = resource.shares.capacity_share(0, 8192, 0)
    mounted = {m.host_path for setup in setups for m in setup.mounts}
    mounted |= {m.host_path for m in share_edits(resource, claim, plan.shm_directory).mounts}
    assert mounted == {str(resource.pipe_directory), str(plan.shm_directory)}
    log = resource.log_directory
    assert all(not (log == Path(path) or Path(path) in log.parents or log in Path(path).parents) for path in mounted)
