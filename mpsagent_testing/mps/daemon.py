"""Asking the MPS control daemon that an agent under test started: through the real `nvidia-cuda-mps-control`
(Debian's nvidia-cuda-mps package; `scripts/install-system-deps.sh` installs it), where its pipe is, its PID; a
root session held open on it, as an administrator's; a daemon of a test's own."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import pytest

from mpsagent_testing.cgroups import PodCgroup
from mpsagent_testing.waiting import wait_for

REAL_BIN = shutil.which("nvidia-cuda-mps-control")
"""The real front-end, or None where it is not installed (`require_real_control`)."""


def require_real_control() -> None:
    """Skip the calling test module where the real front-end is missing; in CI, where it must be, fail instead."""
    if REAL_BIN is not None:
        return
    if os.environ.get("CI"):
        raise RuntimeError("nvidia-cuda-mps-control is missing in CI: scripts/install-system-deps.sh installs it")
    pytest.skip("nvidia-cuda-mps-control not installed (run scripts/install-system-deps.sh)", allow_module_level=True)


_ANSWER_CHECK = "get_default_active_thread_percentage"
"""Ends every test session: it always prints a line, so a session the daemon left unanswered shows."""
_ANSWER_CHECK_LINE = re.compile(r"\d+\.\d+")
BUSY_WAIT_S = 10.0
"""How long a test's session is asked again while the daemon refuses it."""


def session(pipe: Path, text: str) -> subprocess.CompletedProcess[str]:
    """One control session through the real front-end, `text` its input (command lines), as sent: no retry."""
    if REAL_BIN is None:
        raise RuntimeError("nvidia-cuda-mps-control is not installed: run scripts/install-system-deps.sh")
    return subprocess.run(
        [REAL_BIN],
        input=text,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
    )


def control(pipe: Path, command: str) -> str:
    """The daemon's answer to `command` (one or more lines), through the real front-end. While another session is
    open (the agent's read-back of its ceilings, every probe interval) the daemon closes a new one unanswered: the
    front-end prints "Cannot send command", or nothing at all. Such a session is asked again, for at most
    BUSY_WAIT_S, so that a test reads the daemon's answer, and a `set_` it sends has reached the daemon."""
    deadline = time.monotonic() + BUSY_WAIT_S
    while True:
        result = session(pipe, f"{command}\n{_ANSWER_CHECK}\n")
        answer, _, check = result.stdout.strip().rpartition("\n")
        if _ANSWER_CHECK_LINE.fullmatch(check):
            return answer.strip()
        printed = (result.stdout + result.stderr).strip()
        if printed and "Cannot send command" not in printed:
            return printed  # no daemon to answer: "Cannot find MPS control daemon process"
        if time.monotonic() > deadline:
            raise AssertionError(f"the control daemon on {pipe} left `{command}` unanswered for {BUSY_WAIT_S:g}s")
        time.sleep(0.02)


def pipe_of(short_dir: Path) -> Path:
    """The pipe directory of `nvidia.com/gpu`'s daemon under `short_dir / "mps"`."""
    return short_dir / "mps" / "nvidia.com" / "gpu" / "pipe"


def daemon_pid(short_dir: Path) -> int:
    """The PID that `nvidia.com/gpu`'s daemon record under `short_dir / "mps"` names."""
    return int(json.loads((short_dir / "mps" / "nvidia.com" / "gpu" / "daemon.json").read_text())["pid"])


def refused(pipe: Path) -> bool:
    """Whether the daemon refuses a session now: another one is open ("Cannot send command to MPS control daemon
    process"), as it answers every session but the first."""
    result = session(pipe, "get_server_list\n")
    return "Cannot send command" in result.stdout + result.stderr


