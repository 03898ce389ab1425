"""Caps lifted behind the agent's back (every client container has the control socket, and the Debian 535
daemon takes `set_` from any user) are found on the next liveness round, restored, logged, counted and shown.
Through the real control daemon."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest

from mpsagent.base.config import SharingConfig, check_config, parse_config
from mpsagent.base.errors import DaemonCommandError
from mpsagent.base.settings import MpsDaemonOwner, MpsOnExit
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import ResourcePlan, build_plan
from mpsagent.domain.shares import Ceilings
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent.mps.commands import (
    CapDifference,
    ControlStep,
    cap_differences,
    daemon_default_steps,
    running_server_steps,
)
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.control_log import LINE
from mpsagent.mps.daemon import DaemonSupervisor
from mpsagent.mps.keeper import DaemonKeeper
from mpsagent.mps.paths import prepare_directories
from mpsagent.mps.state import StateFile, daemon_state
from mpsagent_testing.agents import AgentLauncher, serve, start, status
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.metrics import value
from mpsagent_testing.mps.daemon import (
    REAL_BIN,
    control,
    daemon_pid,
    pipe_of,
    plain_daemon,
    require_real_control,
    restored_after,
)
from mpsagent_testing.node import GPU0, GPU1, RESOURCE, config, ids, small_node
from mpsagent_testing.repo import EXAMPLES, ROOT

require_real_control()  # the agents these tests start run the real MPS control daemon

TAMPERED = "mps daemon ceiling changed behind the agent; restoring it"
QUIET = "60"  # --probe-interval-seconds: no read-back round within a test, so only the daemon's log can restore
STAMP = "%Y-%m-%d %H:%M:%S.%f"
T = TypeVar("T")


def tampered(agent) -> list[dict[str, object]]:
    return [e for e in agent.log_events() if e.get("event") == TAMPERED]


def status_of(short_dir: Path) -> dict:
    return json.loads((short_dir / "mps" / "status.json").read_text())


def control_log(short_dir: Path) -> Path:
    return short_dir / "mps" / "nvidia.com" / "gpu" / "log" / "control.log"


def write_as_daemon(short_dir: Path, pid: int, texts: list[str]) -> None:
    """Lines in the daemon's log as the daemon with this PID writes them (for what Debian's 535 daemon never
    writes: driver 580's refusals, another driver's wording)."""
    stamp = datetime.now().strftime(STAMP)[:-3]
    with control_log(short_dir).open("a") as log:
        log.writelines(f"[{stamp} Control {pid:>5}] {text}\n" for text in texts)


def restored(short_dir: Path, changed: str, restore: str) -> float | None:
    return restored_after(control_log(short_dir), changed, restore)


def tenant(pipe: Path, command: str) -> None:
    """What an unprivileged (535) or root (any driver) client container can do through its pipe directory; `control`
    sends it again while the agent's own session is open, so it reaches the daemon."""
    control(pipe, command)


