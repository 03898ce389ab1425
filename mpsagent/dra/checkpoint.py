"""The prepared claims, kept on disk so that an agent restart keeps them: the claim handler saves the whole set after
each prepare and unprepare, and loads it at start.

`{"version": 3, "sha256": "<hex>", "claims": [...]}` in JSON, replaced whole, durably, mode 0600; `sha256` is the
digest of the claims' bytes as written, so that a file changed since (edited, damaged) is refused. Each device stores
its grant kind (`kind`: `full`, `capped`); version 2, which an earlier agent wrote, said it as a flag (`whole`: true
for full) and is read as the kind it meant. A checkpoint that cannot be trusted is an error naming the file, never
an empty set taken silently (the agent would forget shares it holds): not a regular file (a link is not followed),
another user's or one others can write (whoever can write it can write a checksum that matches), unreadable,
without a checksum (version 1: an older agent's, or written by hand), another version, a checksum that does not
match, or an entry that breaks a rule (`check_entry`: what needs no knowledge of the node; the claim server checks
the rest). The message says that deleting the file is the way out: the kubelet prepares each claim again on its
next try.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from mpsagent.base.errors import FileRefusedError, HostError, shown
from mpsagent.base.host import os_reason, read_regular_file, write_atomically
from mpsagent.base.values import MIB
from mpsagent.domain.claims import CLAIM_UID, CLAIM_UID_FORM, MAX_CLAIM_UID_CHARS, PreparedClaim, PreparedDevice
from mpsagent.domain.grant_kind import GrantKind

VERSION = 3
"""What `save` writes and `load` reads; `load` reads version 2 too (`_version_2_claims`). Version 1 had no
checksum, and is refused."""
FLAGGED_KINDS = 2
"""The version whose devices said their kind as a flag, `whole`."""
MAX_BYTES = 4 * MIB
"""Hundreds of claims take tens of KiB."""
MODE = 0o600  # it names pods, as status.json does
_WHAT = "the DRA checkpoint"
_WAY_OUT = "delete it, and the kubelet's next prepare of each claim starts again"


class EntryError(ValueError):
    """A checkpoint entry that breaks a rule; the message names the entry (index and claim) and the rule."""


class _Header(msgspec.Struct, kw_only=True):
    version: int


class _Checkpoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    version: int
    sha256: str
    claims: msgspec.Raw
    """The claims' bytes as written, which the digest covers: kept raw, so that a field a later agent adds (with a
    default) changes no digest of a file an earlier one wrote."""


class _FlaggedDevice(msgspec.Struct, kw_only=True):
    """A version 2 device's kind, as it said it."""

    whole: bool
    """True for a full grant."""


class _FlaggedClaim(msgspec.Struct, kw_only=True):
    devices: tuple[_FlaggedDevice, ...]


def _version_2_claims(claims: bytes) -> tuple[PreparedClaim, ...]:
    """Version 2's claims, each device's `whole` flag read as the kind it meant (the only two kinds there were)."""
    flagged = msgspec.json.decode(claims, type=tuple[_FlaggedClaim, ...])
    entries = msgspec.json.decode(claims, type=list[dict[str, Any]])
    for entry, flags in zip(entries, flagged, strict=True):
        for device, flag in zip(entry["devices"], flags.devices, strict=True):
            device["kind"] = GrantKind.FULL if flag.whole else GrantKind.CAPPED
    return msgspec.convert(entries, type=tuple[PreparedClaim, ...])


def _refused(path: Path, problem: str) -> HostError:
    return HostError(f"{_WHAT} {path} {problem}: {_WAY_OUT}")


def _device_problem(device: PreparedDevice) -> str | None:
    if device.memory_mib < 1:
        return f"has memory_mib {device.memory_mib}; it must be at least 1"
    if not 1 <= device.thread_percentage <= 100:
        return f"has thread_percentage {device.thread_percentage}; it must be 1 to 100"
    if not 0 <= device.rounded_off_bytes < MIB:
        return f"has rounded_off_bytes {device.rounded_off_bytes}; it must be 0 to {MIB - 1} (less than 1 MiB)"
    if not 0 <= device.compute <= 100:
        return f"has compute {device.compute}; it must be 0 to 100"
    if not device.cdi_device_ids:
        return "has no CDI device ID (cdi_device_ids is empty)"
    return None