@contextmanager
def held_session(pipe: Path, *, first: str = "", pod: PodCgroup | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A root control session kept open, as an administrator at the `nvidia-cuda-mps-control` prompt (or a root
    process in a client container, which has the pipe directory) holds one: the real front-end with its stdin
    open, having sent `first` (command lines) and kept going, in `pod`'s cgroup when given (else the test's). While
    it is open the daemon refuses every other session; it closes when the block ends."""
    session = _open_session(pipe, pod)
    try:
        if first:
            assert session.stdin is not None
            session.stdin.write(first.encode())
            session.stdin.flush()
        yield session
    finally:
        assert session.stdin is not None
        session.stdin.close()  # end of input: the front-end closes its session and exits
        try:
            session.wait(10)
        except subprocess.TimeoutExpired:
            session.kill()
            session.wait(10)


def _open_session(pipe: Path, pod: PodCgroup | None) -> subprocess.Popen[bytes]:
    """A front-end whose session is open: it opens as the front-end starts, before it reads a command, and is open
    once another session is refused while it still runs; one that was itself refused (another session was open
    as it started: the agent's, or the check's) has exited, and is started again. In `pod`'s cgroup from before it
    connects (its shell joins it, then runs the front-end)."""
    if REAL_BIN is None:
        raise RuntimeError("nvidia-cuda-mps-control is not installed: run scripts/install-system-deps.sh")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        session = subprocess.Popen(
            [REAL_BIN] if pod is None else pod.command(REAL_BIN),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
            start_new_session=True,
        )
        while session.poll() is None and time.monotonic() < deadline:
            if refused(pipe) and session.poll() is None:
                return session
            time.sleep(0.01)
        session.kill()
        session.wait(10)
    raise RuntimeError(f"no control session on {pipe} stayed open")


SILENT_HOLDER = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.recv(64)  # the daemon's hello; then nothing is ever sent
print("connected", flush=True)
s.recv(64)  # returns when the connection is ended
print("ended", flush=True)
time.sleep(600)
"""


@contextmanager
def silent_connection(pipe: Path, *, pod: PodCgroup | None = None) -> Iterator[subprocess.Popen[str]]:
    """A process that connects to the daemon's `control` socket (any user can: mode 0666), reads its hello and sends
    nothing, as `socat` in a tenant's container would: the daemon waits for its credentials with no timeout,
    serving no one else. It prints `connected`, then `ended` if its connection is ended (and stays, as a tenant's
    process would); in `pod`'s cgroup when given. Killed when the block ends."""
    argv = [sys.executable, "-c", SILENT_HOLDER, str(pipe / "control")]
    holder = subprocess.Popen(
        argv if pod is None else pod.command(*argv),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "connected":
            raise RuntimeError(f"no connection to {pipe / 'control'} was made")
        yield holder
    finally:
        holder.kill()
        holder.wait(10)


@contextmanager
def plain_daemon(directory: Path, *, logged: bool = True) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A control daemon of its own (no agent) with its pipe and log directories under `directory` (made when
    missing), in a session of its own, its output in `log/control.log` as the agent starts one (not `logged`: to
    nowhere, as a daemon someone else started whose log the agent cannot see); its pipe directory and process,
    killed and reaped when the block ends."""
    if REAL_BIN is None:
        raise RuntimeError("nvidia-cuda-mps-control is not installed: run scripts/install-system-deps.sh")
    pipe, logs = directory / "pipe", directory / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    with (logs / "control.log").open("ab") if logged else open(os.devnull, "wb") as output:
        daemon = subprocess.Popen(
            [REAL_BIN, "-f"], env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 10
        while control(pipe, "get_default_active_thread_percentage") != "100.0":
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the control daemon on {pipe} did not answer")
            time.sleep(0.02)
        if logged:  # the probe's session in the log (it comes a moment after the answer), so that a test counts its own
            wait_for(lambda: sessions_closed(logs / "control.log"), 10, "the readiness probe's session in the log")
        yield pipe, daemon
    finally:
        daemon.kill()
        daemon.wait(10)


def sessions_closed(log: Path, last_command: str | None = None) -> bool:
    """Whether the daemon's log shows a control session (with `last_command` in it, when given) and every session it
    shows closed: the daemon writes a session's lines a moment after its answers, so a test reads the log once this
    holds."""
    text = log.read_text(errors="replace")
    shown = last_command is None or f"Cmd:{last_command}\n" in text
    return shown and 0 < text.count("NEW UI") == text.count("UI closed")


def logged_commands(log: Path) -> list[tuple[float, str]]:
    """Every command a control daemon's log shows (`Cmd:...`), with the daemon's own time stamp (seconds, local)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        stamp, _, text = line.partition("] Cmd:")
        if text:
            found.append((datetime.strptime(stamp[1:24], "%Y-%m-%d %H:%M:%S.%f").timestamp(), text))
    return found


def restored_after(log: Path, changed: str, restore: str) -> float | None:
    """Seconds, by the daemon's clock, from the last `changed` command to the first `restore` after it (None: no
    such restore yet): how long a ceiling changed behind the agent held."""
    logged = logged_commands(log)
    at = [i for i, (_, text) in enumerate(logged) if text == changed]
    later = [when for when, text in logged[at[-1] + 1 :] if text == restore] if at else []
    return later[0] - logged[at[-1]][0] if later else None
