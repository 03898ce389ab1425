"""The driver's per-cgroup memory limits (r615+) as the second enforcement layer: the agent's CDI hook sets a
container's limit on its cgroup before its first process runs, the agent names the hook's device in an Allocate's
answer on GPUs whose driver has the limits, reads every limit back, restores what changed, and forgets a container
whose cgroup is gone. Through the real nvidia-ml-py over the fake NVML in its memory-limits mode, and real cgroup v2
directories (these machines have cgroup v2 at /sys/fs/cgroup/unified: the fake's `hybrid` layout)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsagent.base.values import MIB
from mpsagent.kubelet.memory_limit_devices import SPEC_FILE
from mpsagent_testing.agents import AgentLauncher, AgentProcess, serve, status_json
from mpsagent_testing.cgroups import PodCgroup, pod_cgroup
from mpsagent_testing.cluster.host_agent import fake_gpu, fake_nvml_config
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.metrics import value
from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.node import RESOURCE, config
from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.nvml.control import FakeNvmlDriver

require_real_control()

HOOK = Path(sys.executable).parent / "mpsagent-cdi-hook"
GIB = 1024 * MIB
GPU0, GPU1 = fake_gpu(0)["uuid"], fake_gpu(1)["uuid"]
UNIFIED = Path("/sys/fs/cgroup/unified")


class FakeDriver:
    """The fake NVML of a two-GPU node of 16 GiB GPUs, with (or without) the driver's memory limits."""

    def __init__(self, directory: Path, library: Path, *, memory_limits: bool = True) -> None:
        self.config = directory / "nvml.json"
        self.config.write_text(
            fake_nvml_config([fake_gpu(0), fake_gpu(1)], memory_limits=memory_limits, cgroup_layout="hybrid")
        )
        self.driver = FakeNvmlDriver(directory / "nvml-state.json")
        self.library = library

    def env(self) -> dict[str, str]:
        return fake_nvml_env(self.library, self.config, self.driver.state_path)


@pytest.fixture
def fake(short_dir: Path, fake_nvml_library: Path) -> FakeDriver:
    return FakeDriver(short_dir, fake_nvml_library)


@pytest.fixture
def container() -> Iterator[tuple[PodCgroup, subprocess.Popen[bytes]]]:
    """A process in a cgroup named like a pod's container, as the container runtime leaves it for its hooks."""
    if not (UNIFIED / "cgroup.procs").is_file():
        pytest.skip("no cgroup v2 at /sys/fs/cgroup/unified")
    with pod_cgroup(under=UNIFIED) as cgroup:
        process = subprocess.Popen(cgroup.command("sleep", "600"))
        try:
            wait_for(lambda: str(process.pid) in (cgroup.path / "cgroup.procs").read_text(), 5, "it in its cgroup")
            yield cgroup, process
        finally:
            process.kill()
            process.wait(10)


def run_hook(env: dict[str, str], records: Path, pid: int, *limits: str, container_id: str = "c0ffee") -> Any:
    state = json.dumps({"ociVersion": "1.2.0", "id": container_id, "status": "creating", "pid": pid, "bundle": "/"})
    argv = [str(HOOK), "apply-memory-limits", "--records", str(records)]
    for limit in limits:
        argv += ["--limit", limit]
    return subprocess.run(argv, input=state, capture_output=True, text=True, env=env, timeout=30, check=False)


def v2_directory(cgroup: PodCgroup) -> str:
    """The container's cgroup v2 directory as the hook finds it (the test cgroup is made under the v2 root)."""
    return str(cgroup.path)


# --- the hook -----------------------------------------------------------------------------------------------


