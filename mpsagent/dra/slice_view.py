"""What the API server has: the driver's ResourceSlices on the node as the slice publisher last saw them (listed,
watched, or in its own write's answer), and the agent's own writes remembered. Plain synchronous state: the
publisher's watcher (`slice_watch`) fills it, its writer (`slice_writer`) reads it and tells it what it wrote.

The watch's word of the agent's own writes is no one else's edit, however late it comes: the view keeps the
resourceVersion the server gave each of its applies and the UID of each slice it deleted, and an event carrying one
of those changes nothing. Every other event newer than the view is taken (the server's resourceVersions order
where they are numbers, as the API server's are; others by arrival).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lightkube.resources.resource_v1 import ResourceSlice

from mpsagent.dra.api import MAX_LISTED_SLICES
from mpsagent.dra.slice_object import slice_name

OWN_WRITES_KEPT = 32
"""The agent's own applies and deletes remembered, to know the watch's word of them (which comes within moments)."""


@dataclass(frozen=True, slots=True)
class _Seen:
    """A slice as the view last saw it, with its resourceVersion as a number (None: not one); `item` None: the
    node's slice is known to be gone (so that an older answer does not bring it back into the view)."""

    version: int | None
    item: ResourceSlice | None


def _version(text: str | None) -> int | None:
    """A resourceVersion as a number, to order what the watch, a list and a write's answer say; the API server's
    are decimal (etcd's revision), anything else orders by arrival."""
    return int(text) if text and len(text) <= 20 and text.isascii() and text.isdigit() else None


def _newer(version: int | None, than: int | None) -> bool:
    return version is None or than is None or version > than


class SliceView:
    """The server's slices of `driver` on `node`, by name (at most MAX_LISTED_SLICES), and the agent's own writes."""

    def __init__(self, *, driver: str, node: str) -> None:
        self.driver = driver
        self.node = node
        self.name = slice_name(node, driver)
        """The name of the node's one slice of the driver."""
        self._seen: dict[str, _Seen] = {}
        self._written: deque[str] = deque(maxlen=OWN_WRITES_KEPT)
        """The resourceVersions the server gave the agent's applies: the view holds each from the answer already,
        or something newer."""
        self._deleted: deque[str] = deque(maxlen=OWN_WRITES_KEPT)
        """The UIDs of the slices the agent deleted (a delete's answer carries no resourceVersion): whatever the
        watch says of one of them is older than that delete."""
        self.listed = False
        """The view was listed once: the writer may compare."""
        self.fresh = False
        """The last list worked: what the writer finds in the view is the server's word."""

    def node_slice(self) -> ResourceSlice | None:
        """The node's slice as the server holds it (None: it has none)."""
        own = self._seen.get(self.name)
        return own.item if own is not None else None

    def others(self) -> dict[str, ResourceSlice]:
        """The driver's other slices on the node, by name: none should be there."""
        return {name: seen.item for name, seen in self._seen.items() if name != self.name and seen.item}

    def names(self) -> set[str]:
        """The names of the slices the view holds, and the node's slice's in any case."""
        return {self.name, *(name for name, seen in self._seen.items() if seen.item is not None)}

    def ours(self, item: ResourceSlice) -> str | None:
        """The slice's name when it is one of the driver's on the node (the watch's objects are untrusted)."""
        name = item.metadata.name if item.metadata else None
        spec = item.spec
        return name if name and spec.driver == self.driver and spec.nodeName == self.node else None

    def own_write(self, item: ResourceSlice) -> bool:
        """Whether the watch's `item` is word of the agent's own write: an apply's resourceVersion, or a slice the
        agent deleted."""
        metadata = item.metadata
        return metadata is not None and (metadata.resourceVersion in self._written or metadata.uid in self._deleted)

    def saw(self, item: ResourceSlice, *, gone: bool = False) -> bool:
        """Take `item` (from the watch or a write's answer) into the view unless it is not ours or older than
        what the view holds; whether the view changed."""
        name = self.ours(item)
        if name is None:
            return False
        held = self._seen.get(name)
        version = _version(item.metadata.resourceVersion if item.metadata else None)
        if held is not None and not (_newer(version, held.version) or (gone and version == held.version)):
            return False  # older than the view (a deletion at the same version: a server that keeps it)
        if held is None and (gone or len(self._seen) >= MAX_LISTED_SLICES):
            return False  # a slice the view cannot hold is seen at the next list
        if not gone:
            self._seen[name] = _Seen(version, item)
        elif name == self.name:
            self._seen[name] = _Seen(version, None)
        else:
            del self._seen[name]
        return True

    def take_list(self, items: list[ResourceSlice], version: str) -> None:
        """The view as listed at `version`, except what it holds newer (a write's answer that came first)."""
        listed = _version(version)
        seen = {}
        for item in items:
            name = self.ours(item)
            if name is not None:
                seen[name] = _Seen(_version(item.metadata.resourceVersion if item.metadata else None), item)
        seen.setdefault(self.name, _Seen(listed, None))
        for name, now in seen.items():
            held = self._seen.get(name)
            if held is not None and held.version is not None and now.version is not None:
                seen[name] = held if held.version > now.version else now
        self._seen = seen
        self.listed = self.fresh = True

    def applied(self, written: ResourceSlice) -> None:
        """The server's answer to the agent's apply: taken into the view, its resourceVersion remembered."""
        self.saw(written)
        if written.metadata is not None and written.metadata.resourceVersion:
            self._written.append(written.metadata.resourceVersion)

    def uid(self, name: str) -> str | None:
        """The UID of the slice `name` as the view holds it."""
        held = self._seen.get(name)
        return held.item.metadata.uid if held and held.item and held.item.metadata else None

    def deleted(self, uid: str | None) -> None:
        """The agent deleted the slice of `uid` (None: one the view did not hold)."""
        if uid:
            self._deleted.append(uid)

    def forget(self, name: str) -> None:
        """The slice `name` is deleted: the view holds it no more."""
        self._seen.pop(name, None)
