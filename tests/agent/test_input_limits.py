"""Hostile input files at the command line: alias bombs, special files, oversized files and values, absurd
nesting and numbers, malformed GPU values, too many GPUs. Each is refused in bounded time and memory with exit 2
and one line naming the file and what is wrong; the agent never expands, hangs, or prints a traceback."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mpsagent_testing.nvml.build import fake_nvml_env
from mpsagent_testing.repo import EXAMPLES, H100_NODE, ROOT

CONFIG = EXAMPLES / "config-mps.yaml"
H100_XML = EXAMPLES / "node-h100x8.nvidia-smi.xml"
MEMORY_LIMIT = 1 << 30  # far above what a refusal needs, far below what an alias bomb expands to
SECONDS = 30
MAX_MESSAGE_CHARS = 600
MAX_CONFIG_BYTES = 1 << 20  # as docs/configuration.md says
MAX_SNAPSHOT_BYTES = 4 << 20
MAX_GPUS_PER_NODE = 64

ALIAS_BOMB = "version: v1\na: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n"
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
)


def once(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`mpsagent --once`, with its memory bounded (an expansion fails the test instead of the machine)."""

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run(
        [sys.executable, "-m", "mpsagent", "--once", *args],
        capture_output=True,
        text=True,
        timeout=SECONDS,
        cwd=ROOT,
        env=env,
        preexec_fn=limit_memory,
        check=False,
    )


def refused(*args: str, env: dict[str, str] | None = None) -> str:
    """Run `--once`, expect exit 2 with one short line; return that line."""
    result = once(*args, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("mpsagent: error: ")
    assert result.stderr.count("\n") == 1, result.stderr[:2000]
    assert len(result.stderr) < MAX_MESSAGE_CHARS, result.stderr[:2000]
    return result.stderr


def with_config(path: Path) -> tuple[str, ...]:
    return ("--node-snapshot", str(H100_NODE), "--config-file", str(path))


def with_snapshot(path: Path) -> tuple[str, ...]:
    return ("--config-file", str(CONFIG), "--node-snapshot", str(path))


def gpu(position: int, **fields: object) -> dict[str, object]:
    return {
        "uuid": f"GPU-{position:08x}-aaaa-bbbb-cccc-dddddddddddd",
        "index": position,
        "name": "NVIDIA H100 80GB HBM3",
        "memoryBytes": 85520809984,
        "computeCapability": "9.0",
        "pciBusId": f"00000000:{position + 1:02X}:00.0",
        "numaNode": 0,
        **fields,
    }


def snapshot_file(path: Path, gpus: list[dict[str, object]], **fields: object) -> Path:
    path.write_text(json.dumps({"driverVersion": "550.90.07", "gpus": gpus, **fields}))
    return path


# --- alias bombs and file sizes (item 5) ---------------------------------------------------------------------


def test_an_alias_bomb_config_is_refused_without_expanding_it(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 1000
    message = refused(*with_config(path))
    assert str(path) in message and "aliases" in message


def test_an_alias_bomb_snapshot_is_refused_without_expanding_it(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB.replace("version: v1", "driverVersion: '550.90.07'"))
    message = refused(*with_snapshot(path))
    assert str(path) in message and "aliases" in message


def test_a_config_with_a_few_harmless_anchors_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "version: v1\nsharing:\n  mps:\n    resources:\n"
        "    - &first {name: gpu, replicas: 2, devices: [0, 1, 2, 3]}\n"
        "    - {<<: *first, name: gpu-b, devices: [4, 5, 6, 7]}\n"
    )
    result = once(*with_config(path), "--output", "json")
    assert result.returncode == 0, result.stderr
    assert [r["name"] for r in json.loads(result.stdout)["resources"]] == ["nvidia.com/gpu", "nvidia.com/gpu-b"]


def test_a_config_that_refers_to_itself_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("version: v1\nflags: &f {gfd: [*f]}\n")
    assert "refers to itself" in refused(*with_config(path))


def test_an_oversized_config_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(CONFIG.read_text() + "#" * MAX_CONFIG_BYTES)
    message = refused(*with_config(path))
    assert str(path) in message and "larger than 1 MiB" in message


def test_an_oversized_snapshot_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "big.xml"
    path.write_text(H100_XML.read_text() + "<!--" + "x" * MAX_SNAPSHOT_BYTES + "-->")
    message = refused(*with_snapshot(path))
    assert str(path) in message and "larger than 4 MiB" in message


# --- special files (item 11) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["config", "snapshot"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory"])
def test_only_regular_files_are_read(tmp_path: Path, which: str, kind: str) -> None:
    path = tmp_path / "special"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    message = refused(*(with_config(path) if which == "config" else with_snapshot(path)))
    flag = "--config-file" if which == "config" else "--node-snapshot"
    assert f"{flag} {path}: " in message and "not a regular file" in message


def test_a_link_to_a_regular_file_is_read_as_configmaps_mount_them(tmp_path: Path) -> None:
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "config.yaml").write_text(CONFIG.read_text())
    (tmp_path / "config.yaml").symlink_to(tmp_path / "..data" / "config.yaml")
    (tmp_path / "node.yaml").symlink_to(H100_NODE)
    result = once("--config-file", str(tmp_path / "config.yaml"), "--node-snapshot", str(tmp_path / "node.yaml"))
    assert result.returncode == 0, result.stderr


