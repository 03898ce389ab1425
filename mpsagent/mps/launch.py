"""Starting one resource's `nvidia-cuda-mps-control` in the foreground until it answers; the agent's daemon
supervisor and the daemon host both start daemons this way, so both start the same daemon."""

from __future__ import annotations

import os
import subprocess

import anyio
from anyio.abc import Process

from mpsagent.errors import DaemonError
from mpsagent.host import FileRefusedError, open_private_file
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.paths import PRIVATE_FILE_MODE
from mpsagent.plan import ResourcePlan, daemon_launch

START_TIMEOUT_S = 10.0
CONTROL_LOG = "control.log"


async def start_daemon(resource: ResourcePlan, control_bin: str, channel: ControlChannel) -> Process:
    """Start the daemon in a session of its own, its output appended to `<resource>/log/control.log`; returns
    once it answers a round trip. Raises DaemonError (the process killed and reaped) when it cannot start."""
    launch = daemon_launch(resource, control_bin)
    log_file = resource.log_directory / CONTROL_LOG
    try:
        fd = open_private_file(
            log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE_MODE, what="the daemon log"
        )
    except FileRefusedError as exc:
        raise DaemonError(f"{exc}; remove it") from exc
    except OSError as exc:
        raise DaemonError(f"cannot open the daemon log {log_file} ({exc.strerror})") from exc
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # a log left by an older version may be readable by all
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
    with anyio.move_on_after(START_TIMEOUT_S):
        while process.returncode is None:
            if await channel.probe(attempts=1):
                return process
            await anyio.sleep(0.05)
    code = process.returncode
    await stop_process(process)
    raise DaemonError(
        f"the MPS control daemon for {resource.name} "
        + (f"exited with status {code}" if code is not None else f"did not answer within {START_TIMEOUT_S:g}s")
        + f"; see {log_file}"
    )


async def stop_process(process: Process) -> None:
    """Kill a daemon process of ours and reap it (bounded)."""
    if process.returncode is None:
        process.kill()
    with anyio.move_on_after(2):
        await process.wait()
