"""The agent as a real process, driven over its unix sockets by a grpcio fake kubelet."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from mpsagent_testing.agents import AgentLauncher, start_agent
from mpsagent_testing.kubelet.calls import allocate, preferred
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.node import ALL, GPU0, GPU1, RESOURCE, config, ids, small_node, write_config

MIB_PER_REPLICA = 16 * 1024 // 4  # 16 GiB T4 in 4 replicas: exactly a quarter (docs/cap-model.md)


@pytest.fixture
def plugin(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> Plugin:
    start_agent(agents, kubelet, short_dir, config())
    return kubelet.wait_registered(RESOURCE)


def test_registers_and_lists_every_replica_with_numa_topology(plugin: Plugin, kubelet: FakeKubelet) -> None:
    assert plugin.request.version == "v1beta1"
    assert plugin.request.endpoint.startswith("mpsagent-nvidia.com_gpu-") and plugin.request.endpoint.endswith(".sock")
    assert plugin.options.get_preferred_allocation_available is True
    devices = plugin.latest()
    assert [d[0] for d in devices] == ALL
    assert {d[1] for d in devices} == {"Healthy"}
    # NUMA node 0 must survive the wire (an all-default message must not vanish).
    assert [d[2] for d in devices] == [(0,)] * 4 + [(1,)] * 4
    socket_path = kubelet.socket_path.parent / plugin.request.endpoint
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600


def test_one_replica_is_a_capped_grant(plugin: Plugin, short_dir: Path) -> None:
    response = allocate(plugin, ids(GPU1, 2))
    envs = dict(response.container_responses[0].envs)
    assert envs == {
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",
        "NVIDIA_VISIBLE_DEVICES": GPU1,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={MIB_PER_REPLICA}M",  # its one GPU, not the daemon's two
    }
    mounts = {(m.host_path, m.container_path) for m in response.container_responses[0].mounts}
    assert mounts == {
        (str(short_dir / "mps" / "nvidia.com/gpu/pipe"), "/mps/nvidia.com/gpu/pipe"),
        (str(short_dir / "mps" / "shm"), "/dev/shm"),
    }


def test_two_replicas_are_capped_and_every_replica_is_a_full_grant(plugin: Plugin) -> None:
    two = dict(allocate(plugin, [ids(GPU1, 0)[0], ids(GPU0, 3)[0]]).container_responses[0].envs)
    assert two["NVIDIA_VISIBLE_DEVICES"] == f"{GPU0},{GPU1}"  # host-index order, not request order
    assert two["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    full = dict(allocate(plugin, list(reversed(ALL))).container_responses[0].envs)
    assert full == {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe", "NVIDIA_VISIBLE_DEVICES": f"{GPU0},{GPU1}"}


def test_several_containers_in_one_request(plugin: Plugin) -> None:
    response = allocate(plugin, ids(GPU0, 0), ALL)
    first, second = (dict(c.envs) for c in response.container_responses)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in first
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in second


@pytest.mark.parametrize("fail_gt_one", [True, None])
def test_more_than_one_replica_refused_when_fail_requests_greater_than_one(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fail_gt_one: bool | None
) -> None:
    start_agent(agents, kubelet, short_dir, config(fail_gt_one))
    plugin = kubelet.wait_registered(RESOURCE)
    with pytest.raises(grpc.RpcError) as refused:
        allocate(plugin, ids(GPU0, 0, 1))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        f"{RESOURCE}: a request of 2 replicas is refused: sharing.mps.failRequestsGreaterThanOne is true "
        "(the default), which allows 1 per container; set it to false to allow more"
    )
    # A duplicated ID is one replica.
    envs = dict(allocate(plugin, ids(GPU0, 1, 1)).container_responses[0].envs)
    assert envs["NVIDIA_VISIBLE_DEVICES"] == GPU0
    with pytest.raises(grpc.RpcError) as all_refused:
        allocate(plugin, ALL)
    assert all_refused.value.details().startswith(f"{RESOURCE}: a request of 8 replicas is refused: ")


def test_unknown_ids_are_refused_by_name_with_a_bounded_message(plugin: Plugin) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        allocate(plugin, [*ids(GPU0, 0), "GPU-nope::0"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown device ID 'GPU-nope::0'" in refused.value.details()
    many = [f"GPU-bad-{i}::{'x' * 90}" for i in range(500)]  # 50 KB: within the size a request may have
    with pytest.raises(grpc.RpcError) as huge:
        allocate(plugin, many)
    assert huge.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "and 497 more" in huge.value.details()
    assert len(huge.value.details()) < 1024


def test_preferred_allocation_distributed_keeps_shares_on_one_gpu_and_takes_whole_gpus(plugin: Plugin) -> None:
    # GPU0 has one replica in use: distributed picks the idle GPU1, and keeps a request of at most one GPU's
    # worth on one GPU (a share of it); a request that must include an ID stays on that ID's GPU.
    available = [i for i in ALL if i != f"{GPU0}::0"]
    assert preferred(plugin, available, 1) == [f"{GPU1}::0"]
    assert preferred(plugin, available, 3) == ids(GPU1, 0, 1, 2)
    # More than one GPU's worth and no whole GPUs' worth: replica by replica, alternating.
    assert preferred(plugin, available, 5) == [f"{GPU1}::0", f"{GPU0}::1", f"{GPU1}::1", f"{GPU0}::2", f"{GPU1}::2"]
    # A whole GPU's worth, with one GPU wholly free, takes that GPU.
    assert preferred(plugin, available, 4) == ids(GPU1, 0, 1, 2, 3)
    assert preferred(plugin, ALL, 8) == ALL
    assert preferred(plugin, available, 2, must=[f"{GPU0}::3"]) == [f"{GPU0}::3", f"{GPU0}::1"]
    with pytest.raises(grpc.RpcError) as too_many:
        preferred(plugin, ids(GPU0, 1, 2), 3)
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3 replicas requested but only 2 are available" in too_many.value.details()


def test_preferred_allocation_packed_fills_the_busiest_gpu(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    start_agent(agents, kubelet, short_dir, config(policy="packed"))
    plugin = kubelet.wait_registered(RESOURCE)
    available = [i for i in ALL if i != f"{GPU1}::0"]
    assert preferred(plugin, available, 2) == ids(GPU1, 1, 2)
    assert preferred(plugin, available, 4) == ids(GPU0, 0, 1, 2, 3)


def test_kubelet_restart_leads_to_a_new_registration(plugin: Plugin, kubelet: FakeKubelet) -> None:
    old_endpoint = plugin.request.endpoint
    kubelet.restart()
    started = time.monotonic()
    again = kubelet.wait_registered(RESOURCE, timeout=5)
    assert time.monotonic() - started < 3
    assert again.request.endpoint == old_endpoint
    assert len(again.latest()) == 8
    assert dict(allocate(again, ids(GPU0, 0)).container_responses[0].envs)["NVIDIA_VISIBLE_DEVICES"] == GPU0


def test_a_kubelet_that_restarts_without_deleting_our_socket_is_registered_with_again(
    plugin: Plugin, kubelet: FakeKubelet, record_property: Callable[[str, object], None]
) -> None:
    """Its new socket is all that tells: on ext4 it often has the old socket's inode number (a freed number is
    handed out again at once), and then only the change time says it is new. Other file systems (tmpfs) give a new
    number; the agent must register again either way."""
    old = kubelet.socket_path.stat()
    kubelet.stop(remove_sockets=False)
    kubelet.start()
    new = kubelet.socket_path.stat()
    record_property("same_inode_number", (new.st_dev, new.st_ino) == (old.st_dev, old.st_ino))
    again = kubelet.wait_registered(RESOURCE, timeout=5)
    assert again.request.endpoint == plugin.request.endpoint


def test_sigterm_with_an_open_stream_exits_cleanly_and_removes_the_socket(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start_agent(agents, kubelet, short_dir, config())
    plugin = kubelet.wait_registered(RESOURCE)
    socket_path = kubelet.socket_path.parent / plugin.request.endpoint
    assert socket_path.exists()
    started = time.monotonic()
    assert agent.stop() == 0
    assert time.monotonic() - started < 2.0
    assert not socket_path.exists()
    assert plugin.stream_ended.wait(5)
    assert agent.log_events()[-1]["event"] == "agent stopped"


def test_sighup_stops_the_agent_cleanly_like_sigterm(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start_agent(agents, kubelet, short_dir, config())
    plugin = kubelet.wait_registered(RESOURCE)
    socket_path = kubelet.socket_path.parent / plugin.request.endpoint
    status = short_dir / "mps" / "status.json"
    wait_for(status.exists, 5, "the status file")
    assert agent.stop(signal.SIGHUP) == 0
    assert not socket_path.exists()
    assert not status.exists()
    assert [e["reason"] for e in agent.log_events() if e.get("event") == "stopping"] == ["SIGHUP"]
    assert agent.log_events()[-1]["event"] == "agent stopped"


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait(5)
    return process.pid


def test_sockets_of_agents_that_are_gone_are_removed_at_start(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    directory = kubelet.socket_path.parent
    killed = start_agent(agents, kubelet, short_dir, config())
    left_behind = directory / kubelet.wait_registered(RESOURCE).request.endpoint
    killed.stop(signal.SIGKILL)
    assert left_behind.exists()

    def unix_socket(name: str) -> Path:
        path = directory / name
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
        return path

    gone = dead_pid()
    stale = unix_socket(f"mpsagent-nvidia.com_gpu-{gone}.sock")
    kept = [
        unix_socket(f"mpsagent-nvidia.com_gpu-{os.getpid()}.sock"),  # its process lives
        unix_socket(f"mpsagent-example.com_nic-{gone}.sock"),  # another resource
        unix_socket(f"mpsagent-nvidia.com_gpu-shared-{gone}.sock"),  # another resource too
        unix_socket(f"other-plugin-{gone}.sock"),
    ]
    target = short_dir / "not-ours"
    target.write_text("kept")
    link = directory / f"mpsagent-nvidia.com_gpu-{dead_pid()}.sock"
    link.symlink_to(target)
    kept.append(link)
    plain = directory / f"mpsagent-nvidia.com_gpu-{dead_pid()}.sock"
    plain.write_text("not a socket")
    kept.append(plain)

    agent = start_agent(agents, kubelet, short_dir, config())
    kubelet.wait_registered(RESOURCE, count=2)
    assert not left_behind.exists() and not stale.exists()
    assert all(path.is_symlink() or path.exists() for path in kept)
    assert target.read_text() == "kept"
    removed = [e["socket"] for e in agent.log_events() if e.get("event") == "stale plugin socket removed"]
    assert sorted(removed) == sorted([str(left_behind), str(stale)])


def test_a_second_agent_for_the_same_resource_exits_naming_the_first(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    first = start_agent(agents, kubelet, short_dir, config())
    kubelet.wait_registered(RESOURCE)
    second = start_agent(agents, kubelet, short_dir, config())
    assert second.process.wait(20) == 1
    assert f"another mpsagent (PID {first.process.pid}) already serves nvidia.com/gpu" in second.log()
    assert first.process.poll() is None


def start_elsewhere(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, name: str, config_text: str):
    """An agent of its own MPS root and config, on the same kubelet: a second installation on the node."""
    return agents.start(
        "--config-file",
        str(write_config(short_dir / f"{name}.yaml", config_text)),
        "--node-snapshot",
        str(small_node(short_dir / "node.json", numa=[0, 1])),
        "--kubelet-socket",
        str(kubelet.socket_path),
        "--mps-root",
        str(short_dir / name),
    )


def test_a_second_agent_with_another_mps_root_exits_naming_the_first_even_after_a_kubelet_restart(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    first = start_elsewhere(agents, kubelet, short_dir, "mps-a", config())
    kubelet.wait_registered(RESOURCE)
    second = start_elsewhere(agents, kubelet, short_dir, "mps-b", config())
    assert second.process.wait(20) == 1
    assert f"another mpsagent (PID {first.process.pid}) already serves nvidia.com/gpu on this node" in second.log()
    assert "Traceback" not in second.log()
    assert not (short_dir / "mps-b").exists()  # refused before it touched its MPS root

    kubelet.restart()  # the kubelet deletes every file of its directory (not directories)
    kubelet.wait_registered(RESOURCE)
    renamed = config().replace("  mps:\n", "  mps:\n    renameByDefault: true\n")
    third = start_elsewhere(agents, kubelet, short_dir, "mps-c", renamed)  # another name, the same GPUs
    assert third.process.wait(20) == 1
    assert f"another mpsagent (PID {first.process.pid}) already shares GPU {GPU0} on this node" in third.log()
    assert first.process.poll() is None
    assert [p.request.resource_name for p in kubelet.plugins] == [RESOURCE]


def test_bad_config_starts_nothing(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    agent = start_agent(agents, kubelet, short_dir, config(replicas=49))
    assert agent.process.wait(20) == 2
    assert "sharing.mps.resources[0].replicas: must be between 1 and 48" in agent.log()
    assert "Traceback" not in agent.log()
    assert sorted(p.name for p in kubelet.socket_path.parent.iterdir()) == ["kubelet.sock"]
    assert not (short_dir / "mps").exists()
    assert kubelet.plugins == []
    assert os.listdir(short_dir / "dp") == ["kubelet.sock"]


def test_a_kubelet_that_comes_back_is_registered_with_at_once_not_after_the_backoff(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    kubelet.stop()
    agent = start_agent(agents, kubelet, short_dir, config())
    agent.wait_log("kubelet registration failed")
    time.sleep(3.5)  # the retry backoff has grown past 3 s by now
    kubelet.start()
    began = time.monotonic()
    kubelet.wait_registered(RESOURCE, timeout=5)
    assert time.monotonic() - began < 1.0


def test_a_full_grant_over_believed_live_grants_says_so_in_one_line(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start_agent(agents, kubelet, short_dir, config())
    plugin = kubelet.wait_registered(RESOURCE)
    for replica in ALL[:5]:
        allocate(plugin, [replica])
    allocate(plugin, ALL)  # the kubelet gives every replica: the five earlier containers are gone
    # Logged once the answer is on its way, so it may come just after the answer.
    agent.wait_log("replicas granted again while believed live")
    warnings = [e for e in agent.log_events() if e.get("event") == "replicas granted again while believed live"]
    assert len(warnings) == 1
    assert warnings[0]["earlier_grant_count"] == 5 and warnings[0]["replicas"] == 5
    assert warnings[0]["earlier_grants"] == [1, 2, 3, 4, 5]
