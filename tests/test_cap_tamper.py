"""Caps lifted behind the agent's back (every client container has the control socket, and the Debian 535
daemon takes `set_` from any user) are found on the next liveness round, restored, logged, counted and shown.
Through the real control daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from mpsagent.base.config import SharingConfig, check_config, parse_config
from mpsagent.base.settings import MpsOnExit
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import build_plan
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent.mps.commands import CapDifference, ControlStep, cap_differences, running_server_steps
from mpsagent.mps.control import ControlChannel
from mpsagent.mps.daemon import DaemonSupervisor
from mpsagent.mps.paths import prepare_directories
from mpsagent_testing.agents import AgentLauncher, serve, start, status
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.metrics import value
from mpsagent_testing.mps.daemon import REAL_BIN, control, pipe_of, require_real_control
from mpsagent_testing.node import GPU0, RESOURCE, config, ids, small_node
from mpsagent_testing.repo import EXAMPLES, ROOT

require_real_control()  # the agents these tests start run the real MPS control daemon

TAMPERED = "mps daemon caps changed behind the agent; restoring them"


def tampered(agent) -> list[dict[str, object]]:
    return [e for e in agent.log_events() if e.get("event") == TAMPERED]


def status_of(short_dir: Path) -> dict:
    return json.loads((short_dir / "mps" / "status.json").read_text())


def test_caps_lifted_through_the_pipe_are_restored_within_the_probe_interval(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, base = serve(agents, kubelet, short_dir, "--probe-interval-seconds", "1")
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))  # capped: 25 % and 4095 MiB per GPU
    pipe = pipe_of(short_dir)
    assert control(pipe, "get_default_active_thread_percentage") == "25.0"

    # What an unprivileged (535) or root (any driver) client container can do through its pipe directory.
    control(pipe, "set_default_active_thread_percentage 100\nset_default_device_pinned_mem_limit 0 16384M")
    assert control(pipe, "get_default_active_thread_percentage") == "100.0"
    wait_for(
        lambda: (
            control(pipe, "get_default_active_thread_percentage") == "25.0"
            and control(pipe, "get_default_device_pinned_mem_limit 0") == "3G"
        ),
        3,  # the 1 s interval, and slack for a loaded machine
        "the caps to be restored",
    )
    events = wait_for(lambda: len(tampered(agent)) == 2 and tampered(agent), 5, "two tamper log lines")
    assert {(e["value"], e["expected"], e["found"], e["server"], e["level"]) for e in events} == {
        ("get_default_active_thread_percentage", "25.0", "100.0", None, "error"),
        ("get_default_device_pinned_mem_limit 0", "3G", "16G", None, "error"),
    }
    daemon = wait_for(
        lambda: (
            (found := status_of(short_dir)["resources"][0]["daemon"])["capTamper"] == 2
            and found["capMode"] == "capped"  # None while the restore is under way
            and found
        ),
        5,
        "the count in the status",
    )
    assert "`get_default_active_thread_percentage` reads 100.0, expected 25.0" in daemon["lastCapTamper"]["found"]
    wait_for(lambda: value(base, "mpsagent_cap_tamper_total", resource=RESOURCE) == 2, 5, "the counter")
    printed = status(short_dir)
    assert printed.returncode == 0, printed.stderr
    shown = printed.stdout
    assert "caps changed behind the agent 2 times, last at " in shown
    assert "(restored): `get_default_active_thread_percentage` reads 100.0, expected 25.0" in shown


def test_a_limit_taken_away_altogether_is_restored(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    # Under equal grants a grant on GPU 0 caps ordinal 1 too (under proportional ones, GPU 1 would be at full).
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", "1", text=config(grants="equal"))
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))
    pipe = pipe_of(short_dir)
    control(pipe, "set_default_device_pinned_mem_limit 1 0")  # 0: no ceiling; the read-back then prints nothing
    wait_for(lambda: control(pipe, "get_default_device_pinned_mem_limit 1") == "3G", 3, "the limit to be restored")
    (event,) = wait_for(lambda: tampered(agent), 5, "the tamper log line")
    assert (event["value"], event["found"]) == ("get_default_device_pinned_mem_limit 1", None)


@pytest.mark.parametrize("lifted", ["6143M", "5120M"])
def test_a_limit_lifted_by_less_than_a_gib_is_seen_and_restored(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, lifted: str
) -> None:
    """The daemon reads a limit back in whole GiB: a third of a 16 GiB GPU is held at 5119M (`4G`), so that any raise
    reads back as another value (at 5461M, 6143M read back `5G` as the ceiling itself did, and was never seen)."""
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", "1", text=config(replicas=3))
    plugin = kubelet.wait_registered(RESOURCE)
    envs = allocate(plugin, ids(GPU0, 0)).container_responses[0].envs
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5119M,1=5119M"
    pipe = pipe_of(short_dir)
    assert control(pipe, "get_default_device_pinned_mem_limit 0") == "4G"
    control(pipe, f"set_default_device_pinned_mem_limit 0 {lifted}")
    (event,) = wait_for(lambda: tampered(agent), 5, "the tamper log line")
    assert (event["value"], event["expected"], event["found"]) == ("get_default_device_pinned_mem_limit 0", "4G", "5G")
    # Restored to the MiB: in the daemon's log, the agent's own command follows the one that lifted the limit.

    def set_after_lift() -> list[str]:
        sets = [
            line.split("Cmd:", 1)[1]
            for e in agent.log_events()
            if "Cmd:set_default_device_pinned_mem_limit 0 " in (line := str(e.get("line")))
        ]
        lift = f"set_default_device_pinned_mem_limit 0 {lifted}"
        return sets[sets.index(lift) + 1 :] if lift in sets else []

    assert wait_for(set_after_lift, 5, "the agent's command after the lift") == [
        "set_default_device_pinned_mem_limit 0 5119M"
    ]
    assert control(pipe, "get_default_device_pinned_mem_limit 0") == "4G"


def test_a_full_daemon_is_held_at_full_too(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    """Lowering the caps of a full daemon is as much a change as lifting them: the full grant's pod needs them."""
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", "1")
    kubelet.wait_registered(RESOURCE)
    pipe = pipe_of(short_dir)
    control(pipe, "set_default_active_thread_percentage 10")
    wait_for(lambda: control(pipe, "get_default_active_thread_percentage") == "100.0", 3, "full again")
    assert tampered(agent)[0]["found"] == "10.0"


