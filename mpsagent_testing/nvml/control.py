"""Drive the fake NVML (fake_nvml.c) from outside the processes that load it.

The fake reads two files that stand in for the driver (see the header of fake_nvml.c):

* the state file (``FAKE_NVML_STATE``), a JSON object re-read on every device call::

    {"computeModes": {"GPU-...": 3}, "lost": ["GPU-..."],
     "processes": {"GPU-...": [{"pid": 1234, "usedGpuMemory": 1048576}]},
     "mpsProcesses": {"GPU-...": [...]},
     "processUtilization": {"GPU-...": [{"pid": 1234, "smUtil": 40, "memUtil": 10, "timeStamp": 1764547200250000}]},
     "memoryLimits": {"/sys/fs/cgroup/...": {"GPU-...": {"soft": 0, "hard": 1073741824, ...}}}}

  Changed here read-modify-write under an exclusive flock of ``<state>.lock`` (the lock the C code
  takes) and replaced atomically (temp file + rename), so readers never see half a file.
* the events file (``FAKE_NVML_EVENTS``), JSON lines appended with one ``write()`` each, which
  event sets created before the append deliver from ``nvmlEventSetWait``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

CgroupLayout = Literal["unified", "hybrid", "legacy"]
"""The config's "cgroupLayout": cgroup v2 at /sys/fs/cgroup, at /sys/fs/cgroup/unified, or none."""

# nvmlEventType* bits, as in nvml.h and pynvml.
EVENT_SINGLE_BIT_ECC_ERROR = 0x1
EVENT_DOUBLE_BIT_ECC_ERROR = 0x2
EVENT_PSTATE = 0x4
EVENT_XID_CRITICAL_ERROR = 0x8


class FakeNvmlDriver:
    """Loses and finds GPUs, sets running processes and their utilization and emits events for the fake NVML."""

    def __init__(self, state_path: Path, events_path: Path | None = None) -> None:
        self.state_path = Path(state_path)
        self.events_path = None if events_path is None else Path(events_path)

    # -- events ------------------------------------------------------------------------------

    def emit_xid(self, uuid: str, xid: int) -> None:
        """An Xid critical error (eventType 0x8, eventData ``xid``) on the GPU ``uuid``."""
        self._append({"uuid": uuid, "xid": xid})

    def emit_event(self, uuid: str, event_type: int, data: int = 0) -> None:
        """An event of ``event_type`` (one of the EVENT_* bits) with ``data`` on the GPU ``uuid``."""
        self._append({"uuid": uuid, "eventType": event_type, "eventData": data})

    def fail_next_wait(self, code: int) -> None:
        """Every existing event set's next wait returns the nvmlReturn_t ``code`` once."""
        if code == 0:
            raise ValueError("code must be a non-zero nvmlReturn_t")
        self._append({"error": code})

    def _append(self, record: dict[str, Any]) -> None:
        if self.events_path is None:
            raise ValueError("this FakeNvmlDriver has no events_path")
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            written = os.write(fd, line)  # one write: readers never see a line split in two
        finally:
            os.close(fd)
        if written != len(line):
            raise OSError(f"short write to {self.events_path}: {written} of {len(line)} bytes")

    # -- state ---------------------------------------------------------------------------------

    def lose(self, uuid: str) -> None:
        """From now on every call but nvmlDeviceGetHandleBy*/GetUUID on ``uuid`` is GPU_IS_LOST."""
        with self.update() as state:
            lost = state.setdefault("lost", [])
            if uuid not in lost:
                lost.append(uuid)

    def find(self, uuid: str) -> None:
        """Undo lose(``uuid``); a GPU the config marks lost stays lost."""
        with self.update() as state:
            state["lost"] = [u for u in state.get("lost", []) if u != uuid]

    def lost(self) -> list[str]:
        """The UUIDs the state file lists as lost."""
        return list(self.read().get("lost", []))

    def set_processes(self, uuid: str, processes: Iterable[tuple[int, int | None]], mps: bool = False) -> None:
        """Replace the (pid, usedGpuMemory bytes) list of ``uuid``; ``None`` bytes is "not available".

        ``mps`` selects nvmlDeviceGetMPSComputeRunningProcesses* instead of
        nvmlDeviceGetComputeRunningProcesses*.
        """
        entries = [{"pid": pid, "usedGpuMemory": used} for pid, used in processes]
        self._set_gpu_list("mpsProcesses" if mps else "processes", uuid, entries)

    def set_process_utilization(self, uuid: str, samples: Iterable[tuple[int, int]]) -> None:
        """Replace the (pid, smUtil percent) utilization samples of ``uuid``; none leaves it without samples.

        They carry no timeStamp, so nvmlDeviceGetProcessUtilization / nvmlDeviceGetProcessesUtilizationInfo stamp
        them with the time of the call: every read sees them as new, as a busy process's samples would be.
        """
        entries = [{"pid": pid, "smUtil": sm_util} for pid, sm_util in samples]
        for entry in entries:
            if not 0 <= entry["smUtil"] <= 100:
                raise ValueError(f"smUtil of pid {entry['pid']} on {uuid} must be in [0, 100], not {entry['smUtil']}")
        self._set_gpu_list("processUtilization", uuid, entries)

    def _set_gpu_list(self, key: str, uuid: str, entries: list[dict[str, Any]]) -> None:
        """Make ``entries`` the state's ``key`` list of the GPU ``uuid``; an empty one removes the GPU's entry."""
        with self.update() as state:
            table = state.setdefault(key, {})
            if entries:
                table[uuid] = entries
            else:
                table.pop(uuid, None)

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        """What another process's nvmlDeviceSetComputeMode would leave behind."""
        with self.update() as state:
            state.setdefault("computeModes", {})[uuid] = mode

    def memory_limits(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The per-cgroup memory limits nvmlDeviceSetMemoryLimits_v1 left: {cgroup path: {uuid: limit}}.

        Each limit is ``{"soft": bytes, "hard": bytes, "setAt": epoch seconds, "setBy": pid}``; a path is stored as
        the caller gave it, without a trailing slash.
        """
        limits: dict[str, dict[str, dict[str, Any]]] = self.read().get("memoryLimits", {})
        return limits

    def memory_limit(self, namespace: str, uuid: str) -> dict[str, Any] | None:
        """The limit set on the GPU ``uuid`` for the cgroup directory ``namespace``; None when there is none."""
        return self.memory_limits().get(namespace.rstrip("/"), {}).get(uuid)

    def read(self) -> dict[str, Any]:
        """The state file's contents; {} while it does not exist."""
        try:
            text = self.state_path.read_text()
        except FileNotFoundError:
            return {}
        state = json.loads(text)
        if not isinstance(state, dict):
            raise ValueError(f"{self.state_path}: not a JSON object")
        return state

    @contextlib.contextmanager
    def update(self) -> Iterator[dict[str, Any]]:
        """Read-modify-write the state under the fake's lock: edit the yielded dict in place."""
        lock_path = self.state_path.with_name(self.state_path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            state = self.read()
            yield state
            self._replace(state)
        finally:
            os.close(fd)  # releases the flock

    def _replace(self, state: dict[str, Any]) -> None:
        tmp_fd, tmp_name = tempfile.mkstemp(prefix=f".{self.state_path.name}.", dir=self.state_path.parent)
        try:
            with os.fdopen(tmp_fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                json.dump(state, f)
                f.write("\n")
            os.replace(tmp_name, self.state_path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
