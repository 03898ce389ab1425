"""A cgroup named as the kubelet and containerd name a pod's container, for a test's process that must look like
one of a pod's to the agent (`/proc/<pid>/cgroup`): the real kernel's, made under one of the node's hierarchies,
removed afterwards."""

from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HIERARCHIES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
"""Where a test cgroup can go: cgroup v1's pids controller (these machines' hybrid layout), else cgroup v2's."""
EMPTY_WAIT_S = 10.0


class PodCgroup:
    """`kubepods/besteffort/pod<uid>/<container id>` under a writable hierarchy: the systemd-less cgroupfs layout."""

    def __init__(self, root: Path, *, pod_uid: str | None = None, container_id: str | None = None) -> None:
        self.pod_uid = pod_uid or str(uuid.uuid4())
        self.container_id = container_id or secrets.token_hex(32)
        self.top = root / f"mpsagent-test-{secrets.token_hex(4)}"
        self.path = self.top / "kubepods" / "besteffort" / f"pod{self.pod_uid}" / self.container_id
        self.path.mkdir(parents=True)

    def command(self, *argv: str) -> list[str]:
        """`argv`, run from a shell that first moves itself into this cgroup (before the program starts)."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh", *argv]

    def remove(self) -> None:
        """Remove the cgroups once the processes in them have ended (a bounded wait); again: nothing."""
        deadline = time.monotonic() + EMPTY_WAIT_S
        while self.path.exists() and (self.path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        for directory in (self.path, *self.path.parents):
            with contextlib.suppress(OSError):
                directory.rmdir()
            if directory == self.top:
                break


@contextmanager
def pod_cgroup(
    *, pod_uid: str | None = None, container_id: str | None = None, under: Path | None = None
) -> Iterator[PodCgroup]:
    """A cgroup named like a pod's container (a real pod's, given its UID and container ID; else made up), under the
    hierarchy `under` (else the first writable of HIERARCHIES); removed when the block ends (its processes must
    have ended)."""
    for root in HIERARCHIES if under is None else (under,):
        if (root / "cgroup.procs").is_file():
            try:
                made = PodCgroup(root, pod_uid=pod_uid, container_id=container_id)
            except OSError:
                continue
            try:
                yield made
            finally:
                made.remove()
            return
    raise RuntimeError(f"no writable cgroup hierarchy among {', '.join(map(str, HIERARCHIES))}")
