"""The prepared claims, kept on disk so that an agent restart keeps them: the claim handler saves the whole set after
each prepare and unprepare, and loads it at start.

`{"version": 1, "claims": [...]}` in JSON, replaced whole. A checkpoint that cannot be read is an error naming the
file, never an empty set taken silently (the agent would forget shares it holds); the message says that deleting
the file is the way out: the kubelet prepares each claim again on its next try.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from mpsagent.base.errors import FileRefusedError, HostError, shown
from mpsagent.base.host import os_reason, read_regular_file, write_atomically
from mpsagent.base.values import MIB
from mpsagent.domain.claims import PreparedClaim

VERSION = 1
MAX_BYTES = 4 * MIB
"""Hundreds of claims take tens of KiB."""
MODE = 0o600  # it names pods, as status.json does
_WHAT = "the DRA checkpoint"
_WAY_OUT = "delete it, and the kubelet's next prepare of each claim starts again"


class _Header(msgspec.Struct, kw_only=True):
    version: int


class _Checkpoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    version: int
    claims: tuple[PreparedClaim, ...]


def _refused(path: Path, problem: str) -> HostError:
    return HostError(f"{_WHAT} {path} {problem}: {_WAY_OUT}")


def load(path: Path) -> tuple[PreparedClaim, ...]:
    """The claims saved in `path`; none when there is no such file. Raises HostError naming the file for one that
    cannot be read, is too large or does not hold a checkpoint of this version."""
    try:
        data = read_regular_file(path, max_bytes=MAX_BYTES, what=_WHAT)
    except FileNotFoundError:
        return ()
    except FileRefusedError as exc:
        raise _refused(path, exc.problem) from exc
    except OSError as exc:
        raise _refused(path, f"cannot be read ({os_reason(exc)})") from exc
    try:
        version = msgspec.json.decode(data, type=_Header).version
    except msgspec.DecodeError as exc:
        raise _refused(path, f"is not a checkpoint ({shown(exc, 200)})") from exc
    if version != VERSION:
        raise _refused(path, f"has version {version}; this agent reads version {VERSION}")
    try:
        return msgspec.json.decode(data, type=_Checkpoint).claims
    except msgspec.DecodeError as exc:
        raise _refused(path, f"is not a valid checkpoint ({shown(exc, 200)})") from exc


def encode(claims: Sequence[PreparedClaim]) -> bytes:
    """The checkpoint's content for these claims."""
    return msgspec.json.encode(_Checkpoint(version=VERSION, claims=tuple(claims))) + b"\n"


def save(path: Path, claims: Sequence[PreparedClaim]) -> None:
    """Replace the checkpoint with these claims, durably: a reader (or a power cut) sees the old set or the new
    one. Raises HostError naming the file when it cannot be written."""
    try:
        write_atomically(path, encode(claims), MODE, what=_WHAT, durable=True)
    except FileRefusedError as exc:
        raise HostError(f"cannot write {_WHAT} {path}: it {exc.problem}") from exc
    except OSError as exc:
        raise HostError(f"cannot write {_WHAT} {path}: {os_reason(exc)}") from exc
