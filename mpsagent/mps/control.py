"""The control-command channel: one `nvidia-cuda-mps-control` front-end session per command, serialized, each
with a timeout. Commands are checked before they are written, so nothing can inject a second command line."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

import anyio

from mpsagent.errors import DaemonCommandError
from mpsagent.plan import ControlStep

COMMAND_TIMEOUT_S = 5.0
_SAFE_COMMAND = re.compile(r"^[a-z_]+( [A-Za-z0-9.=,-]+)*$")
# What the front-end prints when it cannot reach a daemon, or the daemon refuses the command.
_FAILURE_MARKERS = ("Cannot find MPS control daemon", "Cannot send command", "Unknown command", "Invalid", "failed")


def check_command(command: str) -> str:
    if not _SAFE_COMMAND.match(command) or len(command) > 512:
        raise DaemonCommandError(f"refusing to send malformed MPS control command {command[:80]!r}")
    return command


class ControlChannel:
    """Talks to the control daemon listening on one pipe directory."""

    def __init__(self, control_bin: str, pipe_directory: Path, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self._bin = control_bin
        self._env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_directory)}
        self._timeout = timeout_s
        # Several front-end sessions at once confuse the daemon: one at a time.
        self._lock = anyio.Lock()

    async def send(self, command: str) -> str:
        """Send one command; returns the daemon's reply (stripped), raises DaemonCommandError on any failure."""
        check_command(command)
        async with self._lock:
            try:
                with anyio.fail_after(self._timeout):
                    returncode, output = await self._exchange(command)
            except TimeoutError:
                raise DaemonCommandError(f"`{command}` got no answer within {self._timeout:g}s") from None
            except OSError as exc:
                raise DaemonCommandError(
                    f"cannot run {self._bin} ({exc.strerror}); install nvidia-cuda-mps or set --mps-control-bin"
                ) from exc
        reply = output.decode(errors="replace").strip()
        if returncode != 0 or any(marker in reply for marker in _FAILURE_MARKERS):
            raise DaemonCommandError(f"`{command}` failed: {reply or f'exit status {returncode}'}")
        return reply

    async def _exchange(self, command: str) -> tuple[int, bytes]:
        """One front-end session: the command on stdin, then EOF; the reply is whatever it prints until it exits.
        (On a pipe the front-end holds its replies until EOF, so one command per session keeps replies apart.)"""
        async with await anyio.open_process(
            [self._bin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env
        ) as process:
            assert process.stdin is not None and process.stdout is not None
            # A front-end that finds no daemon exits before reading: its closed stdin is an answer, not an error.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await process.stdin.send(f"{command}\n".encode())
            await process.stdin.aclose()
            output = b"".join([chunk async for chunk in process.stdout])
            return await process.wait(), output

    async def apply(self, step: ControlStep) -> None:
        """Send a `set_` command and read it back; the daemon must hold exactly what was asked for."""
        await self.send(step.command)
        held = await self.send(step.read_back)
        if held != step.expected:
            raise DaemonCommandError(
                f"`{step.command}` did not hold: `{step.read_back}` reads {held!r}, expected {step.expected!r}"
            )

    async def probe(self, attempts: int = 2) -> bool:
        """True when the daemon answers a round trip; a failed probe is retried before the daemon is called dead."""
        for _ in range(attempts):
            try:
                await self.send("get_default_active_thread_percentage")
            except DaemonCommandError:
                continue
            return True
        return False

    async def server_pids(self) -> list[int]:
        reply = await self.send("get_server_list")
        return [int(token) for token in reply.split() if token.isdigit()]