def test_an_untouched_daemon_is_never_reported(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    agent = start(agents, kubelet, short_dir, "--probe-interval-seconds", "1")
    plugin = kubelet.wait_registered(RESOURCE)
    allocate(plugin, ids(GPU0, 0))
    wait_for(lambda: len([e for e in agent.log_events() if "Cmd:get_server_list" in str(e.get("line"))]) >= 3, 10)
    assert tampered(agent) == []
    assert status_of(short_dir)["resources"][0]["daemon"]["capTamper"] == 0


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
    assert [e["value"] for e in tampered(agent)] == ["get_default_active_thread_percentage"]


def steps(server: int) -> tuple[ControlStep, ...]:
    plan = build_plan(_sharing(), SnapshotGpuSource(EXAMPLES / "node-h100x8.yaml").discover(), Path("/mps"))
    return running_server_steps(plan.resources[0].shares.smallest_caps(), server)


def _sharing() -> SharingConfig:
    text = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      replicas: 4\n      devices: 1\n"
    return check_config(parse_config(text, "test"))


@pytest.mark.parametrize(
    ("replies", "changed"),
    [
        (["25.0", "18G"], []),
        (["100.0", "18G"], [("get_active_thread_percentage 42", "100.0")]),
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


# --- the supervisor's read-back for PreStartContainer ----------------------------------------------------


@pytest.fixture
def supervisor(short_dir: Path) -> Iterator[DaemonSupervisor]:
    sharing = _sharing()
    node = SnapshotGpuSource(small_node(short_dir / "node.json")).discover()
    plan = build_plan(sharing, node, short_dir / "mps")
    prepare_directories(plan)
    supervisor = DaemonSupervisor(
        resource=plan.resources[0],
        inventory=Inventory(plan.resources[0]),
        gpu_source=SnapshotGpuSource(short_dir / "node.json"),
        control_bin=str(REAL_BIN),
        on_exit=MpsOnExit.QUIT,
        probe_interval_s=60,  # no round in this test: only the calls it makes read the daemon
    )
    supervisor.want_ceilings(plan.resources[0].shares.smallest_caps())
    yield supervisor


def test_set_ceilings_with_verify_reads_the_daemons_real_values(supervisor: DaemonSupervisor, short_dir: Path) -> None:
    pipe = short_dir / "mps" / "nvidia.com" / "gpu" / "pipe"

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            control(pipe, "set_default_active_thread_percentage 100")
            capped = supervisor.ceilings
            assert capped is not None
            await supervisor.set_ceilings(capped)  # the cached ceilings say capped: nothing is read
            assert control(pipe, "get_default_active_thread_percentage") == "100.0"
            await supervisor.set_ceilings(capped, verify=True)
            assert control(pipe, "get_default_active_thread_percentage") == "25.0"
            assert supervisor.cap_tamper_count == 1
            assert supervisor.last_cap_tamper is not None
            assert "reads 100.0, expected 25.0" in supervisor.last_cap_tamper[1]
            tg.cancel_scope.cancel()

    anyio.run(main)


# --- reading values back ------------------------------------------------------------------------------------


@pytest.fixture
def plain_daemon(short_dir: Path) -> Iterator[Path]:
    pipe, logs = short_dir / "pipe", short_dir / "log"
    pipe.mkdir()
    logs.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    daemon = subprocess.Popen(
        [str(REAL_BIN), "-f"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_for(lambda: control(pipe, "get_default_active_thread_percentage") == "100.0", 5, "the daemon")
        yield pipe
    finally:
        daemon.kill()
        daemon.wait(5)


def test_a_value_that_prints_nothing_reads_as_none_in_its_place(plain_daemon: Path) -> None:
    channel = ControlChannel(str(REAL_BIN), plain_daemon)
    control(plain_daemon, "set_default_device_pinned_mem_limit 1 4096M")
    reads = [
        "get_default_device_pinned_mem_limit 0",  # never set: prints nothing
        "get_default_active_thread_percentage",
        "get_default_device_pinned_mem_limit 1",
    ]

    async def main() -> None:
        assert await channel.read(reads) == [None, "100.0", "4G"]
        assert await channel.read_with_servers(reads[1:]) == (["100.0", "4G"], [])

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