# --- nesting and numbers (item 17) -----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["config", "snapshot"])
@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        pytest.param("gpus: " + "[" * 1000 + "]" * 1000 + "\n", "nests deeper than", id="nesting"),
        pytest.param("gpus:\n- index: " + "7" * 5000 + "\n", "a number of 5000 digits", id="huge-integer"),
    ],
)
def test_absurd_nesting_and_numbers_are_refused(tmp_path: Path, which: str, text: str, phrase: str) -> None:
    path = tmp_path / "absurd.yaml"
    path.write_text(("version: v1\n" if which == "config" else "") + text)
    message = refused(*(with_config(path) if which == "config" else with_snapshot(path)))
    assert str(path) in message and phrase in message


# --- snapshot values (item 9) and the GPU count (item 12) ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "key", "phrase"),
    [
        pytest.param({"uuid": "GPU-0,all"}, "gpus[1].uuid", "`GPU-0,all` is not an NVIDIA GPU UUID", id="uuid-comma"),
        pytest.param(
            {"uuid": "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd\n"}, "gpus[1].uuid", "not an NVIDIA", id="uuid-newline"
        ),
        pytest.param({"uuid": "MIG-GPU-1/0/0"}, "gpus[1].uuid", "not an NVIDIA GPU UUID", id="uuid-mig"),
        pytest.param({"memoryBytes": 2**70}, "gpus[1].memoryBytes", "between 1 MiB and 16 TiB", id="memory-huge"),
        pytest.param({"memoryBytes": 1000}, "gpus[1].memoryBytes", "between 1 MiB and 16 TiB", id="memory-tiny"),
        pytest.param({"index": -1}, "gpus[1].index", "from 0 to 63", id="index-negative"),
        pytest.param({"index": 64}, "gpus[1].index", "from 0 to 63", id="index-large"),
        pytest.param({"computeCapability": "900.0"}, "gpus[1].computeCapability", 'like "9.0"', id="capability"),
        pytest.param(
            {"computeCapability": "99.99"},
            "gpus[1].computeCapability",
            'must look like "9.0" (major 1 to 19, minor 0 to 9), not 99.99',
            id="capability-99.99",
        ),
        pytest.param({"computeCapability": "12.10"}, "gpus[1].computeCapability", "not 12.10", id="capability-minor"),
        pytest.param({"numaNode": 5000}, "gpus[1].numaNode", "from 0 to 1023", id="numa"),
        pytest.param({"pciBusId": "00000000:18:00.0,x"}, "gpus[1].pciBusId", "DOMAIN:BUS:DEVICE.FUNCTION", id="pci"),
        pytest.param({"name": "H100\nX"}, "gpus[1].name", "printable", id="name-newline"),
        pytest.param({"name": "N" * 200}, "gpus[1].name", "at most 96", id="name-long"),
    ],
)
def test_every_snapshot_field_is_checked_and_named(
    tmp_path: Path, fields: dict[str, object], key: str, phrase: str
) -> None:
    path = snapshot_file(tmp_path / "node.json", [gpu(0), gpu(1, **fields)])
    message = refused(*with_snapshot(path))
    assert f"node snapshot {path}: {key}" in message and phrase in message


def test_the_driver_version_is_checked(tmp_path: Path) -> None:
    path = snapshot_file(tmp_path / "node.json", [gpu(0)], driverVersion="550.90.07; rm -rf /")
    message = refused(*with_snapshot(path))
    assert f"node snapshot {path}: driverVersion" in message


