"""The status document: built from live state, written to status.json, read back by `--status` and rendered;
in-process, with the clocks fixed."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import msgspec
import pytest

from mpsagent import cli
from mpsagent.base.clock import utc
from mpsagent.base.devices import ContainerRef
from mpsagent.documents.status import (
    GrantEntries,
    ResourceView,
    readiness_problems,
    render_status_text,
    starting_document,
    status_document,
    summary,
    taint_rule_status,
)
from mpsagent.documents.status_document import DraStatus, GrantStatus, PodResourcesStatus
from mpsagent.documents.status_file import STATUS_FILE, write_status
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.claims import TaintRule, TaintSelector
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.ledger import Ledger
from mpsagent.domain.reconcile import ListedGrant
from mpsagent.kubelet.registration_record import Registration
from mpsagent.mps.daemon_status import (
    CapTamperEvent,
    CeilingsStatus,
    ControlLogStatus,
    DaemonBusy,
    DaemonStatus,
    FrontEndFailure,
    RecordDamage,
    ceiling_mode,
)
from mpsagent_testing.domain import gpus_of, node_gpus, node_plan, uuid

GOLDEN = Path(__file__).parent / "golden"
WALL = 1_764_547_200.0  # 2025-12-01T00:00:00Z
MONOTONIC = 5000.0
RESOURCES = (
    "{name: nvidia.com/gpu, replicas: 4, devices: [0, 1]}",
    "{name: nvidia.com/gpu-mem, memoryUnit: 4Gi, devices: [2]}",
)
"""The config's resources, on three T4s."""


@pytest.fixture
def fixed_clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: WALL)
    monkeypatch.setattr(time, "monotonic", lambda: MONOTONIC)


def serving_views() -> list[ResourceView]:
    """Two resources: one serving three grants (capped, full and adopted, one never listed yet), a GPU unhealthy
    and its caps changed behind the agent once; one whose daemon is down (its record damaged) and never
    registered."""
    plan = node_plan(node_gpus(*gpus_of(3)), *RESOURCES, mps="failRequestsGreaterThanOne: false")
    gpus, units = plan.resources
    allocator = ResourceAllocator(gpus, plan.shm_directory, Ledger(lambda: WALL - 60, lambda: MONOTONIC - 60))
    ids = gpus.device_ids
    capped, full = allocator.allocate([ids[:1], ids[4:8]])
    allocator.ledger.mark_listed(capped.record.grant, ContainerRef(namespace="ml", pod="train-0", container="main"))
    allocator.ledger.mark_unlisted(full.record.grant, MONOTONIC - 30)
    serve = ContainerRef(namespace="ml", pod="serve-1", container="main")
    allocator.ledger.adopt(ids[1:2], gpus.shares.share_of(ids[1:2]), serve)
    inventory = Inventory(gpus, daemon_ready=True)
    inventory.set_gpu_problem(uuid(1), "nvml", present=True)
    serving = ResourceView(
        allocator=allocator,
        inventory=inventory,
        daemon=DaemonStatus(
            pid=4242,
            up=True,
            cap_mode=ceiling_mode(allocator.ceilings(), gpus.shares.full_hardware()),
            ceilings=CeilingsStatus.of(allocator.ceilings()),
            restarts=1,
            restart_attempts=2,
            multi_user=False,
            cap_tamper=3,
            cap_tamper_in_log=2,
            last_cap_tamper=CapTamperEvent(
                at=utc(WALL - 10),
                found="`set_default_device_pinned_mem_limit 0 5120M` set the default pinned memory limit of ordinal 0 "
                "to 5120 MiB; the ledger wants 5461 MiB",
                seen_by="control_log",
            ),
            control_log=ControlLogStatus(
                file="/proc/4242/fd/1 (the daemon's own output)",
                watched=True,
                problem="/run/nvidia/mps/nvidia.com/gpu/log/control.log now names another file (rotated); the daemon "
                "still writes to the file it opened, which the agent follows",
                problem_at=utc(WALL - 20),
                moves=1,
            ),
            busy=DaemonBusy(
                at=utc(WALL - 5), reason="`get_server_list` and 2 more not sent: the MPS control daemon is busy"
            ),
            busy_episodes=2,
        ),
        registration=Registration(registered=True, registrations=2, registration_failures=1),
    )
    down = ResourceView(
        allocator=ResourceAllocator(units, plan.shm_directory),
        inventory=Inventory(units),
        daemon=DaemonStatus(
            pid=None,
            up=False,
            front_end_failure=FrontEndFailure(at=utc(WALL - 20), reason="nvidia-cuda-mps-control: Permission denied"),
            record_damage=RecordDamage(
                at=utc(WALL - 40),
                path="/run/nvidia/mps/nvidia.com/gpu-mem/daemon.json",
                problem="does not decode: Input data was truncated",
            ),
            control_log=ControlLogStatus(
                file="/run/nvidia/mps/nvidia.com/gpu-mem/log/control.log",
                watched=False,
                problem="/run/nvidia/mps/nvidia.com/gpu-mem/log/control.log cannot be opened (No such file or "
                "directory)",
                problem_at=utc(WALL - 30),
            ),
        ),
        registration=Registration(registered=False, registrations=0),
    )
    return [serving, down]


