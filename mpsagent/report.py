"""What `--once` prints: the plan as JSON-ready data and as text, built from the same functions the agent runs."""

from __future__ import annotations

import json
from typing import Any

from mpsagent.allocation import ResourceAllocator
from mpsagent.errors import RequestError
from mpsagent.plan import (
    CapMode,
    NodePlan,
    ResourcePlan,
    daemon_default_commands,
    daemon_launch,
    multi_user_server,
)

EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"


def _examples(resource: ResourcePlan, allocator: ResourceAllocator) -> list[dict[str, Any]]:
    examples: list[dict[str, Any]] = []
    for ids in (resource.device_ids[:1], resource.device_ids):
        entry: dict[str, Any] = {"request": len(ids)}
        try:
            grant = allocator.grant_for(ids)
        except RequestError as exc:
            entry["fullGrant"] = len(ids) == len(resource.device_ids)
            entry["error"] = str(exc)
        else:
            entry["fullGrant"] = grant.full
            entry["envs"] = dict(sorted(grant.envs.items()))
            entry["mounts"] = [{"hostPath": m.host_path, "containerPath": m.container_path} for m in grant.mounts]
            if grant.cdi_devices:
                entry["cdiDevices"] = list(grant.cdi_devices)
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
                "daemonCommands": list(daemon_default_commands(resource, CapMode.FULL)),
                "capModes": {
                    "enforcedAtDaemon": resource.enforce_caps,
                    "full": list(daemon_default_commands(resource, CapMode.FULL)),
                    "capped": list(daemon_default_commands(resource, CapMode.CAPPED)),
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
        "labels": plan.labels,
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
        lines += [
            "",
            f"Resource {res['name']}: {len(res['gpus'])} GPUs x {res['replicas']} replicas = {len(ids)} devices",
            f"  device IDs: {ids[0]} ... {ids[-1]}" if len(ids) > 2 else f"  device IDs: {', '.join(ids)}",
            f"  pipe directory: {res['pipeDirectory']}",
            f"  compute mode: {res['computeMode']['set'] or 'unchanged'} ({res['computeMode']['note']})",
            "  daemon start: "
            + " ".join(f"{k}={v}" for k, v in res["daemonStart"]["env"].items())
            + " "
            + " ".join(res["daemonStart"]["argv"]),
            f"  users: {res['multiUser']['note']} (sharing.mps.multiUser: {res['multiUser']['setting']})",
            "  daemon commands at start (full hardware):",
            *(f"    {c}" for c in res["daemonCommands"]),
        ]
        if res["capModes"]["enforcedAtDaemon"]:
            lines += [
                "  while any capped grant is live, the daemon holds instead:",
                *(f"    {c}" for c in res["capModes"]["capped"]),
            ]
        else:
            lines.append("  caps are not enforced at the daemon (sharing.mps.enforceCaps: false)")
        for example in res["examples"]:
            lines.append(
                f"  a container granted {example['request']} replica{'s' if example['request'] > 1 else ''}"
                f" ({'full' if example['fullGrant'] else 'capped'} grant):"
            )
            if "error" in example:
                lines.append(f"    refused: {example['error']}")
                continue
            lines += [f"    {k}={v}" for k, v in example["envs"].items()]
            lines += [f"    mount {m['hostPath']} -> {m['containerPath']}" for m in example["mounts"]]
            lines += [f"    CDI device {d}" for d in example.get("cdiDevices", [])]
    lines += ["", "Node labels:", *(f"  {k}={v}" for k, v in report["labels"].items())]
    return "\n".join(lines)
