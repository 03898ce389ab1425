"""`--once`'s report: the typed document, its JSON (pinned byte for byte) and its text, built in-process."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mpsagent.config import check_config, parse_config
from mpsagent.devices import Gpu, GpuUuid, NodeGpus
from mpsagent.plan import NodePlan, build_plan
from mpsagent.report import plan_report, render_json, render_text

GOLDEN = Path(__file__).parent / "golden"
CONTROL_BIN = "nvidia-cuda-mps-control"


def uuid(index: int) -> GpuUuid:
    return GpuUuid(f"GPU-{index:08d}-aaaa-bbbb-cccc-dddddddddddd")


def t4(index: int, *, numa_node: int | None) -> Gpu:
    return Gpu(
        uuid=uuid(index),
        index=index,
        name="Tesla T4",
        memory_bytes=16 * 1024**3,
        compute_capability=(7, 5),
        pci_bus_id=f"00000000:{index + 1:02X}:00.0",
        numa_node=numa_node,
        mig_enabled=False,
    )


def two_t4_plan(resources: str, flags: str = "") -> NodePlan:
    """Two T4s (the first of unknown NUMA node) shared by these sharing.mps.resources (YAML flow mappings)."""
    text = "version: v1\nsharing:\n  mps:\n    resources:\n" + textwrap.indent(resources, "    ")
    if flags:
        text += f"flags: {flags}\n"
    sharing = check_config(parse_config(text, "config.yaml"))
    node = NodeGpus(driver_version="550.54.15", gpus=(t4(0, numa_node=None), t4(1, numa_node=0)), source="test")
    return build_plan(sharing, node, Path("/run/nvidia/mps"))


REPLICAS_AND_UNITS = """\
- {name: nvidia.com/gpu, replicas: 4, devices: [0]}
- {name: nvidia.com/gpu-mem, memoryUnit: 4Gi, devices: [1]}
"""
SCENARIOS = {
    "replicas-and-units": (two_t4_plan(REPLICAS_AND_UNITS), True, None),
    "cdi-multi-user": (
        two_t4_plan("- {name: nvidia.com/gpu, replicas: 2}\n", "{plugin: {deviceListStrategy: cdi-cri}}"),
        False,
        True,
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("output", ["json", "txt"])
def test_report_prints_what_it_printed_before_the_document_was_typed(scenario: str, output: str) -> None:
    """Scripts parse `--once --output json`: the bytes are pinned (tests/golden/once-*, written by the dict-built
    report this replaced)."""
    plan, manages_compute_mode, offered = SCENARIOS[scenario]
    report = plan_report(
        plan, control_bin=CONTROL_BIN, manages_compute_mode=manages_compute_mode, multi_user_offered=offered
    )
    printed = render_json(report) if output == "json" else render_text(report)
    assert printed == (GOLDEN / f"once-{scenario}.{output}").read_text()