def write_serving_status(root: Path) -> None:
    document = status_document(
        version="1.2.3",
        pid=2**22 + 1,  # above any default pid_max: not a running process
        tasks=17,
        pod_resources=PodResourcesStatus(
            socket="/var/lib/kubelet/pod-resources/kubelet.sock", available=True, answers=40, failures=3
        ),
        unhealthy_gpus={uuid(1): "Xid 79 (fallen off the bus)"},
        resources=serving_views(),
    )
    write_status(root, document)


@pytest.mark.usefixtures("fixed_clocks")
def test_the_status_file_holds_what_it_held_before_the_document_was_typed(tmp_path: Path) -> None:
    """Scripts and older `--status` read status.json: its bytes are pinned (tests/documents/golden/status.json,
    written by the dict-built document this replaced)."""
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


FIRST_AGENTS_FILE = """{
 "version": "0.1.0",
 "pid": 4194305,
 "podResources": {"socket": "/var/lib/kubelet/pod-resources/kubelet.sock", "available": false},
 "unhealthyGpus": {},
 "resources": [
  {
   "name": "nvidia.com/gpu",
   "registered": true,
   "replicas": 4,
   "healthy": 4,
   "daemon": {"pid": 77, "up": true, "capMode": "full", "restarts": 0},
   "grants": [
    {"id": 1, "kind": "full", "container": null, "adopted": false, "grantedAt": "2025-11-30T23:59:00Z",
     "unlistedSince": null, "deviceIds": ["GPU-00000000-aaaa-bbbb-cccc-dddddddddddd::0"]}
   ]
  }
 ]
}
"""