def test_the_hook_sets_each_limit_on_the_containers_cgroup_reads_it_back_and_records_it(
    fake: FakeDriver, container: tuple[PodCgroup, subprocess.Popen[bytes]], short_dir: Path
) -> None:
    cgroup, process = container
    records = short_dir / "records"
    done = run_hook(fake.env(), records, process.pid, f"{GPU0}=4096", f"{GPU1}=8192")
    assert done.returncode == 0, done.stderr
    directory = v2_directory(cgroup)
    assert fake.driver.memory_limit(directory, GPU0)["hard"] == 4 * GIB
    assert fake.driver.memory_limit(directory, GPU1)["hard"] == 8 * GIB
    assert fake.driver.memory_limit(directory, GPU0)["soft"] == 0, "no soft limit: nothing is lent"
    record = json.loads((records / "c0ffee.json").read_text())
    assert (record["cgroup"], record["pid"]) == (directory, process.pid)
    assert [(limit["uuid"], limit["hardBytes"]) for limit in record["limits"]] == [(GPU0, 4 * GIB), (GPU1, 8 * GIB)]
    (logged,) = [json.loads(line) for line in (records / "hook.log").read_text().splitlines()]
    assert logged["event"] == "memory limits set" and logged["cgroup"] == directory
    assert logged["at"] <= fake.driver.memory_limit(directory, GPU0)["setAt"] <= logged["done"]


@pytest.mark.parametrize("memory_limits", [False, True])
def test_the_hook_never_lets_a_container_start_without_its_limit(
    short_dir: Path, fake_nvml_library: Path, memory_limits: bool
) -> None:
    """An older driver, or a container left in the root cgroup: the hook fails, and the runtime does not start the
    container; the message names the GPU and why."""
    fake = FakeDriver(short_dir, fake_nvml_library, memory_limits=memory_limits)
    sleeper = subprocess.Popen(["sleep", "600"])  # the test's own cgroup: v2's root on these machines
    try:
        done = run_hook(fake.env(), short_dir / "records", sleeper.pid, f"{GPU0}=4096")
    finally:
        sleeper.kill()
        sleeper.wait(10)
    assert done.returncode == 1
    assert "the container's GPU memory limits were not set, so it does not start" in done.stderr
    assert "no cgroup v2 directory of its own" in done.stderr or GPU0 in done.stderr
    assert "Traceback" not in done.stderr
    assert not (short_dir / "records" / "c0ffee.json").exists()


# --- the agent ----------------------------------------------------------------------------------------------


def start_agent(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fake: FakeDriver, *extra: str
) -> tuple[AgentProcess, str]:
    agent, base = serve(
        agents,
        kubelet,
        short_dir,
        "--cdi-spec-dir",
        str(short_dir / "cdi"),
        "--probe-interval-seconds",
        "1",
        *extra,
        text=config(),
        env=fake.env(),
        nvml=True,
    )
    kubelet.wait_registered(RESOURCE)
    agent.wait_log("mps daemon healthy")
    return agent, base


def test_a_capped_grant_on_a_driver_limited_gpu_names_the_hooks_device_whose_spec_the_runtime_reads(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fake: FakeDriver
) -> None:
    _, base = start_agent(agents, kubelet, short_dir, fake)
    plugin = kubelet.plugins[0]
    (answer,) = allocate(plugin, [f"{GPU0}::1"]).container_responses
    device = f"{GPU0}_4096M"
    assert [d.name for d in answer.cdi_devices] == [f"mpsagent.io/memory-limit={device}"]
    assert answer.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"  # MPS stays the second layer
    spec = json.loads((short_dir / "cdi" / SPEC_FILE).read_text())
    assert spec["kind"] == "mpsagent.io/memory-limit"
    (entry,) = spec["devices"]
    (hook,) = entry["containerEdits"]["hooks"]
    assert (entry["name"], hook["hookName"], hook["path"]) == (device, "createRuntime", str(HOOK))
    records = str(short_dir / "mps" / "memory-limits")
    assert hook["args"] == ["mpsagent-cdi-hook", "apply-memory-limits", "--records", records, "--limit", f"{GPU0}=4096"]
    # A whole GPU has no limit: nothing to name.
    (whole,) = allocate(plugin, [f"{GPU1}::{i}" for i in range(4)]).container_responses
    assert list(whole.cdi_devices) == []
    gpus = status_json(short_dir)["resources"][0]["gpus"]
    assert {uuid: gpu["enforcement"] for uuid, gpu in gpus.items()} == {GPU0: "driver", GPU1: "driver"}
    assert value(base, "mpsagent_gpu_enforcement", resource=RESOURCE, gpu=GPU0, layer="driver") == 1


