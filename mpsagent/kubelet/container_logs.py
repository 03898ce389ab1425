"""The names of the node's containers, from the links the kubelet keeps in `/var/log/containers` (`--container-logs-
dir`): one per container it runs, `<pod>_<namespace>_<container>-<container id>.log`, made before the container
starts and removed with it, pointing at `<pod logs dir>/<namespace>_<pod>_<pod uid>/<container>/<n>.log`. The
stowaway watch reads them to name the pod of a GPU process: its cgroup gives only the pod's UID.

Names and namespaces cannot hold `_` (DNS labels and subdomains), so the fields split without doubt; the target is
read (not followed: it may not be mounted where the agent runs) because the kubelet cuts a link's name that would
pass 255 bytes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mpsagent.base.devices import ContainerRef

MAX_LINKS = 16384
"""A node runs a few hundred containers; a directory with more entries than this is read this far."""
_LINK = re.compile(r"[^_/]+_[^_/]+_[^/]+-(?P<id>[0-9a-f]{64})\.log")
_TARGET = re.compile(
    r"/(?P<namespace>[^_/]+)_(?P<pod>[^_/]+)_(?P<uid>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
    r"/(?P<container>[^/]+)/[0-9]+\.log$"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class NamedContainer:
    """A container as the kubelet's link names it: its pod's UID and its names."""

    pod_uid: str
    ref: ContainerRef


def container_names(directory: Path) -> dict[str, NamedContainer]:
    """Each container ID the kubelet's links name, with its pod and names. Raises OSError when the directory cannot
    be read."""
    found: dict[str, NamedContainer] = {}
    with os.scandir(directory) as entries:
        for count, entry in enumerate(entries):
            if count == MAX_LINKS:
                break
            link = _LINK.fullmatch(entry.name)
            if link is None or not entry.is_symlink():
                continue
            try:
                target = _TARGET.search(os.readlink(entry.path))
            except OSError:
                continue  # removed since the listing: its container is gone
            if target is not None:
                found[link["id"]] = NamedContainer(
                    pod_uid=target["uid"],
                    ref=ContainerRef(namespace=target["namespace"], pod=target["pod"], container=target["container"]),
                )
    return found
