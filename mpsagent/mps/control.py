"""The control-command channel: `nvidia-cuda-mps-control` front-end sessions, serialized, each with a timeout.
Commands are checked before they are written, so nothing can inject another command line.

A session may carry several commands: the front-end prints the replies in order when its stdin ends. Every `get_`
command prints exactly one line, so a batch of `get_` commands reads back one line each; a batch of `set_`
commands is only checked for failures. A cap switch on 8 GPUs is then 2 sessions, not 18."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import anyio

from mpsagent.errors import DaemonCommandError
from mpsagent.plan import ControlStep

COMMAND_TIMEOUT_S = 5.0
_SAFE_COMMAND = re.compile(r"[a-z_]+( [A-Za-z0-9.=,-]+)*")
# What the front-end prints when it cannot reach a daemon, or the daemon refuses the command.
_FAILURE_MARKERS = ("Cannot find MPS control daemon", "Cannot send command", "Unknown command", "Invalid", "failed")


def check_command(command: str) -> str:
    if not _SAFE_COMMAND.fullmatch(command) or len(command) > 512:
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
        return await self.send_all([command])

    async def send_all(self, commands: Sequence[str]) -> str:
        """Send commands in one session; returns all replies (stripped), raises DaemonCommandError on any failure."""
        for command in commands:
            check_command(command)
        what = f"`{commands[0]}`" + (f" and {len(commands) - 1} more" if len(commands) > 1 else "")
        async with self._lock:
            try:
                with anyio.fail_after(self._timeout):
                    returncode, output = await self._exchange(commands)
            except TimeoutError:
                raise DaemonCommandError(f"{what} got no answer within {self._timeout:g}s") from None
            except OSError as exc:
                raise DaemonCommandError(
                    f"cannot run {self._bin} ({exc.strerror}); install nvidia-cuda-mps or set --mps-control-bin"
                ) from exc
        reply = output.decode(errors="replace").strip()
        if returncode != 0 or any(marker in reply for marker in _FAILURE_MARKERS):
            raise DaemonCommandError(f"{what} failed: {reply or f'exit status {returncode}'}")
        return reply

    async def _exchange(self, commands: Sequence[str]) -> tuple[int, bytes]:
        """One front-end session: the commands on stdin, then EOF; the replies are whatever it prints until it
        exits (on a pipe it holds them until EOF)."""
        async with await anyio.open_process(
            [self._bin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env
        ) as process:
            assert process.stdin is not None and process.stdout is not None
            # A front-end that finds no daemon exits before reading: its closed stdin is an answer, not an error.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await process.stdin.send("".join(f"{command}\n" for command in commands).encode())
            await process.stdin.aclose()
            output = b"".join([chunk async for chunk in process.stdout])
            return await process.wait(), output

    async def apply(self, steps: Sequence[ControlStep]) -> None:
        """Send the `set_` commands, then read each back: the daemon must hold exactly what was asked for."""
        await self.send_all([step.command for step in steps])
        replies = (await self.send_all([step.read_back for step in steps])).splitlines()
        if len(replies) != len(steps):
            raise DaemonCommandError(
                f"reading back {len(steps)} values gave {len(replies)} lines: {' | '.join(replies)[:200]!r}"
            )
        for step, held in zip(steps, replies, strict=True):
            if held.strip() != step.expected:
                raise DaemonCommandError(
                    f"`{step.command}` did not hold: `{step.read_back}` reads {held.strip()!r}, "
                    f"expected {step.expected!r}"
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
