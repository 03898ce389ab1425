"""What `--once` prints: the plan as JSON-ready data and as text, built from the same functions the agent runs."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import yaml

from mpsagent.base.devices import ReplicaId, gpu_of
from mpsagent.base.errors import RequestError
from mpsagent.base.values import MIB
from mpsagent.base.words import counted
from mpsagent.documents.report_document import (
    CeilingsReport,
    ClaimExampleReport,
    ComputeModeReport,
    DaemonStartReport,
    DraReport,
    ExampleReport,
    GpuReport,
    MountReport,
    MultiUserReport,
    PlanReport,
    ResourceReport,
)
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.claim_shares import claim_shares, node_slice
from mpsagent.domain.claims import DRA_DRIVER, ClaimAllocation, ClaimDevice, ClaimRef
from mpsagent.domain.grant_kind import describe_share
from mpsagent.domain.plan import NodePlan, ResourcePlan
from mpsagent.dra.slice_object import resource_slice
from mpsagent.mps.commands import daemon_default_commands, daemon_launch, multi_user_server
from mpsagent.node.nfd import node_labels

EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"


def _example_requests(resource: ResourcePlan) -> list[tuple[str, tuple[ReplicaId, ...]]]:
    """The requests `--once` shows: replicas 1, 2 on one GPU, one whole GPU, every replica; memory units 1, 7 and
    a whole GPU. Requests a resource cannot make (a GPU of 1 replica has no 2) are left out."""
    first = tuple(r for r in resource.device_ids if gpu_of(r) == resource.gpus[0].uuid)
    if resource.memory_units:
        wanted = [("1 memory unit", first[:1]), ("7 memory units on one GPU", first[:7] if len(first) >= 7 else ())]
        wanted.append((f"a whole GPU ({len(first)} memory units)", first))
    else:
        wanted = [("1 replica", first[:1]), ("2 replicas on one GPU", first[:2] if len(first) >= 2 else ())]
        wanted += [(f"a whole GPU ({len(first)} replicas)", first), ("every replica", resource.device_ids)]
    examples: dict[tuple[ReplicaId, ...], str] = {}
    for title, ids in wanted:
        if ids and ids not in examples:
            examples[ids] = title
    return [(title, ids) for ids, title in examples.items()]


def _example(
    resource: ResourcePlan, allocator: ResourceAllocator, title: str, ids: tuple[ReplicaId, ...]
) -> ExampleReport:
    ceilings = resource.shares.ceilings([resource.shares.share_of(ids)]).describe()
    try:
        grant = allocator.grant_for(ids)
    except RequestError as exc:
        kind = resource.shares.share_of(ids).kind
        return ExampleReport(request=len(ids), title=title, kind=kind, error=str(exc), ceilings=ceilings)
    return ExampleReport(
        request=len(ids),
        title=title,
        kind=grant.share.kind,
        share=grant.share.describe(),
        envs=dict(sorted(grant.envs.items())),
        mounts=tuple(MountReport(host_path=m.host_path, container_path=m.container_path) for m in grant.mounts),
        cdi_devices=grant.cdi_devices or None,
        ceilings=ceilings,
    )


def _multi_user_note(multi_user: bool, offered: bool | None, control_bin: str) -> str:
    if multi_user:
        return "one MPS server for every user (-M)"
    if offered is None:
        return f"one MPS server per user: `{control_bin} -h` could not be run to ask (the agent asks again at start)"
    return "one MPS server per user: pods of different users take turns on the GPUs"


def _resource_report(
    resource: ResourcePlan, shm_directory: Path, *, control_bin: str, manages_compute_mode: bool, offered: bool | None
) -> ResourceReport:
    allocator = ResourceAllocator(resource, shm_directory)
    multi_user = multi_user_server(resource, offered, control_bin)
    launch = daemon_launch(resource, control_bin, multi_user=multi_user)
    full_hardware = daemon_default_commands(resource.shares.full_hardware())
    return ResourceReport(
        name=resource.name,
        replicas=resource.replicas,
        memory_unit_bytes=resource.memory_unit_bytes,
        grants=resource.shares.rule.value if not resource.memory_units else "memory units",
        gpus=tuple(gpu.uuid for gpu in resource.gpus),
        device_ids=resource.device_ids,
        pipe_directory=str(resource.pipe_directory),
        log_directory=str(resource.log_directory),
        compute_mode=ComputeModeReport(
            mode=EXCLUSIVE_PROCESS if manages_compute_mode else None,
            note="set through NVML before the daemon starts, restored when it is quit"
            if manages_compute_mode
            else "not managed: GPUs come from a node snapshot, not NVML",
        ),
        daemon_start=DaemonStartReport(argv=launch.argv, env=launch.env),
        multi_user=MultiUserReport(
            setting=resource.multi_user.value,
            offered=offered,
            server=multi_user,
            note=_multi_user_note(multi_user, offered, control_bin),
        ),
        daemon_commands=full_hardware,
        ceilings=CeilingsReport(
            enforced_at_daemon=resource.enforce_caps,
            full_hardware=full_hardware,
            until_grants_known=daemon_default_commands(resource.shares.unreconciled_ceilings()),
        ),
        fail_requests_greater_than_one=resource.fail_requests_greater_than_one,
        examples=tuple(_example(resource, allocator, title, ids) for title, ids in _example_requests(resource)),
    )


EXAMPLE_CLAIMS = (
    ("8Gi", 8 << 30, None),
    ("8Gi and 25% of the SMs", 8 << 30, 25),
    ("40Gi", 40 << 30, None),
    ("no capacity request (the whole GPU)", None, None),
)
"""What the dry run shows claims get of the node's first device; one asking more memory than it has is left out."""
NODE_UID_PLACEHOLDER = "<the node's UID>"


