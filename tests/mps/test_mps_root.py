"""The MPS root as a hostile or failing host makes it: full, read-only, too open, owned by someone else, with
links planted where the agent writes. The agent refuses what it must not use, and outlives what it cannot write."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mpsagent_testing.agents import AgentLauncher, AgentProcess, start
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.mps.daemon import control, daemon_pid, pipe_of
from mpsagent_testing.node import ALL, GPU0, RESOURCE, ids

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting file systems and chown need root")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def small_root(short_dir: Path) -> Iterator[Path]:
    """`<short_dir>/mps` on a 1 MiB tmpfs of its own, so that it can be filled or made read-only."""
    root = short_dir / "mps"
    root.mkdir(mode=0o755)
    mount("-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(root))
    yield root
    for _ in range(3):  # a read-only mount may still sit over it
        if subprocess.run(["umount", "-l", str(root)], check=False, capture_output=True, timeout=10).returncode:
            break


def fill(root: Path) -> None:
    with (root / "filler").open("wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def make_full(root: Path) -> Callable[[], None]:
    fill(root)
    return (root / "filler").unlink


def make_read_only(root: Path) -> Callable[[], None]:
    """A read-only mount over the root: what the agent opens from now on is refused with EROFS (remounting the
    file system itself read-only is refused while the agent and the daemon hold files open for writing)."""
    mount("--bind", str(root), str(root))
    mount("-o", "remount,bind,ro", str(root))
    return lambda: subprocess.run(["umount", "-l", str(root)], check=True, capture_output=True, timeout=10)


def events(agent: AgentProcess, name: str) -> list[dict[str, object]]:
    return [e for e in agent.log_events() if e.get("event") == name]


def status_allocations(root: Path) -> int:
    """How many grants the status file says were made; -1 while there is none."""
    try:
        return sum(json.loads((root / "status.json").read_text())["resources"][0]["ledger"]["allocated"].values())
    except (OSError, ValueError):
        return -1


def refused(agent: AgentProcess) -> str:
    assert agent.process.wait(15) == 1
    output = agent.log()
    assert "Traceback" not in output
    (error,) = [line for line in output.splitlines() if line.startswith("mpsagent: error:")]
    return error


# --- item 2: a full or read-only root while running ----------------------------------------------------------


@needs_root
@pytest.mark.parametrize(("fault", "reason"), [(make_full, "No space left"), (make_read_only, "Read-only")])
def test_a_full_or_read_only_root_is_logged_and_the_agent_keeps_serving_and_switching_caps(
    agents: AgentLauncher,
    kubelet: FakeKubelet,
    short_dir: Path,
    small_root: Path,
    fault: Callable[[Path], Callable[[], None]],
    reason: str,
) -> None:
    agent = start(agents, kubelet, short_dir)
    plugin = kubelet.wait_registered(RESOURCE)
    wait_for(lambda: status_allocations(small_root) == 0, 5, "the first status file")
    daemon = daemon_pid(short_dir)
    repair = fault(small_root)

    allocate(plugin, ids(GPU0, 0))  # raises on any status other than OK
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "25.0"
    allocate(plugin, ALL)
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "100.0"
    status_failure = agent.wait_log("status file not written")
    state_failure = agent.wait_log("daemon state not written")
    assert reason in str(status_failure["reason"]) and reason in str(state_failure["reason"])
    allocate(plugin, ids(GPU0, 1))
    assert control(pipe_of(short_dir), "get_default_active_thread_percentage") == "25.0"

    repair()
    wait_for(lambda: status_allocations(small_root) == 3, 5, "the status file written again")
    agent.wait_log("status file written again")
    agent.wait_log("daemon state written again")
    # One line when the failure began, however many writes failed since (every 0.5 s, and each Allocate).
    assert len(events(agent, "status file not written")) == 1
    assert len(events(agent, "daemon state not written")) == 1
    assert daemon_pid(short_dir) == daemon
    assert json.loads((small_root / "nvidia.com" / "gpu" / "daemon.json").read_text())["mode"] == "capped"
    assert agent.stop() == 0


# --- item 15: a full or read-only root at start ----------------------------------------------------------------


@needs_root
@pytest.mark.parametrize(
    ("prepare", "reason"),
    [
        (lambda root: (root / "nvidia.com" / "gpu").mkdir(parents=True) or fill(root), "No space left"),
        (lambda root: mount("-o", "remount,ro", str(root)), "Read-only"),
    ],
)
def test_a_full_or_read_only_root_at_start_is_one_error_line(
    agents: AgentLauncher,
    kubelet: FakeKubelet,
    short_dir: Path,
    small_root: Path,
    prepare: Callable[[Path], None],
    reason: str,
) -> None:
    prepare(small_root)
    error = refused(start(agents, kubelet, short_dir))
    assert str(small_root) in error and reason in error


@needs_root
def test_a_read_only_kubelet_directory_at_start_is_one_error_line(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    directory = short_dir / "ro-kubelet"
    directory.mkdir()
    mount("-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(directory))
    try:
        agent = start(agents, kubelet, short_dir, "--kubelet-socket", str(directory / "kubelet.sock"))
        error = refused(agent)
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True, timeout=10)
    # The node guard's lock directory is the agent's first write there.
    assert error.startswith(f"mpsagent: error: cannot create the lock directory {directory}/mpsagent-locks ")
    assert "(Read-only file system)" in error


# --- item 3: every directory the agent creates has its mode set, parents included -------------------------------


def test_directories_created_under_umask_000_get_their_modes_parents_included(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    root = short_dir / "deep" / "er" / "mps"
    old_umask = os.umask(0)
    try:
        start(agents, kubelet, short_dir, "--mps-root", str(root))
    finally:
        os.umask(old_umask)
    kubelet.wait_registered(RESOURCE)
    assert mode(short_dir / "deep") == 0o755
    assert mode(short_dir / "deep" / "er") == 0o755
    assert mode(root) == 0o755
    assert mode(root / "nvidia.com") == 0o755
    assert mode(root / "nvidia.com" / "gpu") == 0o755
    assert mode(root / "nvidia.com" / "gpu" / "pipe") == 0o755
    assert mode(root / "nvidia.com" / "gpu" / "log") == 0o700
    assert mode(root / "shm") == 0o1777


# --- item 4: a root the agent does not own, and links planted where it writes -----------------------------------


@needs_root
def test_a_root_owned_by_another_user_is_refused_and_left_untouched(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    root = short_dir / "mps"
    root.mkdir()
    os.chown(root, NOBODY, NOBODY)
    root.chmod(0o777)
    error = refused(start(agents, kubelet, short_dir))
    assert error == (
        f"mpsagent: error: the MPS root {root} is owned by uid {NOBODY} and has mode 0777: the agent only uses "
        "directories owned by root or by itself and not writable by others; fix it (chown root; chmod 755) "
        "or choose another --mps-root"
    )
    assert mode(root) == 0o777
    assert list(root.iterdir()) == []


def test_a_root_writable_by_others_is_refused(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    root = short_dir / "mps"
    root.mkdir()
    root.chmod(0o777)
    error = refused(start(agents, kubelet, short_dir))
    assert f"the MPS root {root} is owned by uid {os.geteuid()} and has mode 0777" in error
    assert list(root.iterdir()) == []


@needs_root
def test_an_ancestor_owned_by_another_user_is_refused(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    theirs = short_dir / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    error = refused(start(agents, kubelet, short_dir, "--mps-root", str(theirs / "mps")))
    assert f"the directory {theirs} above the MPS root is owned by uid {NOBODY} and has mode 0755" in error
    assert list(theirs.iterdir()) == []


def test_a_link_above_the_root_that_belongs_to_root_is_followed(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    (short_dir / "real").mkdir(mode=0o755)
    (short_dir / "run").symlink_to("real")  # as /var/run -> /run
    start(agents, kubelet, short_dir, "--mps-root", str(short_dir / "run" / "mps"))
    kubelet.wait_registered(RESOURCE)
    assert (short_dir / "real" / "mps" / "nvidia.com" / "gpu" / "daemon.json").is_file()


@needs_root
def test_a_link_above_the_root_that_belongs_to_another_user_is_refused(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    (short_dir / "real").mkdir(mode=0o755)
    link = short_dir / "run"
    link.symlink_to("real")
    os.lchown(link, NOBODY, NOBODY)
    error = refused(start(agents, kubelet, short_dir, "--mps-root", str(link / "mps")))
    assert error == (
        f"mpsagent: error: the link {link} on the way to the MPS root is owned by uid {NOBODY}: the agent only "
        "follows links owned by root or by itself; choose another --mps-root"
    )
    assert list((short_dir / "real").iterdir()) == []


@pytest.mark.parametrize(
    "planted",
    ["nvidia.com", "nvidia.com/gpu", "nvidia.com/gpu/pipe", "nvidia.com/gpu/log", "shm"],
)
def test_a_directory_planted_as_a_link_is_refused_and_its_target_untouched(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, planted: str
) -> None:
    root = short_dir / "mps"
    link = root / planted
    link.parent.mkdir(parents=True)
    target = short_dir / "target"
    target.mkdir(mode=0o700)
    link.symlink_to(target)
    error = refused(start(agents, kubelet, short_dir))
    assert error == (
        f"mpsagent: error: {link} is a symbolic link, not a directory: the agent does not follow links under the "
        "MPS root; remove it"
    )
    assert mode(target) == 0o700
    assert list(target.iterdir()) == []


@needs_root
def test_a_directory_owned_by_another_user_under_the_root_is_refused(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    pipe = pipe_of(short_dir)
    pipe.mkdir(parents=True, mode=0o755)
    os.chown(pipe, NOBODY, NOBODY)
    error = refused(start(agents, kubelet, short_dir))
    assert f"{pipe} is owned by uid {NOBODY}, not by the agent (uid {os.geteuid()}); remove it" in error


@pytest.mark.parametrize("planted", ["agent.lock", "log/control.log"])
def test_a_file_planted_as_a_link_is_refused_and_its_target_untouched(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, planted: str
) -> None:
    resource = short_dir / "mps" / "nvidia.com" / "gpu"
    link = resource / planted
    link.parent.mkdir(parents=True, mode=0o755)
    precious = short_dir / "precious"
    precious.write_text("keep me\n")
    precious.chmod(0o644)
    link.symlink_to(precious)
    error = refused(start(agents, kubelet, short_dir))
    assert str(link) in error and "symbolic link" in error
    assert precious.read_text() == "keep me\n"
    assert mode(precious) == 0o644
