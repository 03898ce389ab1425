"""The agent's domain values for unit tests, built the way the agent builds them: GPUs of a model (`gpu`,
`gpus_of`), a node of them (`node_gpus`), a config's text read and checked (`sharing`), the plan of a config for a
node (`node_plan`, `resource_plan`), one resource's shares (`share_model`), replica IDs (`replica_id`); and what a
ledger holds of DRA claims (`claims_held`). GPU `i`'s UUID is `uuid(i)`, as in the test node's snapshot files
(`mpsagent_testing.node`); the tests that start from such a file build their plans through the snapshot adapter."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from mpsagent.base.config import SharingConfig, check_config, parse_config
from mpsagent.base.devices import Gpu, GpuUuid, NodeGpus, ReplicaId, format_replica_id
from mpsagent.domain.ledger import Grant, Ledger
from mpsagent.domain.plan import NodePlan, ResourcePlan, build_plan
from mpsagent.domain.shares import ShareModel

GIB = 1 << 30
MPS_ROOT = Path("/run/nvidia/mps")
DRIVER_VERSION = "550.54.15"


@dataclass(frozen=True)
class GpuModel:
    """What NVML reports of every GPU of one model."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]


T4 = GpuModel("Tesla T4", 16 * GIB, (7, 5))
H100 = GpuModel("NVIDIA H100 80GB HBM3", 85520809984, (9, 0))
"""81559 MiB, as NVML reports an H100: 1 of 4 is 20389 MiB, the NVIDIA plugin's figure."""
H200 = GpuModel("NVIDIA H200", 150754820096, (9, 0))
"""143771 MiB, as NVML reports an H200."""


def uuid(index: int) -> GpuUuid:
    return GpuUuid(f"GPU-{index:08d}-aaaa-bbbb-cccc-dddddddddddd")


def replica_id(index: int, replica: int) -> ReplicaId:
    """Replica `replica` of GPU `index`."""
    return format_replica_id(uuid(index), replica)


def gpu(
    index: int,
    model: GpuModel = T4,
    *,
    memory_bytes: int | None = None,
    compute_capability: tuple[int, int] | None = None,
    numa_node: int | None = 0,
    mig_enabled: bool = False,
) -> Gpu:
    """GPU `index` of the node (PCI bus `index + 1`): a `model`, with another memory or compute capability where
    given."""
    return Gpu(
        uuid=uuid(index),
        index=index,
        name=model.name,
        memory_bytes=model.memory_bytes if memory_bytes is None else memory_bytes,
        compute_capability=model.compute_capability if compute_capability is None else compute_capability,
        pci_bus_id=f"00000000:{index + 1:02X}:00.0",
        numa_node=numa_node,
        mig_enabled=mig_enabled,
    )


def gpus_of(count: int, model: GpuModel = T4, *, memory_bytes: int | None = None) -> tuple[Gpu, ...]:
    """GPUs 0 to `count - 1`, all of one model."""
    return tuple(gpu(index, model, memory_bytes=memory_bytes) for index in range(count))


def node_gpus(*gpus: Gpu, driver_version: str = DRIVER_VERSION) -> NodeGpus:
    return NodeGpus(driver_version=driver_version, gpus=gpus, source="test")


def sharing(text: str) -> SharingConfig:
    """A config file's text (dedented) read and checked as the agent reads a config file."""
    return check_config(parse_config(textwrap.dedent(text), "config.yaml"))


def node_plan(
    gpu_node: NodeGpus, *resources: str, mps: str = "", flags: str = "", mps_root: Path = MPS_ROOT
) -> NodePlan:
    """The plan of a v1 config for `gpu_node`: `resources` are its sharing.mps.resources (YAML flow mappings), `mps`
    more lines of sharing.mps (`failRequestsGreaterThanOne: false`), `flags` its flags (a YAML flow mapping)."""
    text = "version: v1\nsharing:\n  mps:\n"
    if mps:
        text += textwrap.indent(textwrap.dedent(mps).strip() + "\n", "    ")
    text += "    resources:\n" + "".join(f"    - {entry}\n" for entry in resources)
    if flags:
        text += f"flags: {flags}\n"
    return build_plan(sharing(text), gpu_node, mps_root)


def resource_plan(gpu_node: NodeGpus, entry: str, *, mps: str = "", flags: str = "") -> ResourcePlan:
    """The one resource of `node_plan(gpu_node, entry, ...)`."""
    (only,) = node_plan(gpu_node, entry, mps=mps, flags=flags).resources
    return only


def share_model(gpu_count: int = 1, replicas: int = 4, *, memory_bytes: int = T4.memory_bytes) -> ShareModel:
    """The shares of a resource of `replicas` replicas on each of `gpu_count` GPUs of `memory_bytes` (proportional
    grants, ceilings enforced: the config's defaults)."""
    gpus = gpus_of(gpu_count, memory_bytes=memory_bytes)
    return resource_plan(node_gpus(*gpus), f"{{name: gpu, replicas: {replicas}}}").shares


def claims_held(ledger: Ledger) -> tuple[Grant, ...]:
    """The ledger's live grants that hold a DRA claim's share, in the order they were made."""
    return tuple(grant for grant in ledger.live_grants() if grant.claim is not None)
