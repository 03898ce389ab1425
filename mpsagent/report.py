"""What `--once` prints: the plan as JSON-ready data and as text, built from the same functions the agent runs."""

from __future__ import annotations

import json
from typing import Any

from mpsagent.allocation import ResourceAllocator
from mpsagent.devices import ReplicaId, gpu_of
from mpsagent.errors import RequestError
from mpsagent.mps.commands import daemon_default_commands, daemon_launch, multi_user_server
from mpsagent.nfd import node_labels
from mpsagent.plan import NodePlan, ResourcePlan

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


def _examples(resource: ResourcePlan, allocator: ResourceAllocator) -> list[dict[str, Any]]:
    examples: list[dict[str, Any]] = []
    for title, ids in _example_requests(resource):
        entry: dict[str, Any] = {"request": len(ids), "title": title}
        try:
            grant = allocator.grant_for(ids)
        except RequestError as exc:
            entry["fullGrant"] = resource.shares.share_of(ids).full
            entry["error"] = str(exc)
        else:
            entry["fullGrant"] = grant.full
            entry["share"] = grant.share.describe()
            entry["envs"] = dict(sorted(grant.envs.items()))
            entry["mounts"] = [{"hostPath": m.host_path, "containerPath": m.container_path} for m in grant.mounts]
            if grant.cdi_devices:
                entry["cdiDevices"] = list(grant.cdi_devices)
        entry["ceilings"] = resource.shares.ceilings([resource.shares.share_of(ids)]).describe()
        examples.append(entry)
    return examples


def _multi_user_note(multi_user: bool, offered: bool | None, control_bin: str) -> str:
    if multi_user:
        return "one MPS server for every user (-M)"
    if offered is None:
        return f"one MPS server per user: `{control_bin} -h` could not be run to ask (the agent asks again at start)"
    return "one MPS server per user: pods of different users take turns on the GPUs"


def plan_report(
    plan: NodePlan, *, control_bin: str, manages_compute_mode: bool, multi_user_offered: bool | None
) -> dict[str, Any]:
    """`multi_user_offered`: whether the control binary's `-h` lists --multiuser-server (None: not known)."""
    resources = []
    for resource in plan.resources:
        allocator = ResourceAllocator(resource, plan.shm_directory)
        multi_user = multi_user_server(resource, multi_user_offered, control_bin)
        launch = daemon_launch(resource, control_bin, multi_user=multi_user)
        resources.append(
            {
                "name": resource.name,
                "replicas": resource.replicas,
                "memoryUnitBytes": resource.memory_unit_bytes,
                "grants": resource.shares.rule.value if not resource.memory_units else "memory units",
                "gpus": [gpu.uuid for gpu in resource.gpus],
                "deviceIds": list(resource.device_ids),
                "pipeDirectory": str(resource.pipe_directory),
                "logDirectory": str(resource.log_directory),
                "computeMode": {
                    "set": EXCLUSIVE_PROCESS if manages_compute_mode else None,
                    "note": "set through NVML before the daemon starts, restored when it is quit"
                    if manages_compute_mode
                    else "not managed: GPUs come from a node snapshot, not NVML",
                },
                "daemonStart": {"argv": list(launch.argv), "env": launch.env},
                "multiUser": {
                    "setting": resource.multi_user.value,
                    "offered": multi_user_offered,
                    "server": multi_user,
                    "note": _multi_user_note(multi_user, multi_user_offered, control_bin),
                },
                "daemonCommands": list(daemon_default_commands(resource.shares.full_hardware())),
                "ceilings": {
                    "enforcedAtDaemon": resource.enforce_caps,
                    "fullHardware": list(daemon_default_commands(resource.shares.full_hardware())),
                    "untilGrantsKnown": list(daemon_default_commands(resource.shares.unreconciled_ceilings())),
                },
                "failRequestsGreaterThanOne": resource.fail_requests_greater_than_one,
                "examples": _examples(resource, allocator),
            }
        )
    return {
        "driverVersion": plan.driver_version,
        "gpuSource": plan.gpu_source,
        "gpus": [
            {
                "uuid": gpu.uuid,
                "index": gpu.index,
                "name": gpu.name,
                "memoryBytes": gpu.memory_bytes,
                "computeCapability": gpu.compute_capability_text,
                "pciBusId": gpu.pci_bus_id,
                "numaNode": gpu.numa_node,
                "migEnabled": gpu.mig_enabled,
            }
            for gpu in plan.gpus
        ],
        "resources": resources,
        "labels": node_labels(plan.gpus, plan.resources),
    }


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)