def test_a_malformed_uuid_in_nvidia_smi_xml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.xml"
    path.write_text(H100_XML.read_text().replace("GPU-d23f0824-128b-4f33-8c5c-7fd0a6a3a450", "GPU-0,all", 1))
    message = refused(*with_snapshot(path))
    assert f"node snapshot {path}: gpus[1].uuid `GPU-0,all` is not an NVIDIA GPU UUID" in message


def test_a_malformed_uuid_from_nvml_is_refused(tmp_path: Path, fake_nvml_library: Path) -> None:
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"gpus": [{"uuid": "GPU-00000000-0000-0000-0000-000000000000"}, {"uuid": "GPU-0,all"}]}))
    result = once("--config-file", str(CONFIG), env=fake_nvml_env(fake_nvml_library, nvml))
    assert result.returncode == 1, result.stderr
    assert "NVML reports GPU 1 with uuid `GPU-0,all`, which is not an NVIDIA GPU UUID" in result.stderr
    assert "Traceback" not in result.stderr


def test_more_gpus_than_a_node_can_have_are_refused(tmp_path: Path) -> None:
    count = MAX_GPUS_PER_NODE + 1
    path = snapshot_file(tmp_path / "node.json", [gpu(i) for i in range(count)])
    message = refused(*with_snapshot(path))
    assert f"lists {count} GPUs; a node has at most {MAX_GPUS_PER_NODE}" in message


def test_the_largest_node_is_accepted(tmp_path: Path) -> None:
    path = snapshot_file(tmp_path / "node.json", [gpu(i) for i in range(MAX_GPUS_PER_NODE)])
    result = once(*with_snapshot(path), "--output", "json")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["resources"][0]["deviceIds"]) == MAX_GPUS_PER_NODE * 4


# --- names (item 14) and echoed values (item 16) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        pytest.param({"name": "nvidia.com/gpu\n", "replicas": 2}, "sharing.mps.resources[0].name", id="name"),
        pytest.param(
            {"name": "nvidia.com/gpu", "rename": "gpu-shared\n", "replicas": 2},
            "sharing.mps.resources[0].rename",
            id="rename",
        ),
    ],
)
def test_a_name_with_a_final_newline_is_refused(tmp_path: Path, entry: dict[str, object], key: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"version": "v1", "sharing": {"mps": {"resources": [entry]}}}))
    message = refused(*with_config(path))
    assert f"mpsagent: error: {key}: " in message and "\\n" in message  # shown escaped, on the one line


BIG = "x" * 900_000


@pytest.mark.parametrize(
    "document",
    [
        pytest.param({"flags": {"migStrategy": BIG}}, id="enum-value"),
        pytest.param({"flags": {"logLevel": BIG}}, id="setting"),
        pytest.param({"flags": {"reconcileGraceSeconds": BIG}}, id="msgspec-type"),
        pytest.param({"flags": {"k" * 1000: 1}}, id="unknown-key"),  # YAML allows simple keys of 1024 at most
        pytest.param({"sharing": {"mps": {"resources": [{"name": BIG, "replicas": 2}]}}}, id="name"),
        pytest.param({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": BIG}]}}}, id="all"),
        pytest.param({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": [BIG]}]}}}, id="ref"),
        pytest.param({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": int("9" * 4000)}]}}}, id="int"),
    ],
)
def test_a_huge_bad_config_value_is_echoed_in_a_few_characters(tmp_path: Path, document: dict[str, object]) -> None:
    path = tmp_path / "config.json"
    base: dict[str, object] = {"version": "v1", "sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2}]}}}
    path.write_text(json.dumps(base | document))
    assert len(refused(*with_config(path))) < MAX_MESSAGE_CHARS


def test_a_huge_bad_snapshot_value_is_echoed_in_a_few_characters(tmp_path: Path) -> None:
    path = snapshot_file(tmp_path / "node.json", [gpu(0, computeCapability=BIG)])
    assert "computeCapability" in refused(*with_snapshot(path))


# --- the reconcile grace period (item 8) -----------------------------------------------------------------------


@pytest.mark.parametrize("seconds", ["0", "9.9"])
def test_a_grace_period_below_the_floor_is_refused(seconds: str) -> None:
    message = refused(*with_config(CONFIG), "--reconcile-grace-seconds", seconds)
    assert "--reconcile-grace-seconds (env RECONCILE_GRACE_SECONDS, config flags.reconcileGraceSeconds)" in message
    assert "from 10 to 86400" in message and f"`{seconds}`" in message
