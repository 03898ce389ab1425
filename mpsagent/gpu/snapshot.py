"""The node-snapshot adapter: GPUs from a YAML/JSON file or from `nvidia-smi -q -x` XML (`--node-snapshot`)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import msgspec

from mpsagent.base.devices import (
    MAX_GPUS_PER_NODE,
    UNKNOWN_DRIVER_VERSION,
    Gpu,
    GpuUuid,
    NodeGpus,
    driver_version_problem,
    gpu_problem,
)
from mpsagent.base.errors import DocumentError, FileReadError, SnapshotError, shown
from mpsagent.base.host import read_input_file
from mpsagent.base.untrusted import load_yaml
from mpsagent.base.values import MIB
from mpsagent.gpu.port import ComputeMode

MAX_SNAPSHOT_BYTES = 4 << 20
"""`nvidia-smi -q -x` writes 10-30 KB per GPU: room for the most GPUs a node may have, at twice that."""
_NO_NUMA_NODE = -1  # as sysfs says it
NOT_ASKED = "GPUs from a node snapshot: the driver's memory limits are asked through NVML when the agent runs"


class _SnapshotGpu(msgspec.Struct, rename="camel", forbid_unknown_fields=True, kw_only=True):
    uuid: str
    index: int
    name: str
    memory_bytes: int
    compute_capability: str
    pci_bus_id: str = ""
    numa_node: int | None = None
    mig_enabled: bool = False


class _Snapshot(msgspec.Struct, rename="camel", forbid_unknown_fields=True, kw_only=True):
    driver_version: str = UNKNOWN_DRIVER_VERSION
    gpus: list[_SnapshotGpu]


_CAPABILITY = re.compile(r"(\d{1,2})\.(\d{1,2})")

# nvidia-smi's XML has no compute capability; the architecture (and, where it is ambiguous, the product) tells it.
_ARCHITECTURE_CAPABILITY: dict[str, tuple[int, int]] = {
    "kepler": (3, 5),
    "maxwell": (5, 2),
    "pascal": (6, 1),
    "volta": (7, 0),
    "turing": (7, 5),
    "ampere": (8, 6),
    "ada lovelace": (8, 9),
    "hopper": (9, 0),
    "blackwell": (10, 0),
}
_PRODUCT_CAPABILITY: tuple[tuple[str, tuple[int, int]], ...] = (
    ("P100", (6, 0)),
    ("A100", (8, 0)),
    ("A30", (8, 0)),
    ("RTX PRO", (12, 0)),
    ("RTX 50", (12, 0)),
)


def _capability(text: str, where: str) -> tuple[int, int]:
    match = _CAPABILITY.fullmatch(text.strip())
    if not match:
        raise SnapshotError(f'{where}.computeCapability `{shown(text)}` must look like "9.0"')
    return int(match.group(1)), int(match.group(2))


def _check_count(count: int, source: str) -> None:
    if not count:
        raise SnapshotError(f"node snapshot {source}: lists no GPUs")
    if count > MAX_GPUS_PER_NODE:
        raise SnapshotError(
            f"node snapshot {source}: lists {count} GPUs; a node has at most {MAX_GPUS_PER_NODE} "
            "(see docs/configuration.md)"
        )


def _from_document(document: object, source: str) -> NodeGpus:
    try:
        snapshot = msgspec.convert(document, _Snapshot, str_keys=True)
    except msgspec.ValidationError as exc:
        raise SnapshotError(f"node snapshot {source}: {shown(exc, 200)}") from exc
    _check_count(len(snapshot.gpus), source)
    gpus = tuple(
        Gpu(
            uuid=GpuUuid(entry.uuid),
            index=entry.index,
            name=entry.name,
            memory_bytes=entry.memory_bytes,
            compute_capability=_capability(entry.compute_capability, f"node snapshot {source}: gpus[{position}]"),
            pci_bus_id=entry.pci_bus_id,
            numa_node=None if entry.numa_node in (None, _NO_NUMA_NODE) else entry.numa_node,
            mig_enabled=entry.mig_enabled,
            memory_limits_unavailable=NOT_ASKED,
        )
        for position, entry in enumerate(snapshot.gpus)
    )
    return _checked(gpus, snapshot.driver_version, source)


def _text(element: ET.Element, path: str, default: str = "") -> str:
    found = element.find(path)
    return (found.text or "").strip() if found is not None else default


def _xml_capability(gpu: ET.Element, product: str, where: str) -> tuple[int, int]:
    explicit = _text(gpu, "compute_cap")
    if explicit:
        return _capability(explicit, where)
    for marker, capability in _PRODUCT_CAPABILITY:
        if marker in product:
            return capability
    architecture = _text(gpu, "product_architecture").lower()
    if architecture in _ARCHITECTURE_CAPABILITY:
        return _ARCHITECTURE_CAPABILITY[architecture]
    raise SnapshotError(
        f"{where}: cannot tell the compute capability of `{product}` (architecture `{architecture or 'missing'}`); "
        "use a YAML snapshot with computeCapability instead"
    )


def _from_smi_xml(text: str, source: str) -> NodeGpus:
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise SnapshotError(f"node snapshot {source}: not valid XML ({exc})") from exc
    if root.tag != "nvidia_smi_log":
        raise SnapshotError(f"node snapshot {source}: expected <nvidia_smi_log> from `nvidia-smi -q -x`")
    listed = root.findall("gpu")
    _check_count(len(listed), source)
    gpus = []
    for index, gpu in enumerate(listed):
        where = f"node snapshot {source}: gpus[{index}]"
        product = _text(gpu, "product_name")
        memory = re.fullmatch(r"(\d{1,12})\s*MiB", _text(gpu, "fb_memory_usage/total"))
        uuid = _text(gpu, "uuid")
        if not uuid or not memory:
            raise SnapshotError(f"{where}: needs <uuid> and <fb_memory_usage><total> in MiB")
        gpus.append(
            Gpu(
                uuid=GpuUuid(uuid),
                index=index,  # nvidia-smi lists GPUs in index order
                name=product,
                memory_bytes=int(memory.group(1)) * MIB,
                compute_capability=_xml_capability(gpu, product, where),
                pci_bus_id=_text(gpu, "pci/pci_bus_id", gpu.get("id", "")),
                numa_node=None,
                mig_enabled=_text(gpu, "mig_mode/current_mig").lower() == "enabled",
                memory_limits_unavailable=NOT_ASKED,
            )
        )
    return _checked(tuple(gpus), _text(root, "driver_version", UNKNOWN_DRIVER_VERSION), source)


def _checked(gpus: tuple[Gpu, ...], driver_version: str, source: str) -> NodeGpus:
    problem = driver_version_problem(driver_version)
    if problem:
        raise SnapshotError(f"node snapshot {source}: driverVersion {problem}")
    for position, gpu in enumerate(gpus):
        found = gpu_problem(gpu)
        if found:
            key, why = found
            raise SnapshotError(f"node snapshot {source}: gpus[{position}].{key} {why}")
    for field in ("uuid", "index"):
        counts = Counter(str(getattr(gpu, field)) for gpu in gpus)
        duplicates = sorted(value for value, count in counts.items() if count > 1)
        if duplicates:
            raise SnapshotError(f"node snapshot {source}: duplicate GPU {field} {', '.join(duplicates)}")
    ordered = tuple(sorted(gpus, key=lambda g: g.index))
    return NodeGpus(driver_version=driver_version, gpus=ordered, source=f"snapshot {source}")


class SnapshotGpuSource:
    """GPUs read once from a file; compute modes are not managed (there is no NVML to manage them with)."""

    manages_compute_mode = False
    health = None  # no NVML, no health to watch
    memory_limits = None  # nor any driver to limit memory

    def __init__(self, path: Path) -> None:
        self._path = path

    def discover(self) -> NodeGpus:
        try:
            text = read_input_file(self._path, max_bytes=MAX_SNAPSHOT_BYTES, what="--node-snapshot").decode("utf-8")
        except FileReadError as exc:
            raise SnapshotError(str(exc)) from exc
        except UnicodeDecodeError as exc:
            raise SnapshotError(f"--node-snapshot {self._path}: is not UTF-8 text (at byte {exc.start})") from exc
        if text.lstrip().startswith("<"):
            return _from_smi_xml(text, str(self._path))
        try:
            document = load_yaml(text)
        except DocumentError as exc:
            raise SnapshotError(f"node snapshot {self._path} {exc}") from exc
        return _from_document(document, str(self._path))

    def compute_mode(self, uuid: GpuUuid) -> ComputeMode:
        raise NotImplementedError("a node snapshot has no compute modes")

    def set_compute_mode(self, uuid: GpuUuid, mode: ComputeMode) -> None:
        raise NotImplementedError("a node snapshot has no compute modes")
