"""The running agent's state for operators: what `mpsagent --status` prints, from `<mps-root>/status.json`.

The agent rewrites the file (atomically, owner-only: it names pods) whenever its content changes; `--status`
reads it, so it needs no connection to the agent and works the same on a node and in a container.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsagent.allocation import ResourceAllocator
from mpsagent.devices import GpuUuid, Health, gpu_of
from mpsagent.errors import UsageError
from mpsagent.host import FileRefusedError, pid_alive, read_regular_file, write_atomically
from mpsagent.inventory import Inventory
from mpsagent.shares import Ceilings

STATUS_FILE = "status.json"
STATUS_FILE_MODE = 0o600  # it names pods
# Far above any real status (every replica of a node in grants is a few MB), far below what hurts to read.
MAX_STATUS_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonView:
    pid: int | None
    up: bool
    ceilings: Ceilings | None
    """What the daemon is known to hold; None while they are being set, or after a change failed."""
    restarts: int
    restart_attempts: int = 0
    multi_user: bool | None = None
    cap_tamper: int = 0
    last_cap_tamper: tuple[float, str] | None = None
    """When (wall clock) the caps were last found changed behind the agent, and what was found."""
    front_end_failure: tuple[float, str] | None = None
    """Since when (wall clock) and why the agent cannot run the control front-end."""


def _event(event: tuple[float, str] | None, reason_key: str) -> dict[str, str] | None:
    return None if event is None else {"at": _utc(event[0]), reason_key: event[1]}


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourceView:
    allocator: ResourceAllocator
    inventory: Inventory
    daemon: DaemonView
    registered: bool
    registrations: int
    registration_failures: int = 0


def _cap_mode(held: Ceilings | None, full: Ceilings) -> str | None:
    """`full` while the daemon holds the full hardware, `capped` while any ceiling is lower."""
    if held is None:
        return None
    return "full" if held == full else "capped"


def _utc(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def _wall(monotonic: float | None) -> str | None:
    """A monotonic time (the ledger's grace clock) as the UTC time it was."""
    if monotonic is None:
        return None
    return _utc(time.time() - (time.monotonic() - monotonic))


def status_document(
    *,
    version: str,
    pid: int,
    tasks: int,
    pod_resources: dict[str, Any],
    unhealthy_gpus: dict[GpuUuid, str],
    resources: Sequence[ResourceView],
) -> dict[str, Any]:
    entries = []
    for view in resources:
        devices = view.inventory.snapshot().devices
        per_gpu: dict[str, dict[str, int]] = {}
        for device in devices:
            counts = per_gpu.setdefault(gpu_of(device.replica_id), {"replicas": 0, "healthy": 0})
            counts["replicas"] += 1
            counts["healthy"] += device.health is Health.HEALTHY
        grants = sorted(view.allocator.ledger.live_grants(), key=lambda g: g.grant_id)
        stats = view.allocator.ledger.statistics()
        shares = view.allocator.resource.shares
        held = view.daemon.ceilings
        for bound in shares.escape_bounds(held or view.allocator.ceilings(), [g.share for g in grants]):
            per_gpu.setdefault(bound.uuid, {"replicas": 0, "healthy": 0}).update(
                ordinal=bound.ordinal,
                liveGrants=bound.live_grants,
                memoryCeilingMiB=bound.memory_ceiling_mib,
                memoryMiB=shares.gpus[bound.ordinal].memory_mib,
                threadCeiling=bound.thread_ceiling,
                memoryEscapeMiB=bound.memory_escape_mib,
                threadEscape=bound.thread_escape,
            )
        entries.append(
            {
                "name": view.allocator.resource.name,
                "registered": view.registered,
                "registrations": view.registrations,
                "registrationFailures": view.registration_failures,
                "replicas": len(devices),
                "healthy": sum(d.health is Health.HEALTHY for d in devices),
                "gpus": per_gpu,
                "daemon": {
                    "pid": view.daemon.pid,
                    "up": view.daemon.up,
                    "capMode": _cap_mode(held, shares.full_hardware()),
                    "ceilings": None
                    if held is None
                    else {"threadPercentage": held.thread_percentage, "memoryMiB": list(held.memory_mib)},
                    "restarts": view.daemon.restarts,
                    "restartAttempts": view.daemon.restart_attempts,
                    "multiUser": view.daemon.multi_user,
                    "capTamper": view.daemon.cap_tamper,
                    "lastCapTamper": _event(view.daemon.last_cap_tamper, "found"),
                    "frontEndFailure": _event(view.daemon.front_end_failure, "reason"),
                },
                "ledger": {
                    "allocated": {kind.value: count for kind, count in stats.grants.items()},
                    "adopted": stats.adopted_grants,
                    "superseded": stats.superseded_grants,
                    "released": stats.released_grants,
                    "live": {kind.value: count for kind, count in stats.live_grants.items()},
                },
                "grants": [
                    {
                        "id": grant.grant_id,
                        "kind": grant.kind.value,
                        "share": grant.share.describe(),
                        "container": str(grant.owner) if grant.owner else None,
                        "adopted": grant.adopted,
                        "grantedAt": _utc(grant.granted_at),
                        "unlistedSince": _wall(grant.missing_since),
                        "deviceIds": list(grant.replica_ids),
                    }
                    for grant in grants
                ],
            }
        )
    return {
        "version": version,
        "pid": pid,
        "tasks": tasks,
        "podResources": pod_resources,
        "unhealthyGpus": dict(sorted(unhealthy_gpus.items())),
        "resources": entries,
    }


def write_status(mps_root: Path, document: dict[str, Any]) -> None:
    """Raises OSError (FileRefusedError when something other than a regular file is in the way)."""
    written = {**document, "writtenAt": _utc(time.time())}
    write_atomically(
        mps_root / STATUS_FILE, json.dumps(written, indent=1).encode(), STATUS_FILE_MODE, what="the status file"
    )


def remove_status(mps_root: Path) -> None:
    """Raises OSError."""
    (mps_root / STATUS_FILE).unlink(missing_ok=True)


def read_status(mps_root: Path) -> dict[str, Any]:
    """The running agent's status; raises UsageError naming what to check when there is none."""
    path = mps_root / STATUS_FILE
    try:
        document: dict[str, Any] = json.loads(
            read_regular_file(path, max_bytes=MAX_STATUS_BYTES, what="the agent status", follow_symlinks=False)
        )
    except FileNotFoundError:
        raise UsageError(
            f"no agent status at {path}: is mpsagent running with this --mps-root (or MPS_ROOT)?"
        ) from None
    except FileRefusedError as exc:
        raise UsageError(f"{exc}; remove it") from exc  # the agent writes a new one within a second
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the agent status {path}: {exc}") from exc
    return document


def agent_alive(document: dict[str, Any]) -> bool:
    try:
        pid = int(document["pid"])
    except (KeyError, ValueError, TypeError):
        return True  # an older or damaged file: do not claim the agent is gone
    return pid_alive(pid)


def readiness_problems(document: dict[str, Any]) -> list[str]:
    """What keeps the agent from being ready: each resource must be registered with the kubelet and its MPS daemon
    up. Empty when ready."""
    problems = []
    for res in document["resources"]:
        if not res["registered"]:
            problems.append(f"{res['name']}: not registered with the kubelet")
        if not res["daemon"]["up"]:
            problems.append(f"{res['name']}: mps daemon down")
    return problems


def starting_document(resources: Sequence[str]) -> dict[str, Any]:
    """What the agent publishes before its first real document: every resource unregistered, its daemon down and
    no grants, so that metrics and probes have every series and line from the first scrape."""
    return {
        "resources": [
            {
                "name": name,
                "registered": False,
                "registrations": 0,
                "registrationFailures": 0,
                "gpus": {},
                "daemon": {
                    "up": False,
                    "capMode": None,
                    "ceilings": None,
                    "restarts": 0,
                    "restartAttempts": 0,
                    "multiUser": None,
                    "capTamper": 0,
                },
                "ledger": {"allocated": {}, "adopted": 0, "released": 0, "live": {}},
            }
            for name in resources
        ],
        "podResources": {"available": False, "failures": 0},
    }


def summary(document: dict[str, Any]) -> str:
    """One line for systemd's STATUS=."""
    problems = readiness_problems(document)
    if problems:
        return "; ".join(problems)
    return "serving " + "; ".join(
        f"{res['name']} ({res['healthy']}/{res['replicas']} healthy, {len(res['grants'])} grants, "
        f"caps {res['daemon']['capMode']})"
        for res in document["resources"]
    )


def _users(multi_user: bool | None) -> str:
    if multi_user is None:
        return "user mode unknown (adopted from an older agent)"
    return "one server for every user (-M)" if multi_user else "one server per user"


def _daemon_events(daemon: dict[str, Any]) -> list[str]:
    lines = []
    tampered = daemon.get("lastCapTamper")
    if tampered:
        lines.append(
            f"  caps changed behind the agent {daemon['capTamper']} times, last at {tampered['at']} "
            f"(restored): {tampered['found']}"
        )
    failing = daemon.get("frontEndFailure")
    if failing:
        lines.append(
            f"  control front-end CANNOT RUN since {failing['at']}: {failing['reason']} "
            "(the daemon is kept; cap switches fail until it runs)"
        )
    return lines


def _gpu_lines(gpus: dict[str, dict[str, Any]]) -> list[str]:
    """Each GPU's ceilings and escape bound: what a container on it gets at most by unsetting its variables."""
    lines = []
    for uuid, gpu in gpus.items():
        if "memoryCeilingMiB" not in gpu:
            continue
        lines.append(
            f"  GPU {gpu['ordinal']} ({uuid}): {gpu['liveGrants']} live grants; ceilings "
            f"{gpu['memoryCeilingMiB']} of {gpu['memoryMiB']} MiB, threads {gpu['threadCeiling']}%; escape bound: "
            f"+{gpu['memoryEscapeMiB']} MiB, +{gpu['threadEscape']} threads % over the smallest live share"
        )
    return lines


def render_status_text(document: dict[str, Any]) -> str:
    pod_resources = document["podResources"]
    alive = "" if agent_alive(document) else " -- NOT RUNNING: this is its last state"
    lines = [
        f"mpsagent {document['version']} (pid {document['pid']}), written {document.get('writtenAt', '?')}{alive}",
        f"pod-resources: {'answering' if pod_resources['available'] else 'NOT answering'} ({pod_resources['socket']})",
    ]
    for uuid, reason in document["unhealthyGpus"].items():
        lines.append(f"GPU {uuid} unhealthy: {reason}")
    for res in document["resources"]:
        daemon = res["daemon"]
        lines += [
            "",
            f"{res['name']}: {res['healthy']}/{res['replicas']} replicas healthy, "
            f"{'registered' if res['registered'] else 'NOT registered'} with the kubelet",
            f"  mps daemon: {'up' if daemon['up'] else 'DOWN'}, pid {daemon['pid']}, caps {daemon['capMode']}, "
            f"{daemon['restarts']} restarts, {_users(daemon.get('multiUser'))}",
            *_daemon_events(daemon),
            *_gpu_lines(res["gpus"]),
            f"  grants: {len(res['grants'])}",
        ]
        for grant in res["grants"]:
            ids = grant["deviceIds"]
            shown = ", ".join(ids) if len(ids) <= 2 else f"{ids[0]} ... ({len(ids)} replicas)"
            note = " (adopted)" if grant["adopted"] else ""
            if grant["unlistedSince"]:
                note += f" (not listed by the kubelet since {grant['unlistedSince']})"
            holder = grant["container"] or "container not yet known"
            share = f" [{grant['share']}]" if grant.get("share") else ""
            lines.append(f"    #{grant['id']} {grant['kind']:<6} {holder}{note}{share}: {shown}")
    return "\n".join(lines)
