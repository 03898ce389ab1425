"""`--once`'s report: the typed document, its JSON (pinned byte for byte) and its text, built in-process."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from mpsagent.documents.report import plan_report, render_json, render_text
from mpsagent.documents.report_document import PlanReport
from mpsagent.domain.plan import NodePlan
from mpsagent_testing.domain import gpu, node_gpus, node_plan

GOLDEN = Path(__file__).parent / "golden"
CONTROL_BIN = "nvidia-cuda-mps-control"


def two_t4_plan(*resources: str, flags: str = "") -> NodePlan:
    """Two T4s (the first of unknown NUMA node) shared by these sharing.mps.resources (YAML flow mappings)."""
    return node_plan(node_gpus(gpu(0, numa_node=None), gpu(1)), *resources, flags=flags)


REPLICAS_AND_UNITS = (
    "{name: nvidia.com/gpu, replicas: 4, devices: [0]}",
    "{name: nvidia.com/gpu-mem, memoryUnit: 4Gi, devices: [1]}",
)
SCENARIOS = {
    "replicas-and-units": (two_t4_plan(*REPLICAS_AND_UNITS), True, None),
    "cdi-multi-user": (
        two_t4_plan("{name: nvidia.com/gpu, replicas: 2}", flags="{plugin: {deviceListStrategy: cdi-cri}}"),
        False,
        True,
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("output", ["json", "txt"])
def test_report_prints_what_it_printed_before_the_document_was_typed(scenario: str, output: str) -> None:
    """Scripts parse `--once --output json`: the bytes are pinned (tests/documents/golden/once-*, written by the
    dict-built report this replaced)."""
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
    plan = node_plan(node_gpus(gpu(0)), "{name: nvidia.com/gpu, replicas: 2}", mps="enforceCaps: false")
    report = plan_report(plan, control_bin=CONTROL_BIN, manages_compute_mode=True, multi_user_offered=True)
    assert report.resources[0].ceilings.enforced_at_daemon is False
    lines = render_text(report).splitlines()
    assert "  caps are not enforced at the daemon (sharing.mps.enforceCaps: false): it holds the full hardware" in lines
    assert "  daemon ceilings until the live grants are known (the smallest share):" not in lines
