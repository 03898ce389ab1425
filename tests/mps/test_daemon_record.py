"""The daemon record `daemon.json`: what is wrong with a damaged one is said once per episode and kept for
`--status`, its values are bounded, its owner rewrites it while the daemon it names lives; and the daemon that
serves a pipe directory found from /proc, for a daemon host whose record is gone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import structlog

from mpsagent.base.host import pid_alive
from mpsagent.mps.discovery import DaemonProcess, find_daemons
from mpsagent.mps.state import DaemonState, StateFile

GOOD = DaemonState(pid=os.getpid(), visible_devices="0,1", mode="capped", multi_user=False)


def good_bytes(**changes: object) -> str:
    return json.dumps({**msgspec.to_builtins(GOOD), **changes})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"pid": 12', "does not decode: Input data was truncated"),
        ("[]", "does not decode: Expected `object`, got `array`"),
        (good_bytes(pid=2**70), "does not decode: Expected `int` <= 4194304 - at `$.pid`"),
        (good_bytes(pid=-1), "does not decode: Expected `int` >= 2 - at `$.pid`"),
        (good_bytes(pid=1), "does not decode: Expected `int` >= 2 - at `$.pid`"),
        (good_bytes(ceilings={"threadPercentage": 900, "memoryMib": [1]}), "at `$.ceilings.threadPercentage`"),
        (good_bytes(originalComputeModes={"GPU-0": 7}), "at `$.originalComputeModes[...]`"),
        ("1" * 70_000, "is larger than 65536 bytes"),
    ],
    ids=["cut-short", "array", "huge-pid", "pid-minus-one", "pid-one", "threads", "compute-mode", "huge"],
)
def test_a_damaged_record_reads_as_none_and_says_what_is_wrong(tmp_path: Path, content: str, problem: str) -> None:
    record = StateFile(tmp_path)
    record.path.write_text(content)
    with structlog.testing.capture_logs() as logs:
        assert record.read() is None
        assert record.read() is None
    assert record.damage is not None and problem in record.damage[1], record.damage
    assert [(e["event"], e["log_level"], e["path"]) for e in logs] == [
        ("daemon state damaged", "warning", str(record.path))  # once per episode
    ]
    assert problem in logs[0]["problem"]


def test_what_is_not_a_regular_file_is_damage_and_never_blocks(tmp_path: Path) -> None:
    record = StateFile(tmp_path)
    os.mkfifo(record.path)
    assert record.read() is None
    assert record.damage is not None and "is a FIFO, not a regular file" in record.damage[1]


def test_an_episode_ends_when_the_record_reads_again_and_a_missing_record_is_no_damage(tmp_path: Path) -> None:
    record = StateFile(tmp_path)
    with structlog.testing.capture_logs() as logs:
        assert record.read() is None
        assert record.damage is None
        record.path.write_text("{")
        record.read()
        record.path.write_text(good_bytes())
        assert record.read() == GOOD
        assert record.damage is None
        record.path.write_text("{")
        record.read()
    assert [e["event"] for e in logs] == [
        "daemon state damaged",
        "daemon state readable again",
        "daemon state damaged",
    ]


@pytest.mark.parametrize("damage", ["garbage", "removed"])
def test_its_owner_rewrites_a_damaged_or_removed_record_while_the_daemon_it_names_lives(
    tmp_path: Path, damage: str
) -> None:
    owner = StateFile(tmp_path)
    assert owner.write(GOOD)
    if damage == "removed":
        owner.path.unlink()
    else:
        owner.path.write_text("{")
    with structlog.testing.capture_logs() as logs:
        owner.retry()
    assert StateFile(tmp_path).read() == GOOD
    assert [e["event"] for e in logs][-1] == "daemon state rewritten"
    assert logs[-1]["pid"] == GOOD.pid


def test_the_owner_rewrites_the_latest_record_it_read_not_an_older_one_it_wrote(tmp_path: Path) -> None:
    """The agent (with a daemon host) records the ceilings it sets in the same file: the keeper's repair keeps
    them."""
    owner = StateFile(tmp_path)
    owner.write(GOOD)
    newer = msgspec.structs.replace(GOOD, mode="full")
    StateFile(tmp_path).write(newer)
    owner.retry()  # reads the newer record
    owner.path.write_text("{")
    owner.retry()
    assert StateFile(tmp_path).read() == newer


def test_a_record_whose_daemon_is_gone_or_was_removed_on_purpose_is_not_rewritten(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = StateFile(tmp_path)
    owner.write(msgspec.structs.replace(GOOD, pid=dead.pid))
    owner.path.write_text("{")
    owner.retry()
    assert owner.path.read_text() == "{"
    quitting = StateFile(tmp_path)
    quitting.write(GOOD)
    quitting.remove()  # the daemon was quit
    quitting.retry()
    assert not quitting.path.exists()


@pytest.mark.parametrize("pid", [-1, 0, 1, 2**22 + 1, 2**70])
def test_no_pid_outside_the_kernels_range_is_alive(pid: int) -> None:
    """kill(-1) reaches every process, kill(0) the caller's group; PID 1 is never the agent's daemon."""
    assert not pid_alive(pid)


# --- finding the daemon from /proc ---------------------------------------------------------------------------

UNIX_HEADER = "Num       RefCount Protocol Flags    Type St Inode Path\n"


def fake_proc(root: Path, pipe: Path, processes: dict[int, tuple[int, list[str], list[str], str]]) -> Path:
    """A /proc with `net/unix` listing `pipe/control` as listening (inode 4711) and a connected socket to it
    (4712), and `processes`: PID -> (parent, socket inodes it holds, argv, CUDA_VISIBLE_DEVICES)."""
    (root / "net").mkdir(parents=True)
    (root / "net" / "unix").write_text(
        UNIX_HEADER
        + f"0000000000000000: 00000002 00000000 00010000 0001 01 4711 {pipe}/control\n"
        + f"0000000000000000: 00000003 00000000 00000000 0001 03 4712 {pipe}/control\n"
        + "0000000000000000: 00000002 00000000 00010000 0001 01 4713 /elsewhere/control\n"
    )
    for pid, (parent, inodes, argv, devices) in processes.items():
        directory = root / str(pid)
        (directory / "fd").mkdir(parents=True)
        (directory / "fd" / "0").symlink_to("/dev/null")
        for number, inode in enumerate(inodes, start=3):
            (directory / "fd" / str(number)).symlink_to(f"socket:[{inode}]")
        (directory / "stat").write_text(f"{pid} (nvidia-cuda-mps) S {parent} {pid} {pid} 0 -1\n")
        (directory / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
        (directory / "environ").write_bytes(f"HOME=/root\0CUDA_VISIBLE_DEVICES={devices}\0".encode())
    (root / "self").mkdir()  # not a process directory
    return root


def test_the_daemon_is_the_process_listening_on_the_control_socket(tmp_path: Path) -> None:
    pipe = Path("/run/nvidia/mps/nvidia.com/gpu/pipe")
    proc = fake_proc(
        tmp_path / "proc",
        pipe,
        {
            300: (1, [4711], ["nvidia-cuda-mps-control", "-f", "-M"], "0,1"),
            301: (300, [4711], ["nvidia-cuda-mps-server"], "0,1"),  # inherited the listening socket
            302: (1, [4712], ["nvidia-cuda-mps-control"], "0,1"),  # a front-end connected to it
            303: (1, [4713], ["nvidia-cuda-mps-control", "-f"], "2"),  # another resource's daemon
        },
    )
    assert find_daemons(proc, pipe) == [DaemonProcess(pid=300, multi_user=True, visible_devices="0,1")]
    assert find_daemons(proc, Path("/nowhere")) == []
    assert find_daemons(tmp_path / "empty", pipe) == []


@pytest.fixture
def real_daemon(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    real = shutil.which("nvidia-cuda-mps-control")
    if real is None:
        pytest.skip("nvidia-cuda-mps-control not installed (run scripts/install-system-deps.sh)")
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    logs.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    daemon = subprocess.Popen([real, "-f"], env={**env, "CUDA_VISIBLE_DEVICES": "0"}, start_new_session=True)
    try:
        for _ in range(200):
            answer = subprocess.run([real], input=b"get_server_list\n", env=env, capture_output=True, check=False)
            if answer.returncode == 0:
                break
        yield daemon, pipe
    finally:
        daemon.kill()
        daemon.wait(10)


def test_the_real_daemon_is_found_by_its_control_socket(real_daemon: tuple[subprocess.Popen[bytes], Path]) -> None:
    daemon, pipe = real_daemon
    assert find_daemons(Path("/proc"), pipe) == [DaemonProcess(pid=daemon.pid, multi_user=False, visible_devices="0")]