def render_text(report: dict[str, Any]) -> str:
    lines = [f"GPUs ({report['gpuSource']}, driver {report['driverVersion']}):"]
    for gpu in report["gpus"]:
        numa = "?" if gpu["numaNode"] is None else gpu["numaNode"]
        lines.append(
            f"  {gpu['index']}  {gpu['uuid']}  {gpu['name']}  {gpu['memoryBytes'] // 1048576} MiB  "
            f"cc {gpu['computeCapability']}  numa {numa}{'  MIG' if gpu['migEnabled'] else ''}"
        )
    for res in report["resources"]:
        ids = res["deviceIds"]
        per_gpu = (
            f"memory units of {res['memoryUnitBytes'] // 1048576} MiB"
            if res["memoryUnitBytes"]
            else f"{res['replicas']} replicas"
        )
        lines += [
            "",
            f"Resource {res['name']}: {len(res['gpus'])} GPUs x {per_gpu} = {len(ids)} devices "
            f"(grants: {res['grants']})",
            f"  device IDs: {ids[0]} ... {ids[-1]}" if len(ids) > 2 else f"  device IDs: {', '.join(ids)}",
            f"  pipe directory: {res['pipeDirectory']}",
            f"  compute mode: {res['computeMode']['set'] or 'unchanged'} ({res['computeMode']['note']})",
            "  daemon start: "
            + " ".join(f"{k}={v}" for k, v in res["daemonStart"]["env"].items())
            + " "
            + " ".join(res["daemonStart"]["argv"]),
            f"  users: {res['multiUser']['note']} (sharing.mps.multiUser: {res['multiUser']['setting']})",
        ]
        lines += [
            "  daemon commands with no live grant (the full hardware):",
            *(f"    {c}" for c in res["daemonCommands"]),
        ]
        if res["ceilings"]["enforcedAtDaemon"]:
            lines += [
                "  daemon ceilings until the live grants are known (the smallest share):",
                *(f"    {c}" for c in res["ceilings"]["untilGrantsKnown"]),
                "  then, on every grant and release: per GPU the largest memory cap of its live grants, and the",
                "  largest thread percentage of the resource's live grants (see docs/cap-model.md)",
            ]
        else:
            lines.append(
                "  caps are not enforced at the daemon (sharing.mps.enforceCaps: false): it holds the full hardware"
            )
        lines.append("  a container's thread percentage is one value for all its GPUs: the smallest of its shares")
        for example in res["examples"]:
            lines.append(
                f"  a container granted {example['title']} ({'full' if example['fullGrant'] else 'capped'} grant):"
            )
            if "error" in example:
                lines.append(f"    refused: {example['error']}")
                continue
            lines.append(f"    share: {example['share']}")
            lines += [f"    {k}={v}" for k, v in example["envs"].items()]
            lines += [f"    mount {m['hostPath']} -> {m['containerPath']}" for m in example["mounts"]]
            lines += [f"    CDI device {d}" for d in example.get("cdiDevices", [])]
            lines.append(f"    daemon ceilings while it is the only live grant: {example['ceilings']}")
    lines += ["", "Node labels:", *(f"  {k}={v}" for k, v in report["labels"].items())]
    return "\n".join(lines)
