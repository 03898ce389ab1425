"""The driver's memory limits, where the node has them: the enforcement layer over MPS's ceilings, built at start
when the agent has its CDI hook and the driver limits memory per cgroup on some GPU (`Gpu.enforcement`). Its parts
are the memory-limit devices' CDI spec, which both routes name for a capped container on such a GPU
(`kubelet.memory_limit_devices`), and the read-back of every container the hook limited (`gpu.limits_watch`). On
every other GPU (and on every GPU without the hook) MPS's ceilings and the client's environment stay the only
layer; they stay the second layer everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mpsagent.base.settings import Settings
from mpsagent.base.values import Enforcement
from mpsagent.domain.plan import NodePlan
from mpsagent.gpu.limits_watch import ContainerLimitsWatch
from mpsagent.gpu.port import GpuSource
from mpsagent.kubelet.memory_limit_devices import HookCommand, MemoryLimitDevices
from mpsagent.supervisor.resource_server import ResourceServer

RECORDS = "memory-limits"
"""Where the hook records the containers it limited, under the MPS root."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverLimits:
    devices: MemoryLimitDevices
    watch: ContainerLimitsWatch


def driver_limits(
    settings: Settings, plan: NodePlan, source: GpuSource, hook: Path | None, servers: Sequence[ResourceServer]
) -> DriverLimits | None:
    """The driver's layer, or None where no GPU has it. `servers`: the resources' servers, filled once they are
    built (the live grants whose devices the spec keeps)."""
    driver = source.memory_limits
    if hook is None or driver is None or all(gpu.enforcement is Enforcement.MPS for gpu in plan.gpus):
        return None
    records = plan.mps_root / RECORDS
    devices = MemoryLimitDevices(
        spec_dir=settings.cdi_spec_dir,
        hook=HookCommand(path=hook, records=records),
        live=lambda: [device for server in servers for device in server.allocator.memory_limit_devices()],
    )
    return DriverLimits(
        devices=devices,
        watch=ContainerLimitsWatch(records=records, driver=driver, interval_s=settings.probe_interval_s),
    )
