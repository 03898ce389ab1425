"""Which pod and container a process belongs to, from its `/proc/<pid>/cgroup`.

The kubelet names pod cgroups after the pod UID, and the runtime names container cgroups after the container ID:
- cgroup v1 / cgroupfs driver: `.../kubepods/burstable/pod<uid>/<container id>`
- systemd driver: `.../kubepods-burstable-pod<uid with _ for ->.slice/cri-containerd-<container id>.scope`
  (`crio-`, `docker-` for other runtimes)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(rf"pod({_UID})(?:\.slice)?(?=/|$)")
_CONTAINER = re.compile(r"/(?:[a-z-]+-)?([0-9a-f]{64})(?:\.scope)?$")


SHORT_ID_CHARS = 12
"""How many characters of a container ID a message shows, as `crictl ps` does."""


def short_id(container_id: str) -> str:
    return container_id[:SHORT_ID_CHARS]


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class PodContainer:
    pod_uid: str
    container_id: str

    def describe(self) -> str:
        return f"pod {self.pod_uid}, container {short_id(self.container_id)}"


def pod_container(cgroup_text: str) -> PodContainer | None:
    """The pod and container of a process, or None for a process outside any pod's container."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        pod = _POD.search(path)
        container = _CONTAINER.search(path)
        if pod and container:
            return PodContainer(pod_uid=pod.group(1).replace("_", "-"), container_id=container.group(1))
    return None


def container_id(cgroup_text: str) -> str | None:
    """The runtime's ID of the container a process runs in, whether or not its path names a pod (a kubelet with
    `cgroupsPerQOS: false` leaves containerd's `/k8s.io/<container id>`); None outside any container."""
    for line in cgroup_text.splitlines():
        found = _CONTAINER.search(line.split(":", 2)[-1])
        if found:
            return found.group(1)
    return None


def cgroup2_mount(mountinfo_text: str) -> str | None:
    """Where cgroup v2 is mounted, from `/proc/self/mountinfo` (`/sys/fs/cgroup` on a unified node,
    `/sys/fs/cgroup/unified` on a hybrid one); None when it is not."""
    for line in mountinfo_text.splitlines():
        fields = line.split()
        if " - " in line and len(fields) > 4:
            fstype = line.split(" - ", 1)[1].split()[0]
            if fstype == "cgroup2":
                return fields[4].replace("\\040", " ")
    return None


def cgroup2_path(cgroup_text: str) -> str | None:
    """A process's cgroup v2 path (`/kubepods/.../<container id>`), from its `/proc/<pid>/cgroup`; None when it has
    none (a cgroup v1 only node)."""
    for line in cgroup_text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            return path
    return None
