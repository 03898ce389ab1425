"""The driver's per-container memory limits on a real node: the agent (a host process, `--dra on`) over the fake
NVML in its memory-limits mode (driver r615's calls, cgroup v2 at /sys/fs/cgroup/unified: this node's hybrid
layout), and containerd 2.x running the agent's CDI hook for real, as a createRuntime hook of each capped container
on either route. The fake records each limit by the container's cgroup v2 directory, with the time it was set."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsagent_testing.agents import AgentProcess
from mpsagent_testing.cluster import claims, kubectl, pods
from mpsagent_testing.cluster.host_agent import GIB, MPS_ROOT, HostAgents, dra_status, fake_gpu, status
from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.repo import ROOT

require_real_control()

GPU = "nvidia.com/gpu"
CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
UNIFIED = Path("/sys/fs/cgroup/unified")
RECORDS = MPS_ROOT / "memory-limits"
RECONCILE_S = 10
"""`--reconcile-grace-seconds`: a deleted pod's device-plugin grant is released this long after."""
START = "echo START $(cat /proc/uptime); "
"""What each scenario container prints first: the node's uptime as its command began (10 ms steps)."""
UNPREPARE_S = 30.0


def hook_wrapper(directory: Path, env: dict[str, str]) -> Path:
    """The agent's hook as containerd runs it here: runc gives a hook no environment but its own, so this one
    names the fake NVML's library and files, then runs the real `mpsagent-cdi-hook`."""
    exported = " ".join(f"{key}={env[key]}" for key in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG", "FAKE_NVML_STATE"))
    wrapper = directory / "mpsagent-cdi-hook"
    hook = ROOT / ".venv" / "bin" / "mpsagent-cdi-hook"
    if not hook.exists():
        hook = Path(os.environ.get("VIRTUAL_ENV", "")) / "bin" / "mpsagent-cdi-hook"
    wrapper.write_text(f'#!/bin/sh\nexport {exported}\nexec {hook} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


@pytest.fixture(scope="module")
def agents(cluster: str) -> Iterator[HostAgents]:
    if not (UNIFIED / "cgroup.procs").is_file():
        pytest.fail("this node's cgroup v2 is not at /sys/fs/cgroup/unified")
    directory = Path(tempfile.mkdtemp(prefix="mpa-limits-", dir="/tmp"))
    directory.chmod(0o755)  # runc runs the wrapper as root from the host: it must reach it
    launcher = HostAgents(directory, [fake_gpu(0, 16 * GIB), fake_gpu(1, 16 * GIB)], memory_limits=True,
                          cgroup_layout="hybrid")  # fmt: skip
    claims.apply_file(claims.DEVICE_CLASS_FILE)
    yield launcher
    pods.delete_all()
    claims.delete_templates()
    launcher.close()
    kubectl.run("delete", "-f", str(claims.DEVICE_CLASS_FILE), "--ignore-not-found", check=False)
    shutil.rmtree(directory, ignore_errors=True)


def start(agents: HostAgents, cluster: str) -> AgentProcess:
    return agents.start_dra(
        CONFIG,
        cluster,
        "--reconcile-grace-seconds", str(RECONCILE_S),
        "--probe-interval-seconds", "1",
        "--cdi-hook", str(hook_wrapper(agents.directory, agents.env)),
    )  # fmt: skip


@pytest.fixture(scope="module")
def agent(agents: HostAgents, cluster: str) -> AgentProcess:
    return start(agents, cluster)


@pytest.fixture(autouse=True)
def _clean(cluster: str) -> Iterator[None]:
    yield
    pods.delete_all()
    claims.delete_templates()
    kubectl.wait_for(lambda: not dra_status().get("claims"), UNPREPARE_S, "every claim unprepared")


def with_command(manifest: dict[str, Any], script: str, *, restart: str = "Never") -> dict[str, Any]:
    container = manifest["spec"]["containers"][0]
    container["command"] = ["/bin/sh", "-c", START + script]
    manifest["spec"]["restartPolicy"] = restart
    return manifest


def container_id(pod: str) -> str:
    (container,) = pods.get(pod)["status"]["containerStatuses"]
    return str(container["containerID"]).rpartition("://")[2]


def cgroup_of(container: str) -> str:
    """The container's cgroup v2 directory, as the kernel places it (containerd's runc, cgroupfs)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "cgroup").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("0::") and container in line:
                    return str(UNIFIED) + line[3:]
    raise AssertionError(f"no process of container {container} found")


def started_uptime(pod: str) -> float:
    """The node's uptime when the pod's command began (its first line)."""
    for line in pods.logs(pod).splitlines():
        if line.startswith("START "):
            return float(line.split()[1])
    raise AssertionError(f"pod {pod} printed no START line")


def as_uptime(epoch: float) -> float:
    """A wall-clock time as the node's uptime then."""
    now_uptime = float(Path("/proc/uptime").read_text().split()[0])
    return epoch - (time.time() - now_uptime)


def hook_log() -> list[dict[str, Any]]:
    path = RECORDS / "hook.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def limit_set_before_start(agents: HostAgents, pod: str, uuid: str, mib: int) -> dict[str, Any]:
    """The fake's record of the container's limit, set before its command began, and the hook's log of it."""
    container = container_id(pod)
    cgroup = cgroup_of(container)
    held = agents.driver.memory_limit(cgroup, uuid)
    assert held is not None, f"no limit for {cgroup} on {uuid}: {agents.driver.memory_limits()}"
    assert held["hard"] == mib * 1024 * 1024 and held["soft"] == 0
    (logged,) = [e for e in hook_log() if e.get("container") == container]
    began = started_uptime(pod)
    set_at = as_uptime(held["setAt"])
    print(f"{pod}: limit set at uptime {set_at:.2f}, hook done {as_uptime(logged['done']):.2f}, command {began:.2f}")
    assert set_at <= as_uptime(logged["done"]) <= began + 0.02, "the limit came after the container's command"
    return held


def test_a_device_plugin_container_gets_its_limit_before_its_command_runs_and_two_processes_share_it(
    cluster: str, agents: HostAgents, agent: AgentProcess
) -> None:
    kubectl.apply(with_command(pods.manifest("dp-limited", {GPU: 1}), "sleep 3600 & sleep 3600 & " + pods.REPORT))
    pods.wait_running("dp-limited")
    env = pods.report("dp-limited").env
    uuid = env["NVIDIA_VISIBLE_DEVICES"]
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"  # MPS, the second layer, as before
    limit_set_before_start(agents, "dp-limited", uuid, 4096)
    # Two processes of the container: one limit, their use counted together against it.
    container = container_id("dp-limited")
    sleepers = [p for p in processes_of(container) if Path(f"/proc/{p}/comm").read_text().strip() == "sleep"]
    assert len(sleepers) >= 2
    agents.driver.set_processes(uuid, [(sleepers[0], 1 * GIB), (sleepers[1], 2 * GIB)], mps=True)
    limits = kubectl.wait_for(
        lambda: [x for x in status()["containerLimits"] if x["containerId"] == container and x["usedBytes"]],
        10,
        "the agent's read-back of the container's use",
    )
    (limit,) = limits
    assert (limit["limitBytes"], limit["usedBytes"]) == (4 * GIB, 3 * GIB)
    # The pod deleted: its cgroup goes, and so do its limit and the agent's record of it.
    cgroup = cgroup_of(container)
    pods.delete("dp-limited", graceful=True)
    kubectl.wait_for(lambda: agents.driver.memory_limit(cgroup, uuid) is None, RECONCILE_S, "its limit released")
    kubectl.wait_for(lambda: not (RECORDS / f"{container}.json").exists(), RECONCILE_S, "its record gone")


def test_a_tenants_own_pinned_memory_variable_changes_nothing_the_driver_enforces(
    cluster: str, agents: HostAgents, agent: AgentProcess
) -> None:
    """A pod that sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT itself (the whole GPU, and an entry for a GPU it cannot see:
    the shape that drops every pinned limit on driver 615) still gets the driver's limit of its share."""
    manifest = with_command(pods.manifest("lifts-its-own", {GPU: 1}), pods.REPORT)
    manifest["spec"]["containers"][0]["env"] = [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=16G,1=16G"}]
    kubectl.apply(manifest)
    pods.wait_running("lifts-its-own")
    env = pods.report("lifts-its-own").env
    print(f"the container's variable: {env['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT']}")
    limit_set_before_start(agents, "lifts-its-own", env["NVIDIA_VISIBLE_DEVICES"], 4096)


def processes_of(container: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if container in (entry / "cgroup").read_text():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_claims_container_gets_its_limit_before_its_command_runs(
    cluster: str, agents: HostAgents, agent: AgentProcess
) -> None:
    manifest = pods.manifest("claim-limited", {})
    manifest["spec"]["containers"][0]["resources"] = {"claims": [{"name": claims.CLAIM}]}
    manifest["spec"]["resourceClaims"] = [{"name": claims.CLAIM, "resourceClaimTemplateName": "claim-limited"}]
    kubectl.apply([claims.template("claim-limited", {"memory": "6Gi"}), with_command(manifest, pods.REPORT)])
    pods.wait_running("claim-limited")
    env = pods.report("claim-limited").env
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"
    limit_set_before_start(agents, "claim-limited", env["NVIDIA_VISIBLE_DEVICES"], 6144)


def test_a_container_restarted_while_the_agent_is_stopped_starts_capped_or_not_at_all(
    cluster: str, agents: HostAgents, agent: AgentProcess
) -> None:
    """A claim's container restarted by the kubelet while the agent is stopped: the kubelet starts it again with the
    devices its prepared claim named, and the hook, which needs no agent, limits it; a driver that refuses keeps it
    from starting, with the hook's reason. (A device-plugin container does not start at all meanwhile: the kubelet
    asks the agent's PreStartContainer first.)"""
    manifest = pods.manifest("restarts", {})
    manifest["spec"]["containers"][0]["resources"] = {"claims": [{"name": claims.CLAIM}]}
    manifest["spec"]["resourceClaims"] = [{"name": claims.CLAIM, "resourceClaimTemplateName": "restarts"}]
    template = claims.template("restarts", {"memory": "4Gi"})
    kubectl.apply([template, with_command(manifest, pods.REPORT, restart="Always")])
    pods.wait_running("restarts")
    uuid = pods.report("restarts").env["NVIDIA_VISIBLE_DEVICES"]
    agent.stop(signal.SIGTERM)  # the daemons are kept, and so are the claim's and the memory-limit devices' specs
    config = agents.directory / "nvml.json"
    document = json.loads(config.read_text())
    try:
        first = container_id("restarts")
        end_container(first)
        kubectl.wait_for(lambda: running_container("restarts") not in (None, first), 60, "a restart")
        again = container_id("restarts")
        assert agents.driver.memory_limit(cgroup_of(again), uuid)["hard"] == 4 * GIB
        assert [e for e in hook_log() if e.get("container") == again and e["event"] == "memory limits set"]
        # The driver now refuses (an older one, say): the container does not start, and the hook says why.
        config.write_text(json.dumps({**document, "memoryLimits": False}))
        end_container(again)
        message = kubectl.wait_for(lambda: refused_start("restarts"), 60, "the start refused")
        print(f"the kubelet's word: {message[:600]}")
        assert "memory limits were not set, so it does not start" in message
        assert running_container("restarts") is None
    finally:
        config.write_text(json.dumps(document))
        start(agents, cluster)


def end_container(container: str) -> None:
    for pid in processes_of(container):
        os.kill(pid, signal.SIGKILL)


def running_container(pod: str) -> str | None:
    for container in pods.get(pod)["status"].get("containerStatuses") or []:
        if (container.get("state") or {}).get("running"):
            return str(container["containerID"]).rpartition("://")[2]
    return None


def refused_start(pod: str) -> str | None:
    for container in pods.get(pod)["status"].get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        message = str(waiting.get("message", ""))
        if "does not start" in message:
            return message
        terminated = (container.get("lastState") or {}).get("terminated") or {}
        if "does not start" in str(terminated.get("message", "")):
            return str(terminated["message"])
    return None