def test_ceilings_lifted_through_the_pipe_are_seen_in_the_log_and_restored_within_a_second(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, base = serve(agents, kubelet, short_dir, "--probe-interval-seconds", QUIET)
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))  # capped: 25 % and 4096 MiB per GPU
    pipe = pipe_of(short_dir)
    assert control(pipe, "get_default_active_thread_percentage") == "25.0"

    tenant(pipe, "set_default_active_thread_percentage 100\nset_default_device_pinned_mem_limit 0 16384M")
    for changed, restore in [
        ("set_default_active_thread_percentage 100", "set_default_active_thread_percentage 25"),
        ("set_default_device_pinned_mem_limit 0 16384M", "set_default_device_pinned_mem_limit 0 4096M"),
    ]:
        took = wait_for(lambda c=changed, r=restore: restored(short_dir, c, r), 5, f"{restore} after {changed}")
        assert took <= 1.0, (changed, took)
    wait_for(
        lambda: (
            control(pipe, "get_default_active_thread_percentage") == "25.0"
            and control(pipe, "get_default_device_pinned_mem_limit 0") == "4G"
        ),
        5,  # a session of the test's own is refused while the agent's is open: asked again
        "the ceilings read back restored",
    )
    events = wait_for(lambda: len(tampered(agent)) == 2 and tampered(agent), 5, "two tamper log lines")
    assert [(e["seen_by"], e["command"], e["gpu"], e["found"], e["wanted"], e["level"]) for e in events] == [
        ("control_log", "set_default_active_thread_percentage 100", None, "100 %", "25 %", "warning"),
        ("control_log", "set_default_device_pinned_mem_limit 0 16384M", GPU0, "16384 MiB", "4096 MiB", "warning"),
    ]
    daemon = wait_for(
        lambda: (found := status_of(short_dir)["resources"][0]["daemon"])["capTamper"] == 2 and found,
        5,
        "the count in the status",
    )
    assert daemon["capTamperInLog"] == 2 and daemon["controlLog"]["watched"] is True
    assert daemon["lastCapTamper"]["seenBy"] == "control_log"
    assert daemon["lastCapTamper"]["found"] == (
        "`set_default_device_pinned_mem_limit 0 16384M` set the default pinned memory limit of ordinal 0 to "
        "16384 MiB; the ledger wants 4096 MiB"
    )
    wait_for(
        lambda: value(base, "mpsagent_cap_tamper_total", resource=RESOURCE, seen_by="control_log") == 2, 5, "counter"
    )
    assert value(base, "mpsagent_cap_tamper_total", resource=RESOURCE, seen_by="read_back") == 0
    assert value(base, "mpsagent_daemon_log_watched", resource=RESOURCE) == 1
    printed = status(short_dir)
    assert printed.returncode == 0, printed.stderr
    assert "ceilings changed behind the agent 2 times (2 seen in the control log), last at " in printed.stdout
    assert "(restored; seen in the control log): `set_default_device_pinned_mem_limit 0 16384M` set" in printed.stdout


@pytest.mark.parametrize("moved", ["5120M", "6143M"])
def test_a_limit_moved_within_its_gib_is_seen_in_the_log_and_restored_within_a_second(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, moved: str
) -> None:
    """A third of a 16 GiB GPU is 5461M, which reads back `5G` as 5120M and 6143M do: the read-back cannot tell
    them apart, the daemon's log can."""
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", QUIET, text=config(replicas=3))
    plugin = kubelet.wait_registered(RESOURCE)
    envs = allocate(plugin, ids(GPU0, 0)).container_responses[0].envs
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5461M"
    pipe = pipe_of(short_dir)
    tenant(pipe, f"set_default_device_pinned_mem_limit 0 {moved}")
    changed = f"set_default_device_pinned_mem_limit 0 {moved}"
    took = wait_for(
        lambda: restored(short_dir, changed, "set_default_device_pinned_mem_limit 0 5461M"), 5, "the restore"
    )
    assert took <= 1.0
    (event,) = wait_for(lambda: tampered(agent), 5, "the tamper log line")
    assert (event["command"], event["found"], event["wanted"]) == (changed, f"{moved[:-1]} MiB", "5461 MiB")


def test_a_limit_taken_away_altogether_is_restored(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    # Under equal grants a grant on GPU 0 caps ordinal 1 too (under proportional ones, GPU 1 would be at full).
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", QUIET, text=config(grants="equal"))
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))
    pipe = pipe_of(short_dir)
    tenant(pipe, "set_default_device_pinned_mem_limit 1 0")  # 0: no ceiling; the read-back then prints nothing
    wait_for(lambda: control(pipe, "get_default_device_pinned_mem_limit 1") == "4G", 3, "the limit to be restored")
    (event,) = wait_for(lambda: tampered(agent), 5, "the tamper log line")
    assert (event["command"], event["gpu"], event["found"]) == (
        "set_default_device_pinned_mem_limit 1 0",
        GPU1,
        "no limit",
    )