def dra_report(plan: NodePlan, node: str) -> DraReport:
    """The node's ResourceSlice, and what the example claims get of its first device."""
    published = node_slice(plan, node)
    examples = []
    for title, memory, compute in EXAMPLE_CLAIMS if published.devices else ():
        if memory is not None and memory > published.devices[0].memory.maximum:
            continue
        device = ClaimDevice(
            request="gpu", pool=node, device=published.devices[0].name, memory_bytes=memory, compute=compute
        )
        allocation = ClaimAllocation(claim=ClaimRef(namespace="default", name="example", uid="0"), devices=(device,))
        (share,) = claim_shares(plan, allocation, node)
        examples.append(
            ClaimExampleReport(
                title=title,
                device=device.device,
                memory_mib=share.share.gpus[0].memory_mib,
                thread_percentage=share.share.thread_percentage,
                kind=share.share.kind,
                envs=dict(sorted(share.edits.envs.items())),
                ceilings=share.resource.shares.ceilings([share.share]).describe(),
            )
        )
    manifest = resource_slice(published, generation=1, node_uid=NODE_UID_PLACEHOLDER)
    return DraReport(resource_slice=manifest, examples=tuple(examples))


def plan_report(
    plan: NodePlan,
    *,
    control_bin: str,
    manages_compute_mode: bool,
    multi_user_offered: bool | None,
    dra_node: str | None = None,
) -> PlanReport:
    """`multi_user_offered`: whether the control binary's `-h` lists --multiuser-server (None: not known);
    `dra_node`: the node's name with --dra on (None: off)."""
    return PlanReport(
        driver_version=plan.driver_version,
        gpu_source=plan.gpu_source,
        gpus=tuple(
            GpuReport(
                uuid=gpu.uuid,
                index=gpu.index,
                name=gpu.name,
                memory_bytes=gpu.memory_bytes,
                compute_capability=gpu.compute_capability_text,
                pci_bus_id=gpu.pci_bus_id,
                numa_node=gpu.numa_node,
                mig_enabled=gpu.mig_enabled,
                enforcement=gpu.enforcement.value,
                enforcement_reason=gpu.memory_limits_unavailable,
            )
            for gpu in plan.gpus
        ),
        resources=tuple(
            _resource_report(
                resource,
                plan.shm_directory,
                control_bin=control_bin,
                manages_compute_mode=manages_compute_mode,
                offered=multi_user_offered,
            )
            for resource in plan.resources
        ),
        labels=node_labels(plan.gpus, plan.resources),
        dra=dra_report(plan, dra_node) if dra_node is not None else None,
    )


def render_json(report: PlanReport) -> str:
    """The standard library's layout and escaping, which `--once --output json` has always had."""
    return json.dumps(msgspec.to_builtins(report), indent=2)


