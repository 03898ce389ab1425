"""The status document: built from live state, written to status.json, read back by `--status` and rendered;
in-process, with the clocks fixed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mpsagent import cli
from mpsagent.allocation import ResourceAllocator
from mpsagent.config import check_config, parse_config
from mpsagent.devices import ContainerRef, Gpu, GpuUuid, NodeGpus
from mpsagent.inventory import Inventory
from mpsagent.ledger import Ledger
from mpsagent.plan import build_plan
from mpsagent.status import (
    STATUS_FILE,
    DaemonView,
    ResourceView,
    status_document,
    write_status,
)

GOLDEN = Path(__file__).parent / "golden"
WALL = 1_764_547_200.0  # 2025-12-01T00:00:00Z
MONOTONIC = 5000.0
CONFIG = """\
version: v1
sharing:
  mps:
    failRequestsGreaterThanOne: false
    resources:
    - {name: nvidia.com/gpu, replicas: 4, devices: [0, 1]}
    - {name: nvidia.com/gpu-mem, memoryUnit: 4Gi, devices: [2]}
"""


def uuid(index: int) -> GpuUuid:
    return GpuUuid(f"GPU-{index:08d}-aaaa-bbbb-cccc-dddddddddddd")


def t4(index: int) -> Gpu:
    return Gpu(
        uuid=uuid(index),
        index=index,
        name="Tesla T4",
        memory_bytes=16 * 1024**3,
        compute_capability=(7, 5),
        pci_bus_id=f"00000000:{index + 1:02X}:00.0",
        numa_node=0,
        mig_enabled=False,
    )


@pytest.fixture
def fixed_clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: WALL)
    monkeypatch.setattr(time, "monotonic", lambda: MONOTONIC)


def serving_views() -> list[ResourceView]:
    """Two resources: one serving three grants (capped, full and adopted, one no longer listed), a GPU unhealthy
    and its caps changed behind the agent once; one whose daemon is down and never registered."""
    plan = build_plan(
        check_config(parse_config(CONFIG, "config.yaml")),
        NodeGpus(driver_version="550.54.15", gpus=(t4(0), t4(1), t4(2)), source="test"),
        Path("/run/nvidia/mps"),
    )
    gpus, units = plan.resources
    allocator = ResourceAllocator(gpus, plan.shm_directory, Ledger(lambda: WALL - 60, lambda: MONOTONIC - 60))
    ids = gpus.device_ids
    capped, full = allocator.allocate([ids[:1], ids[4:8]])
    capped.record.grant.owner = ContainerRef(namespace="ml", pod="train-0", container="main")
    full.record.grant.missing_since = MONOTONIC - 30
    serve = ContainerRef(namespace="ml", pod="serve-1", container="main")
    allocator.ledger.adopt(ids[1:2], gpus.shares.share_of(ids[1:2]), serve)
    inventory = Inventory(gpus, daemon_ready=True)
    inventory.set_gpu_problem(uuid(1), "nvml", present=True)
    serving = ResourceView(
        allocator=allocator,
        inventory=inventory,
        daemon=DaemonView(
            pid=4242,
            up=True,
            ceilings=allocator.ceilings(),
            restarts=1,
            restart_attempts=2,
            multi_user=False,
            cap_tamper=1,
            last_cap_tamper=(WALL - 10, "active thread percentage 100, set 50"),
        ),
        registered=True,
        registrations=2,
        registration_failures=1,
    )
    down = ResourceView(
        allocator=ResourceAllocator(units, plan.shm_directory),
        inventory=Inventory(units),
        daemon=DaemonView(
            pid=None,
            up=False,
            ceilings=None,
            restarts=0,
            front_end_failure=(WALL - 20, "nvidia-cuda-mps-control: Permission denied"),
        ),
        registered=False,
        registrations=0,
    )
    return [serving, down]


def write_serving_status(root: Path) -> None:
    document = status_document(
        version="1.2.3",
        pid=2**22 + 1,  # above any default pid_max: not a running process
        tasks=17,
        pod_resources={
            "socket": "/var/lib/kubelet/pod-resources/kubelet.sock",
            "available": True,
            "answers": 40,
            "failures": 3,
        },
        unhealthy_gpus={uuid(1): "Xid 79 (fallen off the bus)"},
        resources=serving_views(),
    )
    write_status(root, document)


@pytest.mark.usefixtures("fixed_clocks")
def test_the_status_file_holds_what_it_held_before_the_document_was_typed(tmp_path: Path) -> None:
    """Scripts and older `--status` read status.json: its bytes are pinned (tests/golden/status.json, written by
    the dict-built document this replaced)."""
    write_serving_status(tmp_path)
    assert (tmp_path / STATUS_FILE).read_text() == (GOLDEN / "status.json").read_text()


@pytest.mark.usefixtures("fixed_clocks")
@pytest.mark.parametrize("output", ["json", "txt"])
def test_status_prints_what_it_printed_before_the_document_was_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str
) -> None:
    write_serving_status(tmp_path)
    assert cli.run(["--status", "--mps-root", str(tmp_path), "--output", output.replace("txt", "text")]) == 0
    assert capsys.readouterr().out == (GOLDEN / f"status-printed.{output}").read_text()
