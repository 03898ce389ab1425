"""Mapping a process's cgroup to its pod and container, for the per-container GPU memory metric."""

from __future__ import annotations

import pytest

from mpsagent.base.cgroups import PodContainer, container_id, pod_container

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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"0::/kubepods/besteffort/pod{UID}/{CID}\n", CID),
        # A kubelet with cgroupsPerQOS off: containerd's own path, no pod in it (the kubelet's link names the pod).
        (f"4:memory:/k8s.io/{CID}\n0::/k8s.io/{CID}\n", CID),
        ("0::/system.slice/nvidia-mps.service\n", None),
        (f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice\n", None),
    ],
)
def test_the_container_of_a_process_whether_or_not_its_path_names_a_pod(text: str, expected: str | None) -> None:
    assert container_id(text) == expected
