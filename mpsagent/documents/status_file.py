"""The status file, `<mps-root>/status.json`: the status document's bytes, written by the agent's publisher
(atomically, owner-only: it names pods) whenever its content changes, removed when the agent stops, read back by
`--status`, and whether the agent that wrote it still runs. `status` builds the document and renders it for people.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec

from mpsagent.base.clock import parse_utc, utc
from mpsagent.base.errors import FileRefusedError, UsageError
from mpsagent.base.host import pid_alive, process_started, read_regular_file, write_atomically
from mpsagent.documents.status_document import StatusDocument

STATUS_FILE = "status.json"
STATUS_FILE_MODE = 0o600  # it names pods
# Far above any real status (every replica of a node in grants is a few MB), far below what hurts to read.
MAX_STATUS_BYTES = 64 * 1024 * 1024
START_TIME_SLACK_S = 2.0
"""A process's start time and the file's write time are each known to about a second."""


def render_status_json(document: StatusDocument, *, indent: int = 2) -> str:
    """The document as JSON: the standard library's layout and escaping, which status.json has always had. The
    DRA fields (`dra`, a grant's `claim`) and `stowaways` are left out when absent, so that an agent without --dra
    and without NVML writes the bytes it always wrote."""
    builtins = msgspec.to_builtins(document)
    for absent in ("dra", "stowaways"):
        if builtins[absent] is None:
            del builtins[absent]
    for resource in builtins["resources"]:
        for grant in resource["grants"]:
            if grant["claim"] is None:
                del grant["claim"]
    # msgspec writes the standard library's layout, 30x faster (0.9 against 26 ms for 384 grants: the pure-Python
    # encoder runs whenever there is an indent, on the event loop); the document has no floats, and only its
    # escaping of non-ASCII differs, so such a document takes the slow path.
    encoded = msgspec.json.format(msgspec.json.encode(builtins), indent=indent)
    return encoded.decode() if encoded.isascii() else json.dumps(builtins, indent=indent)


def write_status(mps_root: Path, document: StatusDocument) -> None:
    """Raises OSError (FileRefusedError when something other than a regular file is in the way)."""
    written = msgspec.structs.replace(document, written_at=utc(time.time()))
    write_atomically(
        mps_root / STATUS_FILE, render_status_json(written, indent=1).encode(), STATUS_FILE_MODE, what="the status file"
    )


def remove_status(mps_root: Path) -> None:
    """Raises OSError."""
    (mps_root / STATUS_FILE).unlink(missing_ok=True)


def read_status(mps_root: Path) -> StatusDocument:
    """The running agent's status; raises UsageError naming what to check when there is none, or it cannot be
    read. An older agent's file reads with the fields it lacks at their defaults."""
    path = mps_root / STATUS_FILE
    try:
        text = read_regular_file(path, max_bytes=MAX_STATUS_BYTES, what="the agent status", follow_symlinks=False)
        return msgspec.json.decode(text, type=StatusDocument)
    except FileNotFoundError:
        raise UsageError(
            f"no agent status at {path}: is mpsagent running with this --mps-root (or MPS_ROOT)?"
        ) from None
    except FileRefusedError as exc:
        raise UsageError(f"{exc}; remove it") from exc  # the agent writes a new one within a second
    except RecursionError as exc:  # msgspec's own bound on nesting, below Python's stack
        raise _unreadable(path, "it nests deeper than the agent ever writes") from exc
    except (OSError, msgspec.DecodeError) as exc:
        raise _unreadable(path, str(exc)) from exc


def _unreadable(path: Path, problem: str) -> UsageError:
    return UsageError(
        f"cannot read the agent status {path}: {problem}; the agent rewrites it within a second, "
        "or remove it if no agent runs"
    )


def agent_running(document: StatusDocument) -> bool:
    """Whether the agent that wrote the document still runs: its PID names a live process (never PID 1, which is
    init) that started before the document was last written; a process that started later got the PID after the
    agent ended. An older agent's file, without a PID, is not claimed gone."""
    if document.pid is None:
        return True
    if not pid_alive(document.pid):
        return False
    started, written = process_started(document.pid), parse_utc(document.written_at)
    return started is None or written is None or started <= written + START_TIME_SLACK_S
