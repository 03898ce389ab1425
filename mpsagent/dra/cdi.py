"""The Container Device Interface spec files of prepared claims: one file a claim, whose devices the kubelet names
to the container runtime (`mpsagent.io/mps-share=<claim UID>-<device>`), which then gives each container the
device's environment and mounts. The claim handler writes a claim's file when it prepares it and removes it when
it unprepares it; at start it lists the files (`claim_spec_uids`) to remove those of claims it no longer holds.

A file name carries a claim's UID, which comes from the kubelet: only a Kubernetes UID's characters are accepted,
so that no name can reach outside the directory. An entry named like the agent's but not its regular file (a
directory, a symbolic link, a name no UID makes) is skipped with a warning, never removed or followed.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

from mpsagent.base.errors import HostError, RequestError, shown
from mpsagent.base.host import file_kind, os_reason
from mpsagent.base.logs import get_logger
from mpsagent.domain.claims import CDI_VENDOR_CLASS, CLAIM_UID, CLAIM_UID_FORM, MAX_CLAIM_UID_CHARS
from mpsagent.kubelet.cdi_spec import CdiDevice, write_spec

_FILE_PREFIX = CDI_VENDOR_CLASS.replace("/", "-") + "_"
"""`mpsagent.io-mps-share_`: CDI's convention for spec file names, `<vendor>-<class>_<suffix>.json`."""
_SPEC_FILE = re.compile(re.escape(_FILE_PREFIX) + r"(?P<uid>[0-9a-f][0-9a-f-]*)\.json")
_WHAT = "the CDI spec"
_NOT_OUR_NAME = f"its name is not a spec file name of the agent ({_FILE_PREFIX}<claim UID>.json)"

log = get_logger(__name__)


def cdi_device_id(name: str) -> str:
    """The fully qualified CDI device name the kubelet passes on: `mpsagent.io/mps-share=<name>`."""
    return f"{CDI_VENDOR_CLASS}={name}"


def _checked_uid(claim_uid: str) -> str:
    if len(claim_uid) > MAX_CLAIM_UID_CHARS or CLAIM_UID.fullmatch(claim_uid) is None:
        raise RequestError(
            f"claim UID `{shown(claim_uid)}` is not a Kubernetes UID (at most {MAX_CLAIM_UID_CHARS} characters of "
            f"{CLAIM_UID_FORM}): the agent names no file after it"
        )
    return claim_uid


def spec_path(directory: Path, claim_uid: str) -> Path:
    """Where the claim's spec is: `<directory>/mpsagent.io-mps-share_<uid>.json`. Raises RequestError for a UID
    that is not a Kubernetes UID."""
    return directory / f"{_FILE_PREFIX}{_checked_uid(claim_uid)}.json"


def write_claim_spec(directory: Path, claim_uid: str, devices: Sequence[CdiDevice]) -> Path:
    """Write (or replace) the claim's spec in `directory`, created when missing; readers see the old file or the
    new one, never part of one. Returns its path. Raises RequestError for a UID or a device name CDI cannot carry,
    HostError when the file cannot be written.

    Not durable (no fsync, which cost a prepare about 1 ms on a disk): the checkpoint is, and a restarted agent
    writes the spec of every claim it holds again from it, so a spec lost with a power cut is whole again before
    the kubelet asks."""
    path = spec_path(directory, claim_uid)
    write_spec(path, CDI_VENDOR_CLASS, devices, what=_WHAT)
    return path


def _not_a_spec_file(mode: int) -> str | None:
    """Why an entry named like a spec is not one the agent may remove; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):  # planted, or made by hand: the agent never acts on whatever it names
        return "it is a symbolic link, which the agent does not follow"
    kind = file_kind(mode)  # `a directory`, `a FIFO`, ...; `not a regular file` for a kind it has no name for
    return f"it is {kind}, not a regular file" if kind.startswith("a ") else "it is not a regular file"


def remove_claim_spec(directory: Path, claim_uid: str) -> bool:
    """Remove the claim's spec; False when there was none (removing twice is fine), or when what has its name is
    not a regular file (left as it is, with a warning). Raises RequestError for a UID that is not a Kubernetes UID,
    HostError when the file cannot be removed."""
    path = spec_path(directory, claim_uid)
    try:
        problem = _not_a_spec_file(path.lstat().st_mode)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise HostError(f"cannot remove {_WHAT} {path}: {os_reason(exc)}") from exc
    if problem is not None:
        log.warning("cdi spec not removed", path=str(path), reason=problem)
        return False
    try:
        path.unlink()  # never through a link: were it one now, unlink removes the link itself
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise HostError(f"cannot remove {_WHAT} {path}: {os_reason(exc)}") from exc
    return True


def claim_spec_uids(directory: Path) -> set[str]:
    """The UIDs of the claims whose specs are regular files in `directory` (none when it is missing). Other
    vendors' files are left out unseen; an entry named like the agent's that is not its regular spec file is left
    out with one warning naming it and why. Raises HostError when the directory cannot be read."""
    try:
        with os.scandir(directory) as listing:
            entries = list(listing)
    except FileNotFoundError:
        return set()
    except OSError as exc:
        raise HostError(f"cannot list the CDI specs in {directory}: {os_reason(exc)}") from exc
    uids = set()
    for entry in entries:
        if not entry.name.startswith(_FILE_PREFIX):
            continue  # the directory is shared: other vendors' specs are theirs, and none of the agent's business
        found = _SPEC_FILE.fullmatch(entry.name)
        if found is None or len(found["uid"]) > MAX_CLAIM_UID_CHARS:
            problem: str | None = _NOT_OUR_NAME
        else:
            try:
                problem = _not_a_spec_file(entry.stat(follow_symlinks=False).st_mode)
            except FileNotFoundError:
                continue  # removed since the listing
            except OSError as exc:
                problem = f"it cannot be examined: {os_reason(exc)}"
            if problem is None:
                uids.add(found["uid"])
                continue
        log.warning("cdi directory entry skipped", path=str(directory / entry.name), reason=problem)
    return uids