@pytest.mark.usefixtures("fixed_clocks")
def test_status_reads_the_file_of_the_first_agent_that_wrote_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An upgrade replaces the binary before the agent: `--status` then reads the older agent's file. What that
    file lacks reads as not known (user mode, write time) or as none (grants' shares, GPU ceilings, counters)."""
    (tmp_path / STATUS_FILE).write_text(FIRST_AGENTS_FILE)
    assert cli.run(["--status", "--mps-root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mpsagent 0.1.0 (pid 4194305), written ? -- NOT RUNNING: this is its last state",
        "pod-resources: NOT answering (/var/lib/kubelet/pod-resources/kubelet.sock)",
        "",
        "nvidia.com/gpu: 4/4 replicas healthy, registered with the kubelet",
        "  mps daemon: up, pid 77, caps full, 0 restarts, user mode unknown (adopted from an older agent)",
        "  grants: 1",
        "    #1 full   waiting for the kubelet to list its container (granted 60 s ago): "
        "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd::0",
    ]
    assert cli.run(["--status", "--mps-root", str(tmp_path), "--output", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    resource = printed["resources"][0]
    assert (printed["tasks"], printed["writtenAt"], resource["registrations"], resource["gpus"]) == (0, None, 0, {})
    assert resource["daemon"]["multiUser"] is None
    assert resource["grants"][0]["share"] is None


def two_new_grants() -> ResourceAllocator:
    """The first resource of three T4s, with two 1-replica grants made 2 s before the tests' clocks."""
    plan = node_plan(node_gpus(*gpus_of(3)), *RESOURCES, mps="failRequestsGreaterThanOne: false")
    gpus = plan.resources[0]
    allocator = ResourceAllocator(gpus, plan.shm_directory, Ledger(lambda: WALL - 2, lambda: MONOTONIC - 2))
    allocator.allocate([gpus.device_ids[:1], gpus.device_ids[1:2]])
    return allocator


@pytest.mark.usefixtures("fixed_clocks")
def test_a_new_grant_waits_for_its_container_and_a_gone_container_says_since_when(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The kubelet lists a container only once its Allocate has returned, so a lookup in between misses the new
    grant: it is waiting for the kubelet, not "not listed since". A grant whose container was listed and is gone
    says since when (its grace period runs from then)."""
    allocator = two_new_grants()
    gpus, ids = allocator.resource, allocator.resource.device_ids
    web = ContainerRef(namespace="ml", pod="web", container="main")
    allocator.reconcile([ListedGrant(container=web, replica_ids=ids[1:2])], now=MONOTONIC - 1, grace_s=60)
    allocator.reconcile([], now=MONOTONIC, grace_s=60)
    view = ResourceView(
        allocator=allocator,
        inventory=Inventory(gpus, daemon_ready=True),
        daemon=DaemonStatus(
            pid=4242,
            up=True,
            cap_mode=ceiling_mode(allocator.ceilings(), gpus.shares.full_hardware()),
            ceilings=CeilingsStatus.of(allocator.ceilings()),
        ),
        registration=Registration(registered=True, registrations=1),
    )
    pod_resources = PodResourcesStatus(socket="/kubelet.sock", available=True)
    write_status(
        tmp_path,
        status_document(version="1", pid=1, tasks=1, pod_resources=pod_resources, unhealthy_gpus={}, resources=[view]),
    )
    assert cli.run(["--status", "--mps-root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "    #1 capped waiting for the kubelet to list its container (granted 2 s ago) [1/4 of GPU 0, threads 25%, "
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M]: GPU-00000000-aaaa-bbbb-cccc-dddddddddddd::0",
        "    #2 capped ml/web/main (not listed by the kubelet since 2025-12-01T00:00:00Z) [1/4 of GPU 0, threads 25%, "
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M]: GPU-00000000-aaaa-bbbb-cccc-dddddddddddd::1",
    ]


def test_kept_grant_entries_follow_each_change_of_their_grant() -> None:
    """The publisher keeps the grants' entries between documents: a grant identified, unlisted or ended since
    shows as it is now, exactly as a document built anew shows it."""
    allocator = two_new_grants()
    gpus, ids = allocator.resource, allocator.resource.device_ids
    view = ResourceView(
        allocator=allocator,
        inventory=Inventory(gpus, daemon_ready=True),
        daemon=DaemonStatus(pid=4242, up=True),
        registration=Registration(registered=True, registrations=1),
    )
    pod_resources = PodResourcesStatus(socket="/kubelet.sock", available=True)
    entries = GrantEntries()

    def grants(kept: GrantEntries | None) -> tuple[GrantStatus, ...]:
        document = status_document(
            version="1", pid=1, tasks=1, pod_resources=pod_resources, unhealthy_gpus={}, resources=[view],
            grant_entries=kept,
        )  # fmt: skip
        return document.resources[0].grants

    assert grants(entries) == grants(None)
    web = ContainerRef(namespace="ml", pod="web", container="main")
    allocator.reconcile([ListedGrant(container=web, replica_ids=ids[1:2])], now=MONOTONIC - 1, grace_s=60)
    assert [g.container for g in grants(entries)] == [None, "ml/web/main"]
    allocator.reconcile([], now=MONOTONIC, grace_s=60)
    assert grants(entries) == grants(None)
    assert grants(entries)[1].unlisted_since is not None
    allocator.reconcile([], now=MONOTONIC + 61, grace_s=60)
    assert grants(entries) == grants(None) == ()


@pytest.mark.usefixtures("fixed_clocks")
@pytest.mark.parametrize(
    ("granted_at", "shown"),
    [
        ("2025-12-01T00:00:00Z", "(granted 0 s ago)"),
        ("2025-11-30T23:58:01Z", "(granted 119 s ago)"),
        ("2025-11-30T23:58:00Z", "(granted 2 min ago)"),
        ("2025-11-30T22:00:00Z", "(granted 2 h ago)"),
        ("2025-11-28T00:00:00Z", "(granted 3 d ago)"),
        ("2025-12-01T00:00:05Z", "(granted 0 s ago)"),  # the clock stepped back since
        ("yesterday", "(granted yesterday)"),  # a file edited by hand
    ],
)
def test_how_long_ago_a_waiting_grant_was_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], granted_at: str, shown: str
) -> None:
    (tmp_path / STATUS_FILE).write_text(FIRST_AGENTS_FILE.replace("2025-11-30T23:59:00Z", granted_at))
    assert cli.run(["--status", "--mps-root", str(tmp_path)]) == 0
    assert f"    #1 full   waiting for the kubelet to list its container {shown}: " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"version": "1.2.3", "pid": 1', "truncated"),
        ("[]", "Expected `object`, got `array`"),
        ('{"version": "1.2.3", "pid": 1}', "Object missing required field `podResources`"),
        (
            FIRST_AGENTS_FILE.replace('"up": true', '"up": "yes"'),
            "Expected `bool`, got `str` - at `$.resources[0].daemon.up`",
        ),
        (
            FIRST_AGENTS_FILE.replace('"pid": 4194305', f'"pid": {2**70}'),
            "Expected `int` <= 9223372036854775807 - at `$.pid`",
        ),
        (
            FIRST_AGENTS_FILE.replace('"pid": 77', f'"pid": {-(2**70)}'),
            "Expected `int` >= -9223372036854775808 - at `$.resources[0].daemon.pid`",
        ),
        (
            FIRST_AGENTS_FILE.replace('"restarts": 0', '"restarts": -3'),
            "Expected `int` >= 0 - at `$.resources[0].daemon.restarts`",
        ),
        (
            FIRST_AGENTS_FILE.replace('"replicas": 4', f'"replicas": {2**70}'),
            "Expected `int` <= 9223372036854775807 - at `$.resources[0].replicas`",
        ),
        (
            FIRST_AGENTS_FILE.replace('"unhealthyGpus": {}', '"unhealthyGpus": {}, "x": ' + "[" * 5000 + "]" * 5000),
            "nests deeper than the agent ever writes",
        ),
    ],
    ids=[
        "cut-short",
        "not-an-object",
        "no-resources",
        "wrong-type",
        "huge-pid",
        "huge-daemon-pid",
        "negative-count",
        "huge-count",
        "5000-deep",
    ],
)
def test_a_status_file_that_does_not_read_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, problem: str
) -> None:
    path = tmp_path / STATUS_FILE
    path.write_text(content)
    assert cli.run(["--status", "--mps-root", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"mpsagent: error: cannot read the agent status {path}: ")
    assert problem in captured.err
    assert captured.err.endswith("; the agent rewrites it within a second, or remove it if no agent runs\n")
    assert captured.err.count("\n") == 1


def running_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], pid: int, written_at: float) -> str:
    written = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(written_at))
    (tmp_path / STATUS_FILE).write_text(
        FIRST_AGENTS_FILE.replace('"pid": 4194305', f'"pid": {pid}, "writtenAt": "{written}"')
    )
    assert cli.run(["--status", "--mps-root", str(tmp_path)]) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_the_agent_is_shown_running_only_while_its_pid_names_the_process_that_wrote_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PID 1 is init (or anything but an agent that can be checked); a live process that started after the file
    was last written cannot have written it: its PID was reused since the agent ended."""
    now = time.time()
    assert running_line(tmp_path, capsys, os.getpid(), now) == f"mpsagent 0.1.0 (pid {os.getpid()}), written " + (
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    )
    for no_agent in (-1, 0, 1, 2**22 + 1):
        assert running_line(tmp_path, capsys, no_agent, now).endswith(" -- NOT RUNNING: this is its last state")
    assert running_line(tmp_path, capsys, os.getpid(), now - 3600).endswith(" -- NOT RUNNING: this is its last state")


@pytest.mark.usefixtures("fixed_clocks")
def test_readiness_and_the_systemd_line_read_the_document() -> None:
    busy, _ = serving_views()
    serving = dataclasses.replace(busy, daemon=msgspec.structs.replace(busy.daemon, busy=None))
    pod_resources = PodResourcesStatus(socket="/kubelet.sock", available=True)
    ready = status_document(
        version="1", pid=1, tasks=1, pod_resources=pod_resources, unhealthy_gpus={}, resources=[serving]
    )
    assert readiness_problems(ready) == []
    assert summary(ready) == "serving nvidia.com/gpu (4/8 healthy, 3 grants, caps capped)"
    both = msgspec.structs.replace(ready, resources=(*ready.resources, *starting_document(["b"]).resources))
    assert readiness_problems(both) == ["b: not registered with the kubelet", "b: mps daemon down"]
    assert summary(both) == "b: not registered with the kubelet; b: mps daemon down"
    # A daemon that another control session keeps busy lives, but cap switches fail meanwhile: not ready.
    kept_busy = status_document(
        version="1", pid=1, tasks=1, pod_resources=pod_resources, unhealthy_gpus={}, resources=[busy]
    )
    assert readiness_problems(kept_busy) == [
        "nvidia.com/gpu: mps control daemon busy since 2025-11-30T23:59:55Z (another control session is open)"
    ]


@pytest.mark.usefixtures("fixed_clocks")
def test_counts_of_one_are_said_in_the_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serving, _ = serving_views()
    daemon = msgspec.structs.replace(serving.daemon, busy=None, restarts=1, cap_tamper=1, cap_tamper_in_log=1)
    one = dataclasses.replace(serving, daemon=daemon)
    one.allocator.ledger.release([grant.grant_id for grant in one.allocator.ledger.live_grants()[1:]])
    pod_resources = PodResourcesStatus(socket="/kubelet.sock", available=True)
    dra = DraStatus(
        driver="mps.mpsagent.io",
        node="node-1",
        registered=True,
        slice_published=True,
        prepared=1,
        refused=1,
        unprepared=1,
    )
    document = status_document(
        version="1", pid=1, tasks=1, pod_resources=pod_resources, unhealthy_gpus={}, resources=[one], dra=dra
    )
    assert summary(document) == "serving nvidia.com/gpu (4/8 healthy, 1 grant, caps capped)"
    write_status(tmp_path, document)
    assert cli.run(["--status", "--mps-root", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert ", 1 restart, one server per user" in printed
    assert "  ceilings changed behind the agent 1 time (1 seen in the control log), last at " in printed
    assert f"  GPU 0 ({uuid(0)}): 1 live grant; ceilings " in printed
    assert "; 1 prepare, 1 refused, 1 unprepared\n" in printed


def test_the_starting_document_names_every_resource_not_ready() -> None:
    starting = starting_document(["nvidia.com/gpu", "nvidia.com/gpu-b"])
    assert [(r.name, r.registered, r.daemon.up, r.grants) for r in starting.resources] == [
        ("nvidia.com/gpu", False, False, ()),
        ("nvidia.com/gpu-b", False, False, ()),
    ]
    assert starting.pod_resources.available is False


@pytest.mark.usefixtures("fixed_clocks")
def test_metrics_read_the_published_document() -> None:
    from prometheus_client import generate_latest  # noqa: PLC0415
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    from mpsagent.documents.metrics import AgentMetrics  # noqa: PLC0415

    document = status_document(
        version="1",
        pid=1,
        tasks=1,
        pod_resources=PodResourcesStatus(socket="/kubelet.sock", available=True, failures=3),
        unhealthy_gpus={},
        resources=serving_views(),
    )
    metrics = AgentMetrics(starting=starting_document(["nvidia.com/gpu"]), gpus=(), gpu_source=None, proc_root=Path())
    metrics.document = document
    scraped = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    gpu, gpu0, gpu1 = (("resource", "nvidia.com/gpu"),), str(uuid(0)), str(uuid(1))
    assert scraped[("mpsagent_replicas", (("gpu", gpu1), ("health", "Unhealthy"), *gpu))] == 4
    assert scraped[("mpsagent_active_grants", (("kind", "capped"), *gpu))] == 2
    assert scraped[("mpsagent_daemon_cap_mode", (("mode", "capped"), *gpu))] == 1
    assert scraped[("mpsagent_daemon_multi_user", gpu)] == 0
    assert scraped[("mpsagent_cap_tamper_total", (*gpu, ("seen_by", "control_log")))] == 2
    assert scraped[("mpsagent_cap_tamper_total", (*gpu, ("seen_by", "read_back")))] == 1
    assert scraped[("mpsagent_daemon_log_watched", gpu)] == 1
    assert scraped[("mpsagent_daemon_log_unknown_lines_total", gpu)] == 0
    assert scraped[("mpsagent_daemon_busy", gpu)] == 1
    assert scraped[("mpsagent_daemon_busy_episodes_total", gpu)] == 2
    assert scraped[("mpsagent_daemon_busy", (("resource", "nvidia.com/gpu-mem"),))] == 0
    assert scraped[("mpsagent_daemon_memory_ceiling_bytes", (("gpu", gpu0), *gpu))] == 4096 * 1024**2
    assert scraped[("mpsagent_escape_thread_percent", (("gpu", gpu0), *gpu))] == 75
    assert scraped[("mpsagent_daemon_thread_ceiling_percent", gpu)] == 100
    assert scraped[("mpsagent_kubelet_registration_failures_total", gpu)] == 1
    assert scraped[("mpsagent_daemon_up", (("resource", "nvidia.com/gpu-mem"),))] == 0
    assert scraped[("mpsagent_pod_resources_failures_total", ())] == 3


def dra_text(dra: DraStatus) -> str:
    """The status text of an agent with no resource and this DRA part."""
    pod_resources = PodResourcesStatus(socket="/kubelet.sock", available=True)
    return render_status_text(
        status_document(
            version="1", pid=1, tasks=1, pod_resources=pod_resources, unhealthy_gpus={}, resources=[], dra=dra
        )
    )


def test_the_dra_part_says_over_which_health_version_the_kubelet_watches() -> None:
    def text(*watched: str) -> str:
        return dra_text(DraStatus(driver="mps.mpsagent.io", node="node-1", registered=True, health_watched=watched))

    assert "\n  device health watched by the kubelet over v1.DRAResourceHealth\n" in text("v1.DRAResourceHealth")
    assert "\n  device health not watched by the kubelet\n" in text()


def test_the_dra_part_shows_the_administrators_taint_rules_on_its_devices_and_why_they_are_not_watched() -> None:
    maintenance = TaintRule(
        name="gpu-0-maintenance",
        selector=TaintSelector(driver="mps.mpsagent.io", device="gpu-0"),
        key="example.com/maintenance",
        value="planned",
        effect="NoSchedule",
        added=1796637600.0,
    )
    rules = (taint_rule_status(maintenance, ["gpu-0"]),)
    watched = dra_text(DraStatus(driver="mps.mpsagent.io", node="node-1", taint_rules=rules))
    assert (
        "\n  DeviceTaintRules on its devices: 1\n"
        "    gpu-0-maintenance: example.com/maintenance=planned:NoSchedule on gpu-0 (since 2026-12-07T10:00:00Z)\n"
    ) in watched
    failing = DraStatus(
        driver="mps.mpsagent.io", node="node-1", taint_rules=rules, taint_rules_unseen="watching ...: refused"
    )
    assert "\n  DeviceTaintRules not watched: watching ...: refused; 1 on its devices when last seen\n" in dra_text(
        failing
    )
    none_served = DraStatus(driver="mps.mpsagent.io", node="node-1", taint_rules_unseen="the API server serves none")
    assert "\n  DeviceTaintRules not watched: the API server serves none\n" in dra_text(none_served)