def _example_lines(example: ExampleReport) -> list[str]:
    lines = [f"  a container granted {example.title} ({example.kind} grant):"]
    if example.error is not None:
        return [*lines, f"    refused: {example.error}"]
    lines.append(f"    share: {example.share}")
    lines += [f"    {k}={v}" for k, v in (example.envs or {}).items()]
    lines += [f"    mount {m.host_path} -> {m.container_path}" for m in example.mounts or ()]
    lines += [f"    CDI device {d}" for d in example.cdi_devices or ()]
    lines.append(f"    daemon ceilings while it is the only live grant: {example.ceilings}")
    return lines


def _resource_lines(res: ResourceReport) -> list[str]:
    ids = res.device_ids
    per_gpu = (
        f"memory units of {res.memory_unit_bytes // MIB} MiB"
        if res.memory_unit_bytes
        else counted(res.replicas, "replica")
    )
    lines = [
        "",
        f"Resource {res.name}: {counted(len(res.gpus), 'GPU')} x {per_gpu} = {counted(len(ids), 'device')} "
        f"(grants: {res.grants})",
        f"  device IDs: {ids[0]} ... {ids[-1]}" if len(ids) > 2 else f"  device IDs: {', '.join(ids)}",
        f"  pipe directory: {res.pipe_directory}",
        f"  compute mode: {res.compute_mode.mode or 'unchanged'} ({res.compute_mode.note})",
        "  daemon start: "
        + " ".join(f"{k}={v}" for k, v in res.daemon_start.env.items())
        + " "
        + " ".join(res.daemon_start.argv),
        f"  users: {res.multi_user.note} (sharing.mps.multiUser: {res.multi_user.setting})",
        "  daemon commands with no live grant (the full hardware):",
        *(f"    {c}" for c in res.daemon_commands),
    ]
    if res.ceilings.enforced_at_daemon:
        lines += [
            "  daemon ceilings until the live grants are known (the smallest share):",
            *(f"    {c}" for c in res.ceilings.until_grants_known),
            "  then, on every grant and release: per GPU the largest memory cap of its live grants, and the",
            "  largest thread percentage of the resource's live grants (see docs/cap-model.md)",
        ]
    else:
        lines.append(
            "  caps are not enforced at the daemon (sharing.mps.enforceCaps: false): it holds the full hardware"
        )
    lines.append("  a container's thread percentage is one value for all its GPUs: the smallest of its shares")
    for example in res.examples:
        lines += _example_lines(example)
    return lines


def render_text(report: PlanReport) -> str:
    lines = [f"GPUs ({report.gpu_source}, driver {report.driver_version}):"]
    for gpu in report.gpus:
        numa = "?" if gpu.numa_node is None else gpu.numa_node
        lines.append(
            f"  {gpu.index}  {gpu.uuid}  {gpu.name}  {gpu.memory_bytes // MIB} MiB  "
            f"cc {gpu.compute_capability}  numa {numa}{'  MIG' if gpu.mig_enabled else ''}"
        )
        why = f" ({gpu.enforcement_reason})" if gpu.enforcement_reason else ""
        lines.append(f"     memory enforced by: {gpu.enforcement}{why}")
    for res in report.resources:
        lines += _resource_lines(res)
    lines += ["", "Node labels:", *(f"  {k}={v}" for k, v in report.labels.items())]
    if report.dra is not None:
        lines += _dra_lines(report.dra)
    return "\n".join(lines)


def _dra_lines(dra: DraReport) -> list[str]:
    manifest = yaml.safe_dump(dra.resource_slice, sort_keys=False, default_flow_style=False).rstrip()
    lines = [
        "",
        f"DRA driver {DRA_DRIVER}: the ResourceSlice it publishes:",
        *(f"  {line}" for line in manifest.splitlines()),
    ]
    for example in dra.examples:
        held = f"{example.memory_mib} MiB"
        got = describe_share(example.kind, held=held, thread_percentage=example.thread_percentage)
        lines.append(f"  a claim for {example.title} on {example.device}: {got}")
        lines += [f"    {k}={v}" for k, v in example.envs.items()]
        lines.append(f"    daemon ceilings while it is the only live share: {example.ceilings}")
    return lines
