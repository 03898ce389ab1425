"""Finding the MPS control daemon that serves a pipe directory from /proc: the process listening on the
directory's `control` socket. The daemon host asks when a daemon answers but `daemon.json` names no live PID for it
(`daemon_host`), so that it can record the daemon again instead of refusing to keep it.

Reads only /proc (the `--proc-root` of the host, which the daemon host's pod shares through hostPID); a process
that cannot be read (another user's, gone meanwhile) is skipped. Blocking: call it from a worker thread.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import anyio

from mpsagent.base.errors import UnrecordedDaemonError
from mpsagent.base.host import pid_alive
from mpsagent.base.logs import get_logger
from mpsagent.domain.plan import ResourcePlan
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.daemon_status import ceiling_mode
from mpsagent.mps.state import DaemonState, StateFile

log = get_logger(__name__)

CONTROL_SOCKET = "control"
_LISTENING = 0x00010000  # __SO_ACCEPTCON in /proc/net/unix's Flags column


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonProcess:
    pid: int
    multi_user: bool
    """Started with `-M` (`--multiuser-server`)."""
    visible_devices: str | None
    """Its CUDA_VISIBLE_DEVICES; None when its environment cannot be read."""


def _listening_inodes(proc_root: Path, socket_path: Path) -> set[int]:
    """The inodes of the unix sockets listening at `socket_path`, from `net/unix`
    (`Num RefCount Protocol Flags Type St Inode Path`)."""
    try:
        lines = (proc_root / "net" / "unix").read_text(errors="replace").splitlines()[1:]
    except OSError:
        return set()
    inodes = set()
    for line in lines:
        fields = line.split(maxsplit=7)
        if len(fields) == 8 and fields[7] == str(socket_path):
            with contextlib.suppress(ValueError):
                if int(fields[3], 16) & _LISTENING:
                    inodes.add(int(fields[6]))
    return inodes


def _holds(process: Path, targets: set[str]) -> bool:
    try:
        descriptors = os.listdir(process / "fd")
    except OSError:
        return False
    for descriptor in descriptors:
        with contextlib.suppress(OSError):
            if os.readlink(process / "fd" / descriptor) in targets:
                return True
    return False


def _parent(process: Path) -> int | None:
    try:
        stat = (process / "stat").read_text(errors="replace")
        return int(stat[stat.rindex(")") + 1 :].split()[1])  # after the command name, which may hold anything
    except (OSError, ValueError, IndexError):
        return None


def _describe(process: Path, pid: int) -> DaemonProcess:
    try:
        argv = (process / "cmdline").read_bytes().split(b"\0")
    except OSError:
        argv = []
    devices = None
    with contextlib.suppress(OSError):
        for item in (process / "environ").read_bytes().split(b"\0"):
            name, _, value = item.partition(b"=")
            if name == b"CUDA_VISIBLE_DEVICES":
                devices = value.decode(errors="replace")
    return DaemonProcess(
        pid=pid, multi_user=bool({b"-M", b"--multiuser-server"} & set(argv[1:])), visible_devices=devices
    )


def find_daemons(proc_root: Path, pipe_directory: Path) -> list[DaemonProcess]:
    """The processes listening on `<pipe_directory>/control`, without those whose parent is one of them (an MPS
    server it started may hold the socket too): one for a daemon found, none or several when it cannot be told."""
    inodes = _listening_inodes(proc_root, pipe_directory / CONTROL_SOCKET)
    if not inodes:
        return []
    targets = {f"socket:[{inode}]" for inode in inodes}
    try:
        entries = [entry for entry in proc_root.iterdir() if entry.name.isdigit()]
    except OSError:
        return []
    holders = {int(entry.name): entry for entry in entries if _holds(entry, targets)}
    return [_describe(process, pid) for pid, process in sorted(holders.items()) if _parent(process) not in holders]


async def record_answering_daemon(resource: ResourcePlan, control_bin: str, proc_root: Path) -> None:
    """When a daemon answers on the resource's pipe directory but `daemon.json` names no live PID for it (damaged,
    removed, or naming a process that is gone), record the daemon found on the control socket again, so that the
    keeper and the agent adopt it instead of refusing it. Raises UnrecordedDaemonError naming the file and what to
    do when no single daemon is found; does nothing when the record names a live PID or no daemon answers.

    The rewritten record knows the daemon's PID, GPUs and user mode, not its ceilings: it says what a new daemon
    holds (the smallest share's caps where caps are enforced), and the agent sets the live grants' ceilings."""
    state_file = StateFile(resource.directory)
    state = state_file.read()
    if state is not None and pid_alive(state.pid):
        return
    if not await ControlChannel(control_bin, resource.pipe_directory).probe():
        return  # none answers: the keeper starts one
    if state is not None:
        problem = f"names PID {state.pid}, which is not running"
    elif state_file.damage is not None:
        problem = state_file.damage[1]
    else:
        problem = "is missing"
    found = await anyio.to_thread.run_sync(find_daemons, proc_root, resource.pipe_directory)
    if len(found) != 1:
        listening = "no process" if not found else f"{len(found)} processes ({', '.join(str(d.pid) for d in found)})"
        raise UnrecordedDaemonError(
            f"an MPS daemon answers on {resource.pipe_directory} but {state_file.path} {problem}, and {listening} "
            f"listening on {resource.pipe_directory / CONTROL_SOCKET} was found in {proc_root}; stop it (echo quit | "
            f"CUDA_MPS_PIPE_DIRECTORY={resource.pipe_directory} nvidia-cuda-mps-control) and start the daemon host "
            "again, or give it the host's /proc (hostPID, --proc-root)"
        )
    daemon = found[0]
    state_file.write(
        DaemonState(
            pid=daemon.pid,
            visible_devices=daemon.visible_devices or resource.visible_devices,
            mode=ceiling_mode(resource.shares.unreconciled_ceilings(), resource.shares.full_hardware()),
            multi_user=daemon.multi_user,
        )
    )
    log.warning(
        "daemon state rewritten",
        resource=resource.name,
        path=str(state_file.path),
        pid=daemon.pid,
        was=problem,
        hint="found by its control socket; its ceilings are set again by the agent",
    )
