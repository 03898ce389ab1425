"""The `--once` report's types: what `--once --output json` prints, and `--once`'s text is rendered from.

Built by `report.plan_report` from the plan, with the functions the agent runs; camelCase on the wire. Where a new
field goes: into the Struct here, filled in `report.plan_report`, rendered in `report.render_text`, pinned in
tests/documents/golden/once-*.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mpsagent.domain.grant_kind import GrantKind


class GpuReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    uuid: str
    index: int
    name: str
    memory_bytes: int
    compute_capability: str
    pci_bus_id: str
    numa_node: int | None
    mig_enabled: bool
    enforcement: str = "mps"
    """Who holds a capped container to its memory on it: `driver` (its cgroup's limit, then MPS) or `mps`."""
    enforcement_reason: str | None = None
    """Why the driver does not (`mps`)."""


class ComputeModeReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    mode: str | None = msgspec.field(name="set")
    """The compute mode the agent sets, None when it leaves it."""
    note: str


class DaemonStartReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    argv: tuple[str, ...]
    env: dict[str, str]


class MultiUserReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    setting: str
    """sharing.mps.multiUser."""
    offered: bool | None
    """Whether the control binary has a multi-user server; None: it could not be asked."""
    server: bool
    note: str


class CeilingsReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    enforced_at_daemon: bool
    full_hardware: tuple[str, ...]
    until_grants_known: tuple[str, ...]


class MountReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    host_path: str
    container_path: str


class ExampleReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """One example request: either refused (`error`) or granted (`share`, `envs`, `mounts`, `cdiDevices`); what
    does not apply is left out of the JSON."""

    request: int
    title: str
    kind: GrantKind
    error: str | None = None
    share: str | None = None
    envs: dict[str, str] | None = None
    mounts: tuple[MountReport, ...] | None = None
    cdi_devices: tuple[str, ...] | None = None
    ceilings: str
    """The daemon's ceilings while this is the only live grant."""


class ResourceReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    name: str
    replicas: int
    memory_unit_bytes: int | None
    grants: str
    """The share rule, or `memory units`."""
    gpus: tuple[str, ...]
    device_ids: tuple[str, ...]
    pipe_directory: str
    log_directory: str
    compute_mode: ComputeModeReport
    daemon_start: DaemonStartReport
    multi_user: MultiUserReport
    daemon_commands: tuple[str, ...]
    ceilings: CeilingsReport
    fail_requests_greater_than_one: bool
    examples: tuple[ExampleReport, ...]


class ClaimExampleReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What a container of an example claim gets on the node's first shared GPU."""

    title: str
    device: str
    memory_mib: int = msgspec.field(name="memoryMiB")
    thread_percentage: int
    kind: GrantKind
    envs: dict[str, str]
    ceilings: str
    """The daemon's ceilings while this is the only live share of its resource."""


class DraReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """With --dra on: the ResourceSlice the agent would publish, and what example claims get."""

    resource_slice: dict[str, Any]
    """The ResourceSlice object (resource.k8s.io/v1), as the API server is sent it."""
    examples: tuple[ClaimExampleReport, ...]


class PlanReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """What `--once` prints."""

    driver_version: str
    gpu_source: str
    gpus: tuple[GpuReport, ...]
    resources: tuple[ResourceReport, ...]
    labels: dict[str, str]
    dra: DraReport | None = None