def _entry_problem(prepared: PreparedClaim) -> str | None:
    ref = prepared.claim
    if len(ref.uid) > MAX_CLAIM_UID_CHARS or CLAIM_UID.fullmatch(ref.uid) is None:
        return (
            f"has claim UID `{shown(ref.uid)}`, which is not a Kubernetes UID (at most {MAX_CLAIM_UID_CHARS} "
            f"characters of {CLAIM_UID_FORM})"
        )
    if not ref.namespace:
        return "has an empty namespace"
    if not ref.name:
        return "has an empty name"
    for number, device in enumerate(prepared.devices):
        problem = _device_problem(device)
        if problem is not None:
            return f"device {number} ({shown(device.device)}) {problem}"
    return None


def _entry(index: int, prepared: PreparedClaim) -> str:
    return f"entry {index} (claim {shown(prepared.claim)})"


def check_entry(index: int, prepared: PreparedClaim) -> None:
    """Check the checkpoint's entry `index` for what needs no knowledge of the node: a Kubernetes UID, a namespace
    and a name, and each device's figures within their ranges with a CDI device ID. Raises EntryError naming the
    entry and the rule it breaks."""
    problem = _entry_problem(prepared)
    if problem is not None:
        raise EntryError(f"{_entry(index, prepared)} {problem}")


def _checked(path: Path, claims: tuple[PreparedClaim, ...]) -> tuple[PreparedClaim, ...]:
    """The claims, every entry checked and no UID twice (two entries of one claim would hold its share twice, and
    its unprepare release one of them)."""
    first: dict[str, int] = {}
    for index, prepared in enumerate(claims):
        try:
            check_entry(index, prepared)
        except EntryError as exc:
            raise _refused(path, str(exc)) from exc
        earlier = first.setdefault(prepared.claim.uid, index)
        if earlier != index:
            raise _refused(
                path,
                f"{_entry(index, prepared)} has claim UID {prepared.claim.uid}, as {_entry(earlier, claims[earlier])} "
                "has: a claim is prepared once",
            )
    return claims


def _decoded(path: Path, data: bytes) -> tuple[PreparedClaim, ...]:
    try:
        version = msgspec.json.decode(data, type=_Header).version
    except msgspec.DecodeError as exc:
        raise _refused(path, f"is not a checkpoint ({shown(exc, 200)})") from exc
    try:
        if version == 1:
            raise _refused(
                path,
                "has version 1, which has no checksum (written by an older agent, or by hand), so what it holds "
                "cannot be trusted",
            )
        if version not in (FLAGGED_KINDS, VERSION):
            raise _refused(path, f"has version {version}; this agent reads versions {FLAGGED_KINDS} and {VERSION}")
        document = msgspec.json.decode(data, type=_Checkpoint)
        if hashlib.sha256(document.claims).hexdigest() != document.sha256:
            raise _refused(
                path, "does not match its checksum (sha256): it was changed or damaged after the agent wrote it"
            )
        if version == FLAGGED_KINDS:
            return _version_2_claims(document.claims)
        return msgspec.json.decode(document.claims, type=tuple[PreparedClaim, ...])
    except msgspec.DecodeError as exc:
        raise _refused(path, f"is not a valid checkpoint ({shown(exc, 200)})") from exc


def load(path: Path) -> tuple[PreparedClaim, ...]:
    """The claims saved in `path`; none when there is no such file. Raises HostError naming the file for one that
    is not a regular file (a link is not followed), is another user's or writable by others, cannot be read, is too
    large, does not hold a checkpoint of a version this agent reads (version 1 has no checksum), does not match its
    checksum, or has an entry that breaks a rule (`check_entry`, or a claim listed twice)."""
    try:
        data = read_regular_file(path, max_bytes=MAX_BYTES, what=_WHAT, follow_symlinks=False, own=True)
    except FileNotFoundError:
        return ()
    except FileRefusedError as exc:
        raise _refused(path, exc.problem) from exc
    except OSError as exc:
        raise _refused(path, f"cannot be read ({os_reason(exc)})") from exc
    return _checked(path, _decoded(path, data))


def encode(claims: Sequence[PreparedClaim]) -> bytes:
    """The checkpoint's content for these claims, with the digest of their bytes."""
    body = msgspec.json.encode(tuple(claims))
    document = _Checkpoint(version=VERSION, sha256=hashlib.sha256(body).hexdigest(), claims=msgspec.Raw(body))
    return msgspec.json.encode(document) + b"\n"


def save(path: Path, claims: Sequence[PreparedClaim]) -> None:
    """Replace the checkpoint with these claims, durably: a reader (or a power cut) sees the old set or the new
    one. Raises HostError naming the file when it cannot be written."""
    try:
        write_atomically(path, encode(claims), MODE, what=_WHAT, durable=True)
    except FileRefusedError as exc:
        raise HostError(f"cannot write {_WHAT} {path}: it {exc.problem}") from exc
    except OSError as exc:
        raise HostError(f"cannot write {_WHAT} {path}: {os_reason(exc)}") from exc
