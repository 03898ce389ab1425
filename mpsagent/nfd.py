"""The node labels as a node-feature-discovery local feature file: `key=value` lines, written atomically.

NFD's worker reads every file in its `features.d` directory and labels the node with them. The directory is
NFD's: when it is absent (NFD not installed), the agent says so and writes nothing.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from pathlib import Path

from mpsagent.host import FileRefusedError, FileTooLargeError, read_regular_file, write_atomically
from mpsagent.logs import get_logger

log = get_logger(__name__)
FILE_MODE = 0o644  # NFD's worker may run as another user
WHAT = "the node-feature-discovery file"


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
