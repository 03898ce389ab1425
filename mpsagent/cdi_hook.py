"""`mpsagent-cdi-hook`: the agent's CDI hook, which the container runtime runs on the host as a `createRuntime`
hook of a container given one of the agent's memory-limit devices (`mpsagent.io/memory-limit`): once the container's
cgroup exists and before its first process runs, it has the driver hold the container's cgroup to its share of each
GPU (NVML's per-cgroup memory limits, r615+), reads each limit back, and records the container for the agent.

    mpsagent-cdi-hook apply-memory-limits --records DIR --limit GPU-UUID=MIB [--limit ...]   < OCI state

It calls NVML itself and needs no running agent: a container starts capped while the agent is down too. Anything
that keeps a limit from holding (the container has no cgroup v2 directory of its own, NVML refuses, the limit reads
back otherwise) is an error naming the container, the GPU and why: exit 1, and the runtime does not start the
container, so that no capped container ever starts uncapped without a word. What it did, and when, is appended to
`DIR/hook.log`; each container it limited is recorded in `DIR/<container id>.json` (`record`), which the agent reads
back (`gpu.limits_watch`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from mpsagent.base.clock import utc
from mpsagent.base.devices import GpuUuid, is_gpu_uuid
from mpsagent.base.errors import MemoryLimitError, shown
from mpsagent.base.host import write_atomically
from mpsagent.base.procfs import cgroup2_place
from mpsagent.base.values import MIB
from mpsagent.gpu.limits_watch import ContainerRecord, RecordedLimit
from mpsagent.gpu.nvml import NvmlMemoryLimits
from mpsagent.gpu.port import MemoryLimits

APPLY = "apply-memory-limits"
MAX_STATE_BYTES = 64 * 1024
MAX_LIMITS = 64
RECORD_MODE = 0o600
LOG_FILE = "hook.log"
MAX_LOG_BYTES = 1 << 20
"""Past this, the log is moved to `hook.log.1` (one kept) before the next line."""
_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class HookError(Exception):
    """Why the limits cannot be set: the container must not start."""


class _State(msgspec.Struct, kw_only=True):
    """What the runtime tells a hook on its standard input (the OCI runtime spec's state)."""

    id: str
    pid: int


def _limit(text: str) -> RecordedLimit:
    uuid, sep, mib = text.partition("=")
    if not sep or not is_gpu_uuid(uuid) or not mib.isdigit() or not 0 < int(mib) < 1 << 32:
        raise argparse.ArgumentTypeError(f"--limit must be GPU-UUID=MIB, not `{shown(text)}`")
    return RecordedLimit(uuid=uuid, hard_bytes=int(mib) * MIB)


def container_cgroup(pid: int, proc: Path = Path("/proc")) -> str:
    """The cgroup v2 directory of the container whose process is `pid`, as the host sees it. Raises HookError when
    it has none of its own (no cgroup v2 on the node, or the runtime left the container in the root)."""
    try:
        place = cgroup2_place(str(pid), proc)
    except OSError as exc:
        raise HookError(f"cannot read the cgroup of the container's process {pid} ({exc.strerror})") from exc
    if place is None:
        raise HookError("the node has no cgroup v2, which the driver's memory limits need")
    if place.in_root:
        raise HookError(f"the container's process {pid} has no cgroup v2 directory of its own (it is in the root)")
    return place.directory


def apply(limits: Sequence[RecordedLimit], cgroup: str, driver: MemoryLimits) -> None:
    """Set each limit on the cgroup and read it back. Raises HookError naming the GPU."""
    for limit in limits:
        uuid = GpuUuid(limit.uuid)
        try:
            driver.set_hard_limit(uuid, cgroup, limit.hard_bytes)
            held = driver.read(uuid, cgroup)
        except MemoryLimitError as exc:
            raise HookError(str(exc)) from exc
        if held is None or held.hard_bytes != limit.hard_bytes:
            found = "no cgroup" if held is None else f"hard limit {held.hard_bytes}"
            raise HookError(f"the memory limit of {cgroup} on {uuid} reads back {found}, not {limit.hard_bytes}")


def _append_log(records: Path, entry: dict[str, object]) -> None:
    path = records / LOG_FILE
    try:
        if path.stat().st_size > MAX_LOG_BYTES:
            path.replace(records / f"{LOG_FILE}.1")
    except FileNotFoundError:
        pass
    with path.open("a") as log:
        log.write(json.dumps(entry) + "\n")


def run(args: argparse.Namespace, state_text: bytes, driver: MemoryLimits) -> ContainerRecord:
    """Limit the container the state names; its record, written. Raises HookError."""
    if len(state_text) > MAX_STATE_BYTES:
        raise HookError(f"the container runtime's state on standard input is over {MAX_STATE_BYTES} bytes")
    try:
        state = msgspec.json.decode(state_text, type=_State)
    except msgspec.DecodeError as exc:
        raise HookError(f"the container runtime's state on standard input is not what OCI says ({exc})") from exc
    if not _CONTAINER_ID.fullmatch(state.id):
        raise HookError(f"the container ID `{shown(state.id)}` is not one the hook names a file after")
    cgroup = container_cgroup(state.pid)
    apply(args.limit, cgroup, driver)
    record = ContainerRecord(
        container_id=state.id, pid=state.pid, cgroup=cgroup, limits=tuple(args.limit), set_at=utc(time.time())
    )
    write_atomically(args.records / f"{state.id}.json", msgspec.json.encode(record), RECORD_MODE, what="the record")
    return record


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpsagent-cdi-hook", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    apply_parser = commands.add_parser(APPLY, help="set the container's memory limits (a createRuntime hook)")
    apply_parser.add_argument("--records", type=Path, required=True, help="where containers are recorded")
    apply_parser.add_argument("--limit", type=_limit, action="append", required=True, help="GPU-UUID=MIB")
    return parser


def main(argv: Sequence[str] | None = None, driver: MemoryLimits | None = None) -> int:
    args = _parser().parse_args(argv)
    if len(args.limit) > MAX_LIMITS:
        print(f"mpsagent-cdi-hook: at most {MAX_LIMITS} --limit", file=sys.stderr)
        return 2
    started = time.time()
    state_text = sys.stdin.buffer.read(MAX_STATE_BYTES + 1)
    try:
        args.records.mkdir(mode=0o700, parents=True, exist_ok=True)
        record = run(args, state_text, driver or NvmlMemoryLimits())
    except (HookError, OSError) as exc:
        message = f"mpsagent-cdi-hook: the container's GPU memory limits were not set, so it does not start: {exc}"
        print(message, file=sys.stderr)
        with contextlib.suppress(OSError):  # the message above is what the runtime reports
            _append_log(args.records, {"at": started, "event": "memory limits not set", "reason": str(exc)})
        return 1
    _append_log(
        args.records,
        {
            "at": started,
            "done": time.time(),
            "event": "memory limits set",
            "container": record.container_id,
            "cgroup": record.cgroup,
            "limits": {limit.uuid: limit.hard_bytes for limit in record.limits},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
