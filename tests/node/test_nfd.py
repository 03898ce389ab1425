"""Node labels as a node-feature-discovery local feature file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mpsagent.node.nfd import features_text, write_features
from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.node import RESOURCE

EXPECTED = (
    # GPUs from a node snapshot: MPS alone holds a capped container to its memory (the agent asks NVML otherwise).
    "mpsagent.io/memory-enforcement.gpu-0=mps\n"
    "mpsagent.io/memory-enforcement.gpu-1=mps\n"
    "nvidia.com/gpu.count=2\n"
    "nvidia.com/gpu.product=Tesla-T4-SHARED\n"
    "nvidia.com/gpu.replicas=4\n"
    "nvidia.com/gpu.sharing-strategy=mps\n"
    "nvidia.com/mps.capable=true\n"
)


def features_dir(short_dir: Path) -> Path:
    path = short_dir / "features.d"
    path.mkdir(exist_ok=True)
    return path


def test_labels_written_and_removed_on_a_clean_exit_that_quits_the_daemon(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    target = features_dir(short_dir) / "mpsagent"
    agent = start(agents, kubelet, short_dir, "--nfd-features-file", str(target), "--mps-on-exit", "quit")
    kubelet.wait_registered(RESOURCE)
    wait_for(target.exists, 5, "the features file")
    assert target.read_text() == EXPECTED
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["mpsagent"]  # no temporary file left behind
    assert agent.stop() == 0
    assert not target.exists()


def test_labels_stay_when_the_daemon_is_kept_and_are_rewritten_only_when_they_change(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    target = features_dir(short_dir) / "mpsagent"
    target.write_text("nvidia.com/gpu.replicas=2\n")  # from an older configuration
    agent = start(agents, kubelet, short_dir, "--nfd-features-file", str(target))
    kubelet.wait_registered(RESOURCE)
    assert target.read_text() == EXPECTED
    assert agent.wait_log("node labels written for node-feature-discovery")["labels"] == len(EXPECTED.splitlines())
    assert agent.stop() == 0
    assert target.read_text() == EXPECTED
    written = target.stat().st_mtime_ns
    assert not write_features(target, dict(line.split("=") for line in EXPECTED.splitlines()))
    assert target.stat().st_mtime_ns == written


def test_a_missing_nfd_directory_is_reported_and_the_agent_serves(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    target = short_dir / "no-nfd" / "features.d" / "mpsagent"
    agent = start(agents, kubelet, short_dir, "--nfd-features-file", str(target))
    kubelet.wait_registered(RESOURCE)
    warning = agent.wait_log("node labels not written: the node-feature-discovery features directory is missing")
    assert warning["path"] == str(target)
    assert not target.parent.exists()


def test_an_empty_path_turns_the_file_off(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    agent = start(agents, kubelet, short_dir, "--nfd-features-file", "")
    kubelet.wait_registered(RESOURCE)
    assert not [e for e in agent.log_events() if "node labels" in str(e.get("event"))]


def test_features_text_is_sorted_key_value_lines() -> None:
    assert features_text({"b": "2", "a": "1"}) == "a=1\nb=2\n"


def test_a_fifo_in_place_of_the_features_file_is_refused_and_the_agent_serves(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    target = features_dir(short_dir) / "mpsagent"
    os.mkfifo(target)
    agent = start(agents, kubelet, short_dir, "--nfd-features-file", str(target))
    kubelet.wait_registered(RESOURCE)
    warning = agent.wait_log("node labels not written")
    assert warning["reason"] == f"the node-feature-discovery file {target} is a FIFO, not a regular file"
    assert stat.S_ISFIFO(target.lstat().st_mode)


def test_a_link_to_a_device_in_place_of_the_features_file_is_refused_and_the_agent_serves(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    target = features_dir(short_dir) / "mpsagent"
    target.symlink_to("/dev/zero")
    agent = start(agents, kubelet, short_dir, "--nfd-features-file", str(target))
    kubelet.wait_registered(RESOURCE)
    warning = agent.wait_log("node labels not written")
    assert warning["reason"] == f"the node-feature-discovery file {target} is a symbolic link, not a regular file"
    assert target.is_symlink()


def test_a_features_file_larger_than_the_labels_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "mpsagent"
    target.write_bytes(b"x" * 10_000_000)
    assert write_features(target, {"a": "1"})
    assert target.read_text() == "a=1\n"
