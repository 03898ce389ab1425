"""`--once`'s report: the typed document, its JSON (pinned byte for byte) and its text, built in-process."""

from __future__ import annotations

import textwrap
from pathlib import Path

import msgspec
import pytest

from mpsagent.base.config import check_config, parse_config
from mpsagent.base.devices import Gpu, GpuUuid, NodeGpus
from mpsagent.documents.report import plan_report, render_json, render_text
from mpsagent.documents.report_document import PlanReport
from mpsagent.domain.plan import NodePlan, build_plan

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


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_printed_json_reads_back_as_the_report(scenario: str) -> None:
    """A script can decode `--once --output json` with the same types: every field's wire name is its own."""
    plan, manages_compute_mode, offered = SCENARIOS[scenario]
    report = plan_report(
        plan, control_bin=CONTROL_BIN, manages_compute_mode=manages_compute_mode, multi_user_offered=offered
    )
    assert msgspec.json.decode(render_json(report), type=PlanReport) == report


def test_a_refused_example_names_its_error_and_nothing_it_was_not_given() -> None:
    plan, _, _ = SCENARIOS["replicas-and-units"]
    report = plan_report(plan, control_bin=CONTROL_BIN, manages_compute_mode=True, multi_user_offered=None)
    refused = report.resources[0].examples[1]
    message = (
        "nvidia.com/gpu: a request of 2 replicas is refused: sharing.mps.failRequestsGreaterThanOne is true "
        "(the default), which allows 1 per container; set it to false to allow more"
    )
    assert (refused.title, refused.error) == ("2 replicas on one GPU", message)
    assert list(msgspec.to_builtins(refused)) == ["request", "title", "kind", "error", "ceilings"]
    assert f"    refused: {message}" in render_text(report).splitlines()


def test_caps_left_to_the_containers_say_so() -> None:
    """sharing.mps.enforceCaps: false: the daemon holds the full hardware, and the text says so."""
    text = textwrap.dedent("""\
        version: v1
        sharing:
          mps:
            enforceCaps: false
            resources:
            - {name: nvidia.com/gpu, replicas: 2}
        """)
    node = NodeGpus(driver_version="550.54.15", gpus=(t4(0, numa_node=0),), source="test")
    plan = build_plan(check_config(parse_config(text, "config.yaml")), node, Path("/run/nvidia/mps"))
    report = plan_report(plan, control_bin=CONTROL_BIN, manages_compute_mode=True, multi_user_offered=True)
    assert report.resources[0].ceilings.enforced_at_daemon is False
    lines = render_text(report).splitlines()
    assert "  caps are not enforced at the daemon (sharing.mps.enforceCaps: false): it holds the full hardware" in lines
    assert "  daemon ceilings until the live grants are known (the smallest share):" not in lines
