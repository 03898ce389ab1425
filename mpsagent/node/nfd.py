"""The node labels (those NVIDIA's GPU feature discovery would set for the plan) as a node-feature-discovery
local feature file: `key=value` lines, written atomically.

NFD's worker reads every file in its `features.d` directory and labels the node with them. The directory is
NFD's: when it is absent (NFD not installed), the agent says so and writes nothing.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Mapping
from pathlib import Path

from mpsagent.base.devices import Gpu
from mpsagent.base.errors import FileRefusedError, FileTooLargeError
from mpsagent.base.host import read_regular_file, write_atomically
from mpsagent.base.logs import get_logger
from mpsagent.domain.plan import ResourcePlan

log = get_logger(__name__)
FILE_MODE = 0o644  # NFD's worker may run as another user
WHAT = "the node-feature-discovery file"
_LABEL_VALUE_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


ENFORCEMENT_LABEL_PREFIX = "mpsagent.io/memory-enforcement.gpu-"
"""`mpsagent.io/memory-enforcement.gpu-<index>`: `driver` or `mps`, who holds a capped container to its memory on
that GPU (a node selector for workloads that need the driver's limit)."""


def node_labels(gpus: tuple[Gpu, ...], resources: tuple[ResourcePlan, ...]) -> dict[str, str]:
    """The labels the NVIDIA GPU feature discovery would set for this plan (first resource decides replicas)."""
    first = resources[0]
    product = _LABEL_VALUE_UNSAFE.sub("", gpus[0].name.replace(" ", "-")) if gpus else "unknown"
    if not first.renamed:
        product = f"{product}-SHARED"
    return {
        "nvidia.com/gpu.count": str(len(gpus)),
        "nvidia.com/gpu.product": product[:63].strip("-_."),
        "nvidia.com/gpu.replicas": str(first.replicas),
        "nvidia.com/gpu.sharing-strategy": "mps",
        "nvidia.com/mps.capable": "true",
        **{f"{ENFORCEMENT_LABEL_PREFIX}{gpu.index}": gpu.enforcement.value for gpu in gpus},
    }


def features_text(labels: Mapping[str, str]) -> str:
    return "".join(f"{key}={value}\n" for key, value in sorted(labels.items()))


def write_features(path: Path, labels: Mapping[str, str]) -> bool:
    """Write the labels unless the file already holds them; True when written.

    Only a regular file is read or replaced (a FIFO there would block the agent, a link to a device fill its
    memory). Raises OSError: FileRefusedError for what is not a regular file.
    """
    text = features_text(labels).encode()
    try:
        if read_regular_file(path, max_bytes=len(text), what=WHAT, follow_symlinks=False) == text:
            return False
    except FileTooLargeError:
        pass  # cannot hold the labels: replaced below
    except FileRefusedError:
        raise
    except OSError:
        pass  # missing or unreadable: replaced below
    write_atomically(path, text, FILE_MODE, what=WHAT)
    return True


def remove_features(path: Path) -> None:
    """Remove the file the agent wrote (never what else stands there); a failure is logged, not raised."""
    try:
        if stat.S_ISREG(path.lstat().st_mode):
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("node labels not removed", path=str(path), reason=exc.strerror or str(exc))
