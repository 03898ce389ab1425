"""The node guard's locks in the kubelet's directory: taken all or none, never through a link or another user's
directory. (Two agents on one node: tests/agent/test_plugin_integration.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mpsagent.base.config import check_config, parse_config
from mpsagent.base.errors import AgentLockedError, HostError
from mpsagent.base.host import PidLock
from mpsagent.domain.plan import ResourcePlan, build_plan
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent.kubelet.guard import NodeGuard
from mpsagent_testing.node import small_node

CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      replicas: 2\n"


def resources(tmp_path: Path) -> tuple[ResourcePlan, ...]:
    node = SnapshotGpuSource(small_node(tmp_path / "node.json")).discover()
    return build_plan(check_config(parse_config(CONFIG, "c.yaml")), node, tmp_path / "mps").resources


def test_the_guard_takes_every_lock_and_gives_them_back(tmp_path: Path) -> None:
    plan = resources(tmp_path)
    with NodeGuard(tmp_path, plan):
        locks = tmp_path / "mpsagent-locks"
        assert sorted(p.name for p in locks.iterdir()) == [
            "gpu-GPU-00000000-aaaa-bbbb-cccc-dddddddddddd.lock",
            "gpu-GPU-00000001-aaaa-bbbb-cccc-dddddddddddd.lock",
            "resource-nvidia.com_gpu.lock",
        ]
        assert (locks / "resource-nvidia.com_gpu.lock").read_text() == f"{os.getpid()}\n"
        assert oct(locks.stat().st_mode & 0o777) == "0o700"
    with NodeGuard(tmp_path, plan):  # released: taken again at once
        pass


def test_a_lock_file_that_is_a_link_is_refused_and_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / "mpsagent-locks").mkdir(mode=0o700)
    (tmp_path / "mpsagent-locks" / "resource-nvidia.com_gpu.lock").symlink_to(target)
    with pytest.raises(HostError, match=r"the node lock .*resource-nvidia.com_gpu.lock is a symbolic link"):
        NodeGuard(tmp_path, resources(tmp_path)).acquire()
    assert target.read_text() == "keep me"


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        ("link", "is a symbolic link, not a directory"),
        ("open", f"is owned by UID {os.geteuid()} with mode drwxrwxrwx, and the agent trusts only what its own user"),
        ("theirs", "is owned by UID 65534 with mode drwx------, and the agent trusts only what its own user"),
    ],
)
def test_a_lock_directory_that_is_a_link_or_open_to_others_is_refused(tmp_path: Path, make: str, problem: str) -> None:
    directory = tmp_path / "mpsagent-locks"
    if make == "link":
        (tmp_path / "elsewhere").mkdir()
        directory.symlink_to(tmp_path / "elsewhere")
    else:
        directory.mkdir(mode=0o700)
        if make == "open":
            directory.chmod(0o777)
        else:
            os.chown(directory, 65534, 65534)
    with pytest.raises(HostError) as refused:
        NodeGuard(tmp_path, resources(tmp_path)).acquire()
    assert str(refused.value).startswith(f"the lock directory {directory} {problem}")
    assert str(refused.value).endswith("; remove it and start the agent again")


def test_a_refusal_leaves_no_lock_taken(tmp_path: Path) -> None:
    plan = resources(tmp_path)
    (tmp_path / "mpsagent-locks").mkdir(mode=0o700)
    locks = tmp_path / "mpsagent-locks"
    second_gpu = PidLock(locks / "gpu-GPU-00000001-aaaa-bbbb-cccc-dddddddddddd.lock")
    assert second_gpu.acquire() is None
    with pytest.raises(AgentLockedError) as refused:
        NodeGuard(tmp_path, plan).acquire()
    assert str(refused.value) == (
        f"another mpsagent (PID {os.getpid()}) already shares GPU GPU-00000001-aaaa-bbbb-cccc-dddddddddddd on this "
        f"node (lock {second_gpu.path}); stop it before starting this one, or select other GPUs with "
        "sharing.mps.resources[0].devices"
    )
    for name in ("resource-nvidia.com_gpu.lock", "gpu-GPU-00000000-aaaa-bbbb-cccc-dddddddddddd.lock"):
        lock = PidLock(locks / name)
        assert lock.acquire() is None, f"{name} was left taken"
        lock.release()
    second_gpu.release()
