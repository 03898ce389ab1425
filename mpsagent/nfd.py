"""The node labels as a node-feature-discovery local feature file: `key=value` lines, written atomically.

NFD's worker reads every file in its `features.d` directory and labels the node with them. The directory is
NFD's: when it is absent (NFD not installed), the agent says so and writes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

from mpsagent.host import write_atomically

FILE_MODE = 0o644  # NFD's worker may run as another user


def features_text(labels: Mapping[str, str]) -> str:
    return "".join(f"{key}={value}\n" for key, value in sorted(labels.items()))


def write_features(path: Path, labels: Mapping[str, str]) -> bool:
    """Write the labels unless the file already holds them; True when written. Raises OSError."""
    text = features_text(labels)
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return False
    write_atomically(path, text.encode(), FILE_MODE)
    return True


def remove_features(path: Path) -> None:
    path.unlink(missing_ok=True)
