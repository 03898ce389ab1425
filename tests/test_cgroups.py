"""Mapping a process's cgroup to its pod and container, for the per-container GPU memory metric."""

from __future__ import annotations

import pytest

from mpsagent.base.cgroups import PodContainer, pod_container

UID = "0f3e9b1c-6a2d-4c8e-9f10-2b3c4d5e6f70"
CID = "a" * 60 + "1234"


@pytest.mark.parametrize(
    "text",
    [
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope\n",
        f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
        f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n11:cpu:/kubepods/burstable/pod{UID}/{CID}\n",
        f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
        f"0::/system.slice/containerd.service/kubepods-besteffort-pod{UID.replace('-', '_')}.slice:cri-containerd:{CID}"
        f"\n0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
        f"docker-{CID}.scope\n",
    ],
)
def test_pod_and_container_from_each_driver_and_runtime(text: str) -> None:
    assert pod_container(text) == PodContainer(pod_uid=UID, container_id=CID)


@pytest.mark.parametrize(
    "text",
    [
        "0::/system.slice/nvidia-mps.service\n",
        "0::/user.slice/user-0.slice/session-1.scope\n",
        f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice\n",  # the pod, no container
        "",
    ],
)
def test_processes_outside_a_pod_container_have_none(text: str) -> None:
    assert pod_container(text) is None
