"""The NVML adapter's pieces that do not need the library: sysfs NUMA lookup."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpsagent.gpu.nvml import read_numa_node, sysfs_bus_id


def test_sysfs_names_the_bus_id_with_a_short_lowercase_domain() -> None:
    assert sysfs_bus_id("00000000:AB:00.0") == "0000:ab:00.0"
    assert sysfs_bus_id("00000001:18:00.0") == "0001:18:00.0"


@pytest.mark.parametrize(("content", "expected"), [("1\n", 1), ("0\n", 0), ("-1\n", None), ("junk", None)])
def test_numa_node_from_sysfs(tmp_path: Path, content: str, expected: int | None) -> None:
    device = tmp_path / "bus/pci/devices/0000:ab:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text(content)
    assert read_numa_node(tmp_path, "00000000:AB:00.0") == expected


def test_missing_numa_node_is_unknown(tmp_path: Path) -> None:
    assert read_numa_node(tmp_path, "00000000:AB:00.0") is None
