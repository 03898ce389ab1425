"""Starting one resource's `nvidia-cuda-mps-control` in the foreground, and waiting until it answers; the agent's
daemon supervisor and the daemon host (`mps.keeper`) both start daemons this way, so both start the same daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import anyio
from anyio.abc import Process
from structlog.typing import FilteringBoundLogger

from mpsagent.base.errors import DaemonError, FileRefusedError, UnrecordedDaemonError
from mpsagent.base.host import open_private_file, pid_alive
from mpsagent.base.values import MultiUser
from mpsagent.domain.plan import ResourcePlan
from mpsagent.mps.commands import daemon_launch, multi_user_server
from mpsagent.mps.control import ControlChannel, offers_multi_user
from mpsagent.mps.paths import PRIVATE_FILE_MODE
from mpsagent.mps.state import DaemonState, StateFile

START_TIMEOUT_S = 10.0
CONTROL_LOG = "control.log"


async def decide_multi_user(resource: ResourcePlan, control_bin: str, log: FilteringBoundLogger) -> bool:
    """Whether a daemon started for `resource` gets `-M`: the config, and what the binary offers. Raises
    ConfigError when the config demands what the binary lacks; warns once when `auto` finds it lacking."""
    offered = await anyio.to_thread.run_sync(offers_multi_user, control_bin)
    multi_user = multi_user_server(resource, offered, control_bin)
    if not multi_user and resource.multi_user is MultiUser.AUTO:
        log.warning(
            "mps daemon without a multi-user server: pods of different users take turns on its GPUs",
            control_bin=control_bin,
            hint="a client of another user than the running server's waits until every client of that server "
            "has left; run the pods as one user, or use a control binary whose -h lists --multiuser-server",
        )
    return multi_user


async def launch_daemon(resource: ResourcePlan, control_bin: str, *, multi_user: bool) -> tuple[Process, int]:
    """Start the daemon in a session of its own, its output appended to `<resource>/log/control.log`; returns it and
    where its lines begin in that file (the file's size before). Raises DaemonError when it cannot be started."""
    launch = daemon_launch(resource, control_bin, multi_user=multi_user)
    log_file = resource.log_directory / CONTROL_LOG
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        fd = open_private_file(log_file, flags, PRIVATE_FILE_MODE, what="the daemon log")
    except FileRefusedError as exc:
        raise DaemonError(f"{exc}; remove it") from exc
    except OSError as exc:
        raise DaemonError(f"cannot open the daemon log {log_file} ({exc.strerror})") from exc
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # a log left by an older version may be readable by all
        written = os.fstat(fd).st_size
        process = await anyio.open_process(
            list(launch.argv),
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            env=launch.environment(os.environ),
            start_new_session=True,  # a signal to its starter's process group (a Ctrl-C, systemd) does not reach it
        )
    except OSError as exc:
        raise DaemonError(
            f"cannot start {control_bin} ({exc.strerror}); install nvidia-cuda-mps or set --mps-control-bin"
        ) from exc
    finally:
        os.close(fd)
    return process, written


async def wait_answering(process: Process, resource: ResourcePlan, channel: ControlChannel) -> None:
    """Return once the daemon answers a round trip. Raises DaemonError when it exits or does not answer in time,
    and ControlRunError (leaving the daemon alone) when the front-end cannot even be run."""
    with anyio.move_on_after(START_TIMEOUT_S):
        while process.returncode is None:
            if await channel.probe(attempts=1):
                return
            await anyio.sleep(0.05)
    code = process.returncode
    raise DaemonError(
        f"the MPS control daemon for {resource.name} "
        + (f"exited with status {code}" if code is not None else f"did not answer within {START_TIMEOUT_S:g}s")
        + f"; see {resource.log_directory / CONTROL_LOG}"
    )


async def end_daemon(process: Process | None, pid: int | None) -> None:
    """Kill a failed or hung daemon before another is started: one of ours (`process`) is killed and reaped
    (bounded); an adopted one, known by its PID only, is sent SIGKILL."""
    if process is not None:
        if process.returncode is None:
            process.kill()
        with anyio.move_on_after(2):
            await process.wait()
    elif pid is not None and pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def recorded_daemon(
    resource: ResourcePlan, channel: ControlChannel, state_file: StateFile, *, restart: str
) -> DaemonState | None:
    """The recorded state of the daemon that answers on the resource's pipe directory; None when none answers.
    Raises UnrecordedDaemonError when one answers but `daemon.json` names no live PID for it (`restart` says what
    to start again once it is stopped)."""
    if not await channel.probe():
        return None
    state = state_file.read()
    if state is None or not pid_alive(state.pid):
        raise UnrecordedDaemonError(
            f"an MPS daemon already answers on {resource.pipe_directory} but no live PID is recorded in "
            f"{state_file.path}; stop it (echo quit | CUDA_MPS_PIPE_DIRECTORY={resource.pipe_directory} "
            f"nvidia-cuda-mps-control) and start {restart} again"
        )
    return state


async def wait_daemon_exit(process: Process | None, pid: int) -> int | None:
    """Return when the daemon exits: one of ours (`process`) with its exit status; an adopted one, known by its PID
    only, through a pidfd (None)."""
    if process is not None:
        return await process.wait()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        await anyio.wait_readable(pidfd)
    finally:
        os.close(pidfd)
    return None
