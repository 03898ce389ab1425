"""The command line as a user runs it: --once, --version, exit codes and messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mpsagent_testing.node import small_node
from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.repo import EXAMPLES, H100_NODE, ROOT

H100_XML = EXAMPLES / "node-h100x8.nvidia-smi.xml"
GPU_A, GPU_B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
CONFIG = EXAMPLES / "config-mps.yaml"


def mpsagent(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpsagent", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        check=False,
    )


def once_json(*args: str, env: dict[str, str] | None = None) -> dict:
    result = mpsagent("--once", "--output", "json", *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_version() -> None:
    result = mpsagent("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("mpsagent ")


def test_once_text_prints_the_plan() -> None:
    result = mpsagent("--once", "--node-snapshot", str(H100_NODE), "--config-file", str(CONFIG))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Resource nvidia.com/gpu: 8 GPUs x 4 replicas = 32 devices" in out
    assert "set_default_active_thread_percentage 100" in out
    assert "set_default_device_pinned_mem_limit 7 20389M" in out
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in out
    assert "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3-SHARED" in out


def test_once_json_has_the_documented_shape() -> None:
    plan = once_json("--node-snapshot", str(H100_NODE), "--config-file", str(CONFIG))
    assert len(plan["gpus"]) == 8
    (resource,) = plan["resources"]
    assert resource["name"] == "nvidia.com/gpu"
    assert resource["replicas"] == 4
    assert len(resource["deviceIds"]) == 32
    assert resource["deviceIds"][0] == f"{plan['gpus'][0]['uuid']}::0"
    assert resource["pipeDirectory"] == "/run/nvidia/mps/nvidia.com/gpu/pipe"
    assert resource["daemonCommands"][0] == "set_default_active_thread_percentage 100"
    one, two, whole, every = resource["examples"]
    assert one["request"] == 1 and one["kind"] == "capped"
    assert one["envs"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20389M"  # its one GPU, not the node's eight
    assert (two["title"], two["envs"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == ("2 replicas on one GPU", "50")
    assert two["ceilings"] == "threads 50%, memory 0=40779M," + ",".join(f"{o}=81559M" for o in range(1, 8))
    assert whole["request"] == 4 and whole["kind"] == "full" and whole["share"] == "4/4 of GPU 0 (whole)"
    assert every["request"] == 32 and every["kind"] == "full"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in every["envs"]
    assert plan["labels"]["nvidia.com/gpu.count"] == "8"
    assert plan["labels"]["nvidia.com/gpu.replicas"] == "4"


def test_once_shows_the_refusal_when_requests_greater_than_one_fail(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      replicas: 2\n")
    plan = once_json("--node-snapshot", str(H100_NODE), "--config-file", str(config))
    every = plan["resources"][0]["examples"][-1]
    assert every["error"] == (
        "nvidia.com/gpu: a request of 16 replicas is refused: sharing.mps.failRequestsGreaterThanOne is true "
        "(the default), which allows 1 per container; set it to false to allow more"
    )
    assert "envs" not in every


def test_nvidia_smi_xml_gives_the_same_plan_as_the_yaml_snapshot() -> None:
    from_yaml = once_json("--node-snapshot", str(H100_NODE), "--config-file", str(CONFIG))
    from_xml = once_json("--node-snapshot", str(H100_XML), "--config-file", str(CONFIG))
    assert from_xml["resources"][0]["deviceIds"] == from_yaml["resources"][0]["deviceIds"]
    assert from_xml["resources"][0]["examples"] == from_yaml["resources"][0]["examples"]
    assert [g["computeCapability"] for g in from_xml["gpus"]] == ["9.0"] * 8
    assert [g["numaNode"] for g in from_xml["gpus"]] == [None] * 8


def test_environment_variables_configure_the_dry_run() -> None:
    env = {
        **__import__("os").environ,
        "CONFIG_FILE": str(CONFIG),
        "NODE_SNAPSHOT": str(H100_NODE),
        "MPS_ROOT": "/srv/mps",
    }
    plan = once_json(env=env)
    assert plan["resources"][0]["pipeDirectory"] == "/srv/mps/nvidia.com/gpu/pipe"
    flag_wins = once_json("--mps-root", "/opt/mps", env=env)
    assert flag_wins["resources"][0]["pipeDirectory"] == "/opt/mps/nvidia.com/gpu/pipe"


def test_once_through_nvml(tmp_path: Path, fake_nvml_library: Path) -> None:
    nvml = tmp_path / "nvml.json"
    nvml.write_text(
        json.dumps(
            {
                "driverVersion": "550.54.15",
                "gpus": [
                    {
                        "uuid": GPU_A,
                        "name": "NVIDIA A100-SXM4-40GB",
                        "memoryTotal": 42949672960,
                        "major": 8,
                        "minor": 0,
                        "pciBusId": "00000000:07:00.0",
                        "migMode": 0,
                    },
                    {
                        "uuid": GPU_B,
                        "name": "NVIDIA A100-SXM4-40GB",
                        "memoryTotal": 42949672960,
                        "major": 8,
                        "minor": 0,
                        "pciBusId": "00000000:0F:00.0",
                        "migMode": 0,
                    },
                ],
            }
        )
    )
    env = fake_nvml_env(fake_nvml_library, nvml, tmp_path / "state.json")
    plan = once_json("--config-file", str(CONFIG), env=env)
    assert plan["gpuSource"] == "NVML"
    assert plan["driverVersion"] == "550.54.15"
    assert [(g["uuid"], g["index"], g["computeCapability"], g["pciBusId"]) for g in plan["gpus"]] == [
        (GPU_A, 0, "8.0", "00000000:07:00.0"),
        (GPU_B, 1, "8.0", "00000000:0F:00.0"),
    ]
    assert plan["resources"][0]["computeMode"]["set"] == "EXCLUSIVE_PROCESS"
    assert plan["resources"][0]["daemonCommands"][1] == "set_default_device_pinned_mem_limit 0 40960M"


def test_mig_enabled_gpu_is_refused(tmp_path: Path, fake_nvml_library: Path) -> None:
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"gpus": [{"uuid": GPU_A, "migMode": 1}]}))
    result = mpsagent("--once", "--config-file", str(CONFIG), env=fake_nvml_env(fake_nvml_library, nvml))
    assert result.returncode == 2
    assert f"sharing.mps.resources[0].devices: GPU 0 ({GPU_A}) has MIG enabled" in result.stderr


def test_no_driver_is_a_runtime_failure_with_advice(tmp_path: Path, fake_nvml_library: Path) -> None:
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"initError": 9, "gpus": []}))
    result = mpsagent("--once", "--config-file", str(CONFIG), env=fake_nvml_env(fake_nvml_library, nvml))
    assert result.returncode == 1
    assert "NVML could not be initialised" in result.stderr
    assert "--node-snapshot" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no configuration given: pass --config-file"),
        (("--config-file", "/nonexistent.yaml"), "--config-file /nonexistent.yaml: no such file"),
        (("--config-file", str(CONFIG), "--node-snapshot", "/nonexistent.yaml"), "--node-snapshot /nonexistent.yaml"),
    ],
)
def test_usage_errors_exit_2_without_traceback(args: tuple[str, ...], message: str) -> None:
    result = mpsagent("--once", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_flag_value_exits_2() -> None:
    result = mpsagent("--once", "--output", "yaml")
    assert result.returncode == 2
    assert "--output" in result.stderr


def test_a_relative_mps_root_is_refused() -> None:
    result = mpsagent("--once", "--node-snapshot", str(H100_NODE), "--config-file", str(CONFIG), "--mps-root", "mps")
    assert result.returncode == 2
    assert result.stderr == (
        "mpsagent: error: --mps-root (env MPS_ROOT, config flags.mpsRoot) must be an absolute path: the kubelet "
        "mounts it into containers from the host; not `mps`\n"
    )


@pytest.mark.parametrize(
    ("plant", "kind"),
    [
        (os.mkfifo, "a FIFO"),
        (lambda path: path.symlink_to("/dev/zero"), "a symbolic link"),
        (lambda path: path.mkdir(), "a directory"),
    ],
)
def test_status_reads_only_a_regular_file(tmp_path: Path, plant: Callable[[Path], None], kind: str) -> None:
    plant(tmp_path / "status.json")
    result = mpsagent("--status", "--mps-root", str(tmp_path), timeout=10)
    assert result.returncode == 2
    assert result.stderr == (
        f"mpsagent: error: the agent status {tmp_path / 'status.json'} is {kind}, not a regular file; remove it\n"
    )


def test_status_refuses_a_file_larger_than_any_status(tmp_path: Path) -> None:
    with (tmp_path / "status.json").open("wb") as file:
        file.truncate(65 * 1024 * 1024)  # sparse: costs nothing
    result = mpsagent("--status", "--mps-root", str(tmp_path), timeout=10)
    assert result.returncode == 2
    assert result.stderr == (
        f"mpsagent: error: the agent status {tmp_path / 'status.json'} is larger than 64 MiB; remove it\n"
    )


MEMORY_UNITS = (
    "version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu-mem\n      memoryUnit: {unit}\n      devices: 1\n"
)


def test_once_shows_what_memory_units_get(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(MEMORY_UNITS.format(unit="8Gi"))
    plan = once_json("--node-snapshot", str(H100_NODE), "--config-file", str(config))
    (resource,) = plan["resources"]
    assert resource["name"] == "nvidia.com/gpu-mem"
    assert resource["memoryUnitBytes"] == 8 * 1024**3
    assert len(resource["deviceIds"]) == 9  # 81559 MiB holds 9 units of 8 GiB
    one, seven, whole = resource["examples"]
    assert [e["title"] for e in resource["examples"]] == [
        "1 memory unit",
        "7 memory units on one GPU",
        "a whole GPU (9 memory units)",
    ]
    assert one["envs"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert (seven["envs"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], seven["envs"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == (
        "0=57344M",
        "77",
    )
    assert seven["ceilings"] == "threads 77%, memory 0=57344M"
    assert whole["kind"] == "full" and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in whole["envs"]


@pytest.mark.parametrize(
    ("unit", "message"),
    [
        ("8GB", "sharing.mps.resources[0].memoryUnit: `8GB` is not a Kubernetes quantity"),
        ("100Gi", "sharing.mps.resources[0].memoryUnit: is larger than GPU 0's memory (81559 MiB)"),
    ],
)
def test_a_bad_memory_unit_exits_2_naming_the_key(tmp_path: Path, unit: str, message: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(MEMORY_UNITS.format(unit=unit))
    result = mpsagent("--once", "--node-snapshot", str(H100_NODE), "--config-file", str(config))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_replicas_that_would_cap_a_gpu_at_0_mib_exit_2_at_start(tmp_path: Path) -> None:
    """A 47 MiB GPU of 48 replicas: 0M is no limit to MPS, and the running agent refused every capped Allocate."""
    node = small_node(tmp_path / "node.json", gpus=1, memory_bytes=47 * 1024**2)
    config = tmp_path / "c.yaml"
    config.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      replicas: 48\n")
    result = mpsagent("--once", "--node-snapshot", str(node), "--config-file", str(config))
    assert result.returncode == 2
    assert result.stderr.startswith(
        "mpsagent: error: sharing.mps.resources[0].replicas: gives GPU 0 (GPU-00000000-aaaa-bbbb-cccc-dddddddddddd, "
        "47 MiB) a memory cap of 0 MiB for one replica, which MPS reads as no limit at all; use at most 47 replicas"
    ), result.stderr
    assert "Traceback" not in result.stderr