def test_a_full_daemon_is_held_at_full_too(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    """Lowering the caps of a full daemon is as much a change as lifting them: the full grant's pod needs them."""
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", QUIET)
    kubelet.wait_registered(RESOURCE)
    pipe = pipe_of(short_dir)
    tenant(pipe, "set_default_active_thread_percentage 10")
    wait_for(lambda: control(pipe, "get_default_active_thread_percentage") == "100.0", 3, "full again")
    assert tampered(agent)[0]["found"] == "10 %"


def test_the_agents_own_commands_and_refused_ones_are_never_reported(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    """The agent changes the ceilings several times (grants made and replaced), runs its read-back rounds, and a
    user the daemon refuses sends a ceiling command (driver 580's lines: Debian's 535 refuses no user, so they are
    written into the log as that driver writes them); nothing is counted."""
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", "1")
    plugin = kubelet.wait_registered(RESOURCE)
    for grant in (ids(GPU0, 0), ids(GPU0, 0, 1), ids(GPU1, 0, 1, 2, 3), ids(GPU0, 2)):
        allocate(plugin, grant)
    pid = daemon_pid(short_dir)
    refused = [
        "NEW UI",
        "Cmd:set_default_device_pinned_mem_limit 0 16384M",
        "set_default_device_pinned_mem_limit 0 16384M.",
        "Insufficient privileges for UID 65534. Control deamon settings can only be modified by the user who started "
        "it or by the root user.",
        "UI closed",
    ]
    write_as_daemon(short_dir, pid, refused)
    wait_for(lambda: any("Insufficient privileges" in str(e.get("line")) for e in agent.log_events()), 5, "forwarded")
    wait_for(lambda: len([e for e in agent.log_events() if "Cmd:get_server_list" in str(e.get("line"))]) >= 3, 10)
    assert tampered(agent) == []
    daemon = status_of(short_dir)["resources"][0]["daemon"]
    assert (daemon["capTamper"], daemon["controlLog"]["watched"], daemon["controlLog"]["unknownLines"]) == (0, True, 0)


def test_an_unknown_answer_in_the_log_is_reported_once_and_the_read_back_asked(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    """A line where a command's answer belongs, in a form the agent does not know (another driver's): reported once,
    shown, and a read-back round runs at once instead of waiting for the next."""
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", QUIET)
    kubelet.wait_registered(RESOURCE)
    pid = daemon_pid(short_dir)
    reads = len([e for e in agent.log_events() if "Cmd:get_server_list" in str(e.get("line"))])
    unknown = ["NEW UI", "Cmd:set_default_active_thread_percentage 30", "Threads now 30", "UI closed"]
    write_as_daemon(short_dir, pid, unknown * 2)
    event = agent.wait_log("mps daemon log line not understood; ceiling changes are checked by reading them back")
    assert event["after"] == "set_default_active_thread_percentage 30" and event["line"].endswith("Threads now 30")
    wait_for(
        lambda: len([e for e in agent.log_events() if "Cmd:get_server_list" in str(e.get("line"))]) > reads,
        5,
        "a read-back round at once",
    )
    daemon = wait_for(
        lambda: (d := status_of(short_dir)["resources"][0]["daemon"])["controlLog"]["unknownLines"] == 2 and d, 5
    )
    assert daemon["controlLog"]["watched"] is False
    assert daemon["controlLog"]["firstUnknownLine"].endswith("Threads now 30")
    assert len([e for e in agent.log_events() if e.get("event", "").startswith("mps daemon log line not")]) == 1


def test_a_rotated_truncated_or_deleted_log_is_followed_again_and_reported(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", QUIET)
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))
    pipe, log = pipe_of(short_dir), control_log(short_dir)
    rotated = log.with_name("control.log.1")
    log.rename(rotated)  # logrotate's `create`: the daemon keeps writing to the file it opened
    log.touch()
    tenant(pipe, "set_default_active_thread_percentage 90")
    wait_for(lambda: len(tampered(agent)) == 1, 5, "the change seen in the rotated file")
    rotated.unlink()  # deleted: the daemon still writes to it
    tenant(pipe, "set_default_active_thread_percentage 80")
    wait_for(lambda: len(tampered(agent)) == 2, 5, "the change seen in the deleted file")
    moves = [e["what"] for e in agent.log_events() if e.get("event") == "mps daemon log moved; followed"]
    assert any("now names another file (rotated)" in m for m in moves)
    assert any("the file followed was deleted" in m for m in moves)
    daemon = wait_for(
        lambda: (d := status_of(short_dir)["resources"][0]["daemon"])["controlLog"]["moves"] == 2 and d, 5, "status"
    )
    assert daemon["controlLog"]["watched"] is True
    assert "(the daemon's own output)" in daemon["controlLog"]["file"]
    assert "the file followed was deleted" in daemon["controlLog"]["problem"]


def test_a_truncated_log_is_read_again_from_its_start(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", QUIET)
    kubelet.wait_registered(RESOURCE)
    pipe, log = pipe_of(short_dir), control_log(short_dir)
    wait_for(lambda: any("UI closed" in str(e.get("line")) for e in agent.log_events()), 5, "the log read once")
    os.truncate(log, 0)
    tenant(pipe, "set_default_active_thread_percentage 70")
    wait_for(lambda: len(tampered(agent)) == 1, 5, "the change seen after the truncation")
    moves = [e["what"] for e in agent.log_events() if e.get("event") == "mps daemon log moved; followed"]
    assert any("was truncated; following it from its start" in m for m in moves)


# --- the log cut back, and rotated past its bound -------------------------------------------------------------

ROTATE_AT = 4096
"""The bound these tests rotate the daemon's log at (the agent's is daemon_log.ROTATE_BYTES): a few sessions."""


def _in_process_resource(short_dir: Path) -> tuple[ResourcePlan, SnapshotGpuSource]:
    node = SnapshotGpuSource(small_node(short_dir / "node.json"))
    plan = build_plan(_sharing(), node.discover(), short_dir / "mps")
    prepare_directories(plan)
    return plan.resources[0], node


async def _eventually(condition: Callable[[], T], what: str, timeout: float = 10) -> T:
    """`wait_for` in a worker thread: the agent's tasks, on this event loop, run meanwhile."""
    return await anyio.to_thread.run_sync(wait_for, condition, timeout, what)


def _in_process_supervisor(
    resource: ResourcePlan, gpus: SnapshotGpuSource, owner: MpsDaemonOwner = MpsDaemonOwner.AGENT, **kwargs: Any
) -> DaemonSupervisor:
    supervisor = DaemonSupervisor(
        resource=resource,
        inventory=Inventory(resource),
        gpu_source=gpus,
        control_bin=str(REAL_BIN),
        on_exit=MpsOnExit.QUIT if owner is MpsDaemonOwner.AGENT else MpsOnExit.KEEP,
        probe_interval_s=60,  # no round but those the log wakes
        owner=owner,
        **kwargs,
    )
    supervisor.want_ceilings(resource.shares.smallest_caps())  # 25 %
    return supervisor


def _restored(pipe: Path) -> bool:
    """Whether the tenant reads the thread percentage the ledger wants."""
    return control(pipe, "get_default_active_thread_percentage") == "25.0"


@pytest.mark.parametrize("owner", [MpsDaemonOwner.AGENT, MpsDaemonOwner.HOST])
def test_a_log_past_its_bound_is_rotated_and_every_change_around_the_rotations_is_seen_and_restored(
    short_dir: Path, owner: MpsDaemonOwner
) -> None:
    """The daemon's owner rotates its log (the agent's supervisor, or the daemon host's keeper with the agent's
    supervisor reading behind it) while a tenant's changes keep coming, one after the other is restored: each is
    seen and restored, whichever side of a rotation its lines fell on."""
    resource, gpus = _in_process_resource(short_dir)
    log, pipe = resource.log_directory / "control.log", resource.pipe_directory
    kept = log.with_name("control.log.1")
    supervisor = _in_process_supervisor(resource, gpus, owner, log_rotate_bytes=ROTATE_AT)
    keeper = DaemonKeeper(resource=resource, control_bin=str(REAL_BIN), probe_interval_s=60, log_rotate_bytes=ROTATE_AT)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            if owner is MpsDaemonOwner.HOST:
                await tg.start(keeper.run)
            await tg.start(supervisor.run)
            await _eventually(lambda: supervisor.status().up, "the daemon up")
            sent, copies = 0, set()
            while len(copies) < 3:  # each rotation writes a new control.log.1
                await anyio.to_thread.run_sync(
                    tenant, pipe, f"set_default_active_thread_percentage {90 - sent % 2 * 10}"
                )
                sent += 1
                await _eventually(lambda n=sent: supervisor.status().cap_tamper == n, f"change {sent} seen")
                await _eventually(lambda: _restored(pipe), f"change {sent} restored")
                with contextlib.suppress(FileNotFoundError):
                    copies.add((kept.stat().st_ino, kept.stat().st_mtime_ns))
                assert sent < 100, f"control.log not rotated: {log.stat().st_size} bytes"
            await _eventually(lambda: log.stat().st_size < ROTATE_AT, "control.log back under its bound")
            status = supervisor.status()
            assert status.control_log is not None and status.control_log.watched and status.control_log.moves == 0
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert kept.stat().st_size >= ROTATE_AT and (kept.stat().st_mode & 0o777) == 0o600
    assert all(LINE.fullmatch(text) for text in kept.read_text().splitlines())


def test_a_change_cut_from_the_log_before_it_was_read_is_read_back_and_restored_at_once(short_dir: Path) -> None:
    """The log truncated between a tenant's command and the agent's next look, as logrotate's copytruncate cuts a
    line written between its copy and its truncation (and the owner's rotation one written in the instant before
    its truncation): the agent reads the ceilings back at once, not a probe interval later."""
    resource, gpus = _in_process_resource(short_dir)
    log, pipe = resource.log_directory / "control.log", resource.pipe_directory
    supervisor = _in_process_supervisor(resource, gpus)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            await anyio.to_thread.run_sync(tenant, pipe, "set_default_active_thread_percentage 100")
            await _eventually(lambda: supervisor.status().cap_tamper_in_log == 1, "the first change seen in the log")
            await _eventually(lambda: _restored(pipe), "the first change restored")  # no session of the agent open
            # Called without awaiting: the agent's follower, on this event loop, cannot look in between.
            control(pipe, "set_default_active_thread_percentage 90")
            wait_for(lambda: "Cmd:set_default_active_thread_percentage 90" in log.read_text(), 5, "the change logged")
            os.truncate(log, 0)
            await _eventually(lambda: supervisor.status().cap_tamper == 2, "the change read back", timeout=5)
            await _eventually(lambda: _restored(pipe), "the second change restored")
            status = supervisor.status()
            assert status.cap_tamper_in_log == 1
            assert status.last_cap_tamper is not None and status.last_cap_tamper.seen_by == "read_back"
            tg.cancel_scope.cancel()

    anyio.run(main)


# --- running servers ---------------------------------------------------------------------------------------


@pytest.fixture
def fake_server_path(short_dir: Path) -> str:
    """A PATH whose `nvidia-cuda-mps-server` just waits: the real daemon lists it as a running server, one that
    never finishes its start (so it answers no `get_` about itself), as a server that is still starting."""
    directory = short_dir / "serverbin"
    directory.mkdir()
    server = directory / "nvidia-cuda-mps-server"
    server.write_text("#!/bin/sh\nexec sleep 600\n")
    server.chmod(0o755)
    return f"{directory}:{os.environ['PATH']}"


def test_a_server_that_is_still_starting_is_not_taken_for_tampering(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fake_server_path: str
) -> None:
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", "1", env={"PATH": fake_server_path})
    plugin = kubelet.wait_registered(RESOURCE)
    pipe = pipe_of(short_dir)
    control(pipe, f"start_server -uid {os.getuid()}")
    server = wait_for(lambda: control(pipe, "get_server_list"), 5, "a listed server")
    allocate(plugin, ids(GPU0, 0))  # the switch is sent to the listed server too
    control(pipe, "set_default_active_thread_percentage 100")
    wait_for(lambda: tampered(agent), 5, "the tamper of the defaults")

    def server_reads() -> int:
        asked = f"Cmd:get_active_thread_percentage {server}"
        return len([e for e in agent.log_events() if asked in str(e.get("line"))])

    rounds = server_reads()
    wait_for(lambda: server_reads() >= rounds + 2, 10, "two more rounds that read the server")
    # Once, as the log saw it (the read-back rounds find the starting server's empty values no change).
    assert [(e["seen_by"], e["command"]) for e in tampered(agent)] == [
        ("control_log", "set_default_active_thread_percentage 100")
    ]


def steps(server: int) -> tuple[ControlStep, ...]:
    plan = build_plan(_sharing(), SnapshotGpuSource(EXAMPLES / "node-h100x8.yaml").discover(), Path("/mps"))
    return running_server_steps(plan.resources[0].shares.smallest_caps(), server)


def _sharing() -> SharingConfig:
    text = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      replicas: 4\n      devices: 1\n"
    return check_config(parse_config(text, "test"))


@pytest.mark.parametrize(
    ("replies", "changed"),
    [
        (["25.0", "19G"], []),
        (["100.0", "19G"], [("get_active_thread_percentage 42", "100.0")]),
        (["25.0", None], [("get_device_pinned_mem_limit 42 0", None)]),  # no limit at all
        ([None, None], []),  # a server that answers nothing is starting (or gone): read next round
    ],
)
def test_a_running_servers_values_are_compared_as_the_defaults_are(
    replies: list[str | None], changed: list[tuple[str, str | None]]
) -> None:
    server = steps(42)
    differences = cap_differences((), (), [server], replies)
    assert [(d.step.read_back, d.found) for d in differences] == changed
    assert all(d.step.server == 42 for d in differences)


def test_a_difference_says_what_was_found_and_what_was_expected() -> None:
    (step, _) = steps(7)
    assert CapDifference(step=step, found="100.0").describe() == (
        "`get_active_thread_percentage 7` reads 100.0, expected 25.0"
    )
    assert CapDifference(step=step, found=None).describe() == (
        "`get_active_thread_percentage 7` reads nothing (no limit), expected 25.0"
    )


# --- the read-back: the backstop for a log the agent cannot see ----------------------------------------------


@pytest.fixture
def unlogged_supervisor(short_dir: Path) -> Iterator[tuple[DaemonSupervisor, Path]]:
    """A supervisor that adopts a daemon someone else started, whose log it cannot see (its output goes nowhere,
    and no control.log exists): only the read-back guards its ceilings. Its pipe directory with it."""
    sharing = _sharing()
    node = SnapshotGpuSource(small_node(short_dir / "node.json")).discover()
    plan = build_plan(sharing, node, short_dir / "mps")
    prepare_directories(plan)
    resource = plan.resources[0]
    with plain_daemon(resource.directory, logged=False) as (pipe, daemon):
        StateFile(resource.directory).write(
            daemon_state(
                pid=daemon.pid,
                visible_devices=resource.visible_devices,
                ceilings=resource.shares.full_hardware(),
                shares=resource.shares,
                multi_user=False,
                original_compute_modes={},
            )
        )
        supervisor = DaemonSupervisor(
            resource=resource,
            inventory=Inventory(resource),
            gpu_source=SnapshotGpuSource(short_dir / "node.json"),
            control_bin=str(REAL_BIN),
            on_exit=MpsOnExit.KEEP,
            probe_interval_s=60,  # no round in this test: only the calls it makes read the daemon
        )
        supervisor.want_ceilings(resource.shares.smallest_caps())
        yield supervisor, pipe


def test_set_ceilings_with_verify_reads_the_daemons_real_values(
    unlogged_supervisor: tuple[DaemonSupervisor, Path],
) -> None:
    supervisor, pipe = unlogged_supervisor

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            watch = supervisor.status().control_log
            assert watch is not None and watch.watched is False and watch.problem is not None
            assert watch.problem == (
                "the daemon's output is a character device, not a file; "
                f"{watch.file} cannot be opened (No such file or directory)"
            )
            control(pipe, "set_default_active_thread_percentage 100")
            capped = supervisor.ceilings
            assert capped is not None
            await supervisor.set_ceilings(capped)  # the cached ceilings say capped: nothing is read
            assert control(pipe, "get_default_active_thread_percentage") == "100.0"
            await supervisor.set_ceilings(capped, verify=True)
            assert control(pipe, "get_default_active_thread_percentage") == "25.0"
            status = supervisor.status()
            assert (status.cap_tamper, status.cap_tamper_in_log) == (1, 0)
            assert status.last_cap_tamper is not None and status.last_cap_tamper.seen_by == "read_back"
            assert "reads 100.0, expected 25.0" in status.last_cap_tamper.found
            tg.cancel_scope.cancel()

    anyio.run(main)


# --- reading values back ------------------------------------------------------------------------------------


@pytest.fixture
def daemon_pipe(short_dir: Path) -> Iterator[Path]:
    with plain_daemon(short_dir) as (pipe, _):
        yield pipe


def test_a_value_that_prints_nothing_reads_as_none_in_its_place(daemon_pipe: Path) -> None:
    channel = ControlChannel(str(REAL_BIN), daemon_pipe)
    control(daemon_pipe, "set_default_device_pinned_mem_limit 1 4096M")
    reads = [
        "get_default_device_pinned_mem_limit 0",  # never set: prints nothing
        "get_default_active_thread_percentage",
        "get_default_device_pinned_mem_limit 1",
    ]

    async def main() -> None:
        assert await channel.read(reads) == [None, "100.0", "4G"]
        assert await channel.read_with_servers(reads[1:]) == (["100.0", "4G"], [])

    anyio.run(main)


def test_ceilings_are_set_and_read_back_in_one_session_and_a_value_that_did_not_hold_is_named(
    short_dir: Path,
) -> None:
    """A prepare's ceilings cost one front-end session (the daemon's log shows one `NEW UI`): the `set_` commands,
    their read-backs and the server list; a value the daemon does not hold is read once more, then named."""
    with plain_daemon(short_dir) as (pipe, _):
        channel = ControlChannel(str(REAL_BIN), pipe)
        log = short_dir / "log" / "control.log"
        steps = daemon_default_steps(Ceilings(thread_percentage=37, memory_mib=(30720, 81920)))
        wrong = (*steps[:1], replace(steps[1], expected="31G"))

        def sessions() -> int:
            return log.read_text().count("NEW UI")

        def settled(count: int) -> int:
            """The sessions the log shows once it shows `count` or more: the daemon writes its log lines a moment
            after it has answered (CI read one short)."""
            found: int = wait_for(lambda: (n := sessions()) >= count and n, 5, f"{count} sessions in the daemon's log")
            return found

        async def main() -> None:
            before = sessions()
            assert await channel.apply_with_servers(steps) == []
            assert settled(before + 1) == before + 1
            assert control(pipe, "get_default_device_pinned_mem_limit 0") == "30G"
            with pytest.raises(DaemonCommandError, match=r"reads '30G', expected '31G'"):
                await channel.apply_with_servers(wrong)
            # Sessions since: the `get_` above, the wrong apply, and its values read again before the error.
            assert settled(before + 4) == before + 4

        anyio.run(main)


@pytest.mark.parametrize(("value", "message"), [("0.5", "from 1 to 60, not `0.5`"), ("61", "not `61`"), ("x", "`x`")])
def test_a_probe_interval_out_of_bounds_exits_2_naming_the_flag(value: str, message: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpsagent",
            "--once",
            "--config-file",
            str(EXAMPLES / "config-mps.yaml"),
            "--node-snapshot",
            str(EXAMPLES / "node-h100x8.yaml"),
            "--probe-interval-seconds",
            value,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 2
    assert "--probe-interval-seconds (env PROBE_INTERVAL_SECONDS, config flags.probeIntervalSeconds)" in result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