def test_an_older_driver_is_mps_alone_and_nothing_changes(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fake_nvml_library: Path
) -> None:
    fake = FakeDriver(short_dir, fake_nvml_library, memory_limits=False)
    _, base = start_agent(agents, kubelet, short_dir, fake)
    (answer,) = allocate(kubelet.plugins[0], [f"{GPU0}::1"]).container_responses
    assert list(answer.cdi_devices) == []
    assert not (short_dir / "cdi" / SPEC_FILE).exists()
    gpu = status_json(short_dir)["resources"][0]["gpus"][GPU0]
    assert gpu["enforcement"] == "mps" and "has no per-cgroup memory limits" in gpu["enforcementReason"]
    assert value(base, "mpsagent_gpu_enforcement", resource=RESOURCE, gpu=GPU0, layer="mps") == 1


def test_no_hook_is_mps_alone_with_the_reason(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, fake: FakeDriver
) -> None:
    start_agent(agents, kubelet, short_dir, fake, "--cdi-hook", "")
    gpu = status_json(short_dir)["resources"][0]["gpus"][GPU0]
    assert gpu["enforcement"] == "mps" and "--cdi-hook is empty" in gpu["enforcementReason"]


def test_the_agent_reads_each_limit_back_restores_a_changed_one_and_forgets_a_gone_container(
    agents: AgentLauncher,
    kubelet: FakeKubelet,
    short_dir: Path,
    fake: FakeDriver,
    container: tuple[PodCgroup, subprocess.Popen[bytes]],
) -> None:
    cgroup, process = container
    agent, base = start_agent(agents, kubelet, short_dir, fake)
    records = short_dir / "mps" / "memory-limits"
    assert run_hook(fake.env(), records, process.pid, f"{GPU0}=4096").returncode == 0
    directory = v2_directory(cgroup)
    fake.driver.set_processes(GPU0, [(process.pid, 3 * GIB)], mps=True)
    labels = {"gpu": GPU0, "pod_uid": cgroup.pod_uid, "container_id": "c0ffee"}
    wait_for(lambda: value(base, "mpsagent_container_gpu_memory_used_bytes", **labels) == 3 * GIB, 10, "its use")
    assert value(base, "mpsagent_container_gpu_memory_limit_bytes", **labels) == 4 * GIB
    (limit,) = status_json(short_dir)["containerLimits"]
    assert (limit["cgroup"], limit["podUid"], limit["usedBytes"]) == (directory, cgroup.pod_uid, 3 * GIB)
    # Root on the node lifts it: restored at the next round.
    lift = [sys.executable, "-c", _LIFT, GPU0, directory]
    subprocess.run(lift, env=fake.env(), check=True, timeout=30)
    changed = agent.wait_log("container memory limit changed behind the agent; restoring it")
    assert changed["found"] == 16 * GIB and changed["wanted"] == 4 * GIB
    wait_for(lambda: fake.driver.memory_limit(directory, GPU0)["hard"] == 4 * GIB, 10, "the limit restored")
    # The container goes: so does its limit, and the agent forgets it.
    process.kill()
    process.wait(10)
    cgroup.remove()
    agent.wait_log("container memory limit released: its cgroup is gone", timeout=10)
    assert not (records / "c0ffee.json").exists()
    wait_for(lambda: status_json(short_dir)["containerLimits"] == [], 5, "the status without it")


_LIFT = """
import sys, pynvml
pynvml.nvmlInit()
limits = pynvml.c_nvmlSetMemoryLimits_v1_t()
limits.nameSpace = sys.argv[2].encode()
limits.softLimit = 0
limits.hardLimit = 16 << 30
pynvml.nvmlDeviceSetMemoryLimits_v1(pynvml.nvmlDeviceGetHandleByUUID(sys.argv[1]), limits)
"""
