"""The spec of the agent's memory-limit devices (`mpsagent.io/memory-limit`), which both routes name for a capped
container on a GPU whose driver limits memory per cgroup: one file, `<cdi dir>/mpsagent.io-memory-limit.json`, with a
device for each set of limits a live grant or claim holds, each carrying the agent's hook (`mpsagent-cdi-hook`),
which sets them on the container's cgroup before its first process runs.

A device must be in the file before the kubelet hands its name to the container runtime: an Allocate and a prepare
`ensure` theirs before they answer. The file is rewritten whole (atomically) when a device is new, with the devices
of every live grant and claim then (so that it never grows beyond them), and at start (`rewrite`): a container the
kubelet restarts while its grant lives finds its device, whether or not the agent runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpsagent.domain.container import MEMORY_LIMIT_CDI_KIND, MemoryLimitDevice
from mpsagent.kubelet.cdi_spec import CdiDevice, Hook, write_spec

EnsureLimitDevices = Callable[[Sequence[MemoryLimitDevice | None]], None]
"""Have the memory-limit devices' CDI spec hold these (None: a share the driver does not limit) before an answer
names them, on either route (`MemoryLimitDevices.ensure`); raises HostError when it cannot be written."""

SPEC_FILE = MEMORY_LIMIT_CDI_KIND.replace("/", "-") + ".json"
"""`mpsagent.io-memory-limit.json`: CDI's convention for spec file names."""
HOOK_PROGRAM = "mpsagent-cdi-hook"
APPLY = "apply-memory-limits"

LiveDevices = Callable[[], Iterable[MemoryLimitDevice]]
"""The memory-limit devices of every live grant and claim of the node, now."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HookCommand:
    """How the container runtime runs the agent's hook: its path on the host, and where it records containers."""

    path: Path
    records: Path

    def hook(self, device: MemoryLimitDevice) -> Hook:
        limits = [arg for limit in device.limits for arg in ("--limit", f"{limit.uuid}={limit.mib}")]
        return Hook(path=str(self.path), args=(HOOK_PROGRAM, APPLY, "--records", str(self.records), *limits))


class MemoryLimitDevices:
    """The memory-limit devices' spec file; `ensure` and `rewrite` may run in any thread."""

    def __init__(self, *, spec_dir: Path, hook: HookCommand, live: LiveDevices) -> None:
        self.path = spec_dir / SPEC_FILE
        self._hook = hook
        self._live = live
        self._lock = threading.Lock()
        self._written: frozenset[MemoryLimitDevice] | None = None

    def ensure(self, devices: Iterable[MemoryLimitDevice | None]) -> None:
        """Have the spec hold `devices` (a share without driver limits gives None), rewriting it when any is new.
        Raises HostError when it cannot be written."""
        wanted = {device for device in devices if device is not None}
        with self._lock:
            if self._written is not None and wanted <= self._written:
                return
            self._write(wanted)

    def rewrite(self) -> None:
        """The spec as the live grants and claims need it: at start, before the kubelet asks anything."""
        with self._lock:
            self._write(set())

    def _write(self, wanted: set[MemoryLimitDevice]) -> None:
        devices = frozenset(wanted | set(self._live()))
        spec = [
            CdiDevice(name=device.name, envs={}, mounts=(), hooks=(self._hook.hook(device),))
            for device in sorted(devices, key=lambda d: d.limits)
        ]
        write_spec(self.path, MEMORY_LIMIT_CDI_KIND, spec, what="the memory-limit devices' CDI spec")
        self._written = devices
