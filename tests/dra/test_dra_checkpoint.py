"""The prepared claims' checkpoint: what is saved loads back the same, a missing file holds no claims, and a file
that cannot be trusted is an error naming the file and the way out, never an empty set."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from mpsagent.base.errors import HostError
from mpsagent.domain.claims import ClaimRef, PreparedClaim, PreparedDevice
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.dra import checkpoint

WAY_OUT = "delete it, and the kubelet's next prepare of each claim starts again"


def prepared(name: str, uid: str, *, whole: bool = False) -> PreparedClaim:
    device = PreparedDevice(
        request="gpu",
        pool="node-1",
        device="gpu-0",
        share_id=None if whole else "a1b2c3",
        cdi_device_ids=(f"mpsagent.io/mps-share={uid}-gpu-0",),
        resource="nvidia.com/gpu",
        gpu="GPU-7f3a",
        memory_mib=81559 if whole else 8192,
        thread_percentage=100 if whole else 25,
        kind=GrantKind.FULL if whole else GrantKind.CAPPED,
    )
    return PreparedClaim(
        claim=ClaimRef(namespace="team-a", name=name, uid=uid),
        devices=(device,),
        pods=("team-a/trainer-0",),
        prepared_at=1764633600.5,
    )


CLAIMS = (prepared("small", "0b3c6a5e-0000-4000-8000-000000000001"), prepared("big", "0b3c6a5e-2", whole=True))


def test_saved_claims_load_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    checkpoint.save(path, CLAIMS)
    assert checkpoint.load(path) == CLAIMS
    assert json.loads(path.read_bytes())["version"] == 3
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it names pods
    checkpoint.save(path, ())
    assert checkpoint.load(path) == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]


def test_the_file_is_versioned_json_with_the_checksum_of_its_claims() -> None:
    """Version 3: the SHA-256 of the claims' bytes as written, so that a file changed since the agent wrote it
    (edited, damaged) is refused, not trusted; each device's grant kind stored as its word."""
    data = checkpoint.encode(CLAIMS[:1])
    claims = data[data.index(b'"claims":') + len(b'"claims":') : -len(b"}\n")]
    document = json.loads(data)
    assert document == {
        "version": 3,
        "sha256": hashlib.sha256(claims).hexdigest(),
        "claims": [
            {
                "claim": {"namespace": "team-a", "name": "small", "uid": "0b3c6a5e-0000-4000-8000-000000000001"},
                "devices": [
                    {
                        "request": "gpu",
                        "pool": "node-1",
                        "device": "gpu-0",
                        "share_id": "a1b2c3",
                        "cdi_device_ids": ["mpsagent.io/mps-share=0b3c6a5e-0000-4000-8000-000000000001-gpu-0"],
                        "resource": "nvidia.com/gpu",
                        "gpu": "GPU-7f3a",
                        "memory_mib": 8192,
                        "thread_percentage": 25,
                        "kind": "capped",
                        "rounded_off_bytes": 0,
                        "compute": 0,
                    }
                ],
                "pods": ["team-a/trainer-0"],
                "prepared_at": 1764633600.5,
            }
        ],
    }


def test_a_field_added_since_a_checkpoint_was_written_reads_as_its_default(tmp_path: Path) -> None:
    """The checksum covers the claims' bytes as written: a file written before a field with a default was added
    (`rounded_off_bytes` here) still matches it, and reads the default."""
    claims = msgspec.to_builtins(CLAIMS[:1])
    del claims[0]["devices"][0]["rounded_off_bytes"]
    body = json.dumps(claims).encode()
    document = b'{"version":3,"sha256":"%s","claims":%s}' % (hashlib.sha256(body).hexdigest().encode(), body)
    (tmp_path / "checkpoint.json").write_bytes(document)
    (prepared,) = checkpoint.load(tmp_path / "checkpoint.json")
    assert prepared.devices[0].rounded_off_bytes == 0


def version_2(claims: object) -> bytes:
    """A checkpoint as the agent before version 3 wrote it: each device's kind a flag, `whole`."""
    body = json.dumps(claims).encode()
    return b'{"version":2,"sha256":"%s","claims":%s}' % (hashlib.sha256(body).hexdigest().encode(), body)


def test_a_version_2_checkpoint_reads_each_devices_whole_flag_as_its_kind(tmp_path: Path) -> None:
    """The agent before version 3 wrote `whole` (true for full); its claims stay prepared across the upgrade, each
    device the kind it was, and the next save writes version 3."""
    claims = msgspec.to_builtins(CLAIMS)
    for claim in claims:
        device = claim["devices"][0]
        device["whole"] = device.pop("kind") == "full"
    path = tmp_path / "checkpoint.json"
    path.write_bytes(version_2(claims))
    assert [claim["devices"][0]["whole"] for claim in claims] == [False, True]
    assert checkpoint.load(path) == CLAIMS
    checkpoint.save(path, checkpoint.load(path))
    assert json.loads(path.read_bytes())["version"] == 3


@pytest.mark.parametrize(
    ("device", "problem"),
    [
        ({}, "Object missing required field `whole` - at `$[0].devices[0]`"),
        ({"whole": "yes"}, "Expected `bool`, got `str` - at `$[0].devices[0].whole`"),
    ],
)
def test_a_version_2_device_without_a_true_or_false_whole_is_refused_naming_it(
    tmp_path: Path, device: dict[str, Any], problem: str
) -> None:
    claims = msgspec.to_builtins(CLAIMS[:1])
    del claims[0]["devices"][0]["kind"]
    claims[0]["devices"][0].update(device)
    path = tmp_path / "checkpoint.json"
    path.write_bytes(version_2(claims))
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == f"the DRA checkpoint {path} is not a valid checkpoint ({problem}): {WAY_OUT}"


def test_a_kind_this_agent_does_not_know_is_refused_naming_it(tmp_path: Path) -> None:
    """A newer agent's kind is never read as one this agent knows."""
    claims = msgspec.to_builtins(CLAIMS[:1])
    claims[0]["devices"][0]["kind"] = "a-later-kind"
    body = json.dumps(claims).encode()
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b'{"version":3,"sha256":"%s","claims":%s}' % (hashlib.sha256(body).hexdigest().encode(), body))
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == (
        f"the DRA checkpoint {path} is not a valid checkpoint (Invalid enum value 'a-later-kind' - at "
        f"`$[0].devices[0].kind`): {WAY_OUT}"
    )


def test_a_missing_file_holds_no_claims(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path / "checkpoint.json") == ()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"version": 2, "claims": [', "is not a checkpoint (Input data was truncated)"),
        (b"[]", "is not a checkpoint (Expected `object`, got `array`)"),
        (b'{"claims": []}', "is not a checkpoint (Object missing required field `version`)"),
        (b'{"version": 4, "claims": []}', "has version 4; this agent reads versions 2 and 3"),
        (b'{"version": 2, "claims": []}', "is not a valid checkpoint (Object missing required field `sha256`)"),
        (b'{"version": 2, "sha256": "", "claims": [], "extra": 1}', "is not a valid checkpoint (Object contains"),
    ],
)
def test_a_corrupt_file_is_an_error_naming_it_and_the_way_out(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(content)
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    message = str(caught.value)
    assert message.startswith(f"the DRA checkpoint {path} {problem}")
    assert message.endswith(f": {WAY_OUT}")


def test_an_oversized_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    with path.open("wb") as file:
        file.truncate(checkpoint.MAX_BYTES + 1)
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == f"the DRA checkpoint {path} is larger than 4 MiB: {WAY_OUT}"


def test_a_fifo_in_its_place_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    os.mkfifo(path)
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == f"the DRA checkpoint {path} is a FIFO, not a regular file: {WAY_OUT}"
    with pytest.raises(HostError, match=f"cannot write the DRA checkpoint {path}: it is a FIFO, not a regular file"):
        checkpoint.save(path, CLAIMS)


def test_a_file_that_cannot_be_saved_is_a_host_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "checkpoint.json"
    with pytest.raises(HostError, match=f"cannot write the DRA checkpoint {path}: No such file or directory"):
        checkpoint.save(path, CLAIMS)


def test_a_checkpoint_without_a_checksum_is_refused_whatever_its_version(tmp_path: Path) -> None:
    """Version 1 (an older agent's, or one written by hand) has no checksum: what it holds cannot be told from what
    someone changed since, so it is refused as a changed file is, never trusted."""
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps({"version": 1, "claims": msgspec.to_builtins(CLAIMS)}))
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == (
        f"the DRA checkpoint {path} has version 1, which has no checksum (written by an older agent, or by hand), "
        f"so what it holds cannot be trusted: {WAY_OUT}"
    )


@pytest.mark.parametrize(
    ("mode", "owner", "shown_mode"),
    [
        pytest.param(0o666, None, "-rw-rw-rw-", id="world-writable"),
        pytest.param(0o620, None, "-rw--w----", id="group-writable"),
        pytest.param(0o600, 65534, "-rw-------", id="another-user"),
    ],
)
def test_a_checkpoint_someone_else_could_write_is_refused_naming_its_owner_and_mode(
    tmp_path: Path, mode: int, owner: int | None, shown_mode: str
) -> None:
    """Anyone who can write the file can write a checksum that matches: only the agent's user's own file, written
    by no one else, is trusted."""
    path = tmp_path / "checkpoint.json"
    checkpoint.save(path, CLAIMS)
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner, owner)
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == (
        f"the DRA checkpoint {path} is owned by UID {owner if owner is not None else os.geteuid()} with mode "
        f"{shown_mode}, and the agent trusts only what its own user (UID {os.geteuid()}) owns and no one else can "
        f"write: {WAY_OUT}"
    )


def test_a_file_changed_since_the_agent_wrote_it_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    checkpoint.save(path, CLAIMS)
    path.write_bytes(path.read_bytes().replace(b'"memory_mib":8192', b'"memory_mib":8193'))
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == (
        f"the DRA checkpoint {path} does not match its checksum (sha256): it was changed or damaged after the agent "
        f"wrote it: {WAY_OUT}"
    )


def test_a_link_in_its_place_is_refused_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    checkpoint.save(target, CLAIMS)
    path = tmp_path / "checkpoint.json"
    path.symlink_to(target)
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == f"the DRA checkpoint {path} is a symbolic link, not a regular file: {WAY_OUT}"


def device_edit(**changes: Any) -> Callable[[PreparedClaim], PreparedClaim]:
    def edit(claim: PreparedClaim) -> PreparedClaim:
        return msgspec.structs.replace(claim, devices=(msgspec.structs.replace(claim.devices[0], **changes),))

    return edit


def claim_edit(**changes: str) -> Callable[[PreparedClaim], PreparedClaim]:
    def edit(claim: PreparedClaim) -> PreparedClaim:
        return msgspec.structs.replace(claim, claim=msgspec.structs.replace(claim.claim, **changes))

    return edit


@pytest.mark.parametrize(
    ("edit", "rule"),
    [
        pytest.param(
            claim_edit(uid="../../etc"),
            "has claim UID `../../etc`, which is not a Kubernetes UID (at most 64 characters of 0-9, a-f and '-', "
            "from a digit or letter)",
            id="uid-form",
        ),
        pytest.param(
            claim_edit(uid="a" * 65),
            f"has claim UID `{'a' * 65}`, which is not a Kubernetes UID (at most 64 characters",
            id="uid-length",
        ),
        pytest.param(claim_edit(namespace=""), "has an empty namespace", id="no-namespace"),
        pytest.param(claim_edit(name=""), "has an empty name", id="no-name"),
        pytest.param(
            device_edit(memory_mib=-200000),
            "device 0 (gpu-0) has memory_mib -200000; it must be at least 1",
            id="negative-memory",
        ),
        pytest.param(
            device_edit(memory_mib=0), "device 0 (gpu-0) has memory_mib 0; it must be at least 1", id="no-mib"
        ),
        pytest.param(
            device_edit(thread_percentage=1000),
            "device 0 (gpu-0) has thread_percentage 1000; it must be 1 to 100",
            id="threads-over",
        ),
        pytest.param(
            device_edit(thread_percentage=0), "device 0 (gpu-0) has thread_percentage 0; it must be 1 to 100", id="none"
        ),
        pytest.param(
            device_edit(rounded_off_bytes=1 << 20),
            "device 0 (gpu-0) has rounded_off_bytes 1048576; it must be 0 to 1048575 (less than 1 MiB)",
            id="rounding-a-mib",
        ),
        pytest.param(
            device_edit(rounded_off_bytes=-1),
            "device 0 (gpu-0) has rounded_off_bytes -1; it must be 0 to 1048575 (less than 1 MiB)",
            id="rounding-negative",
        ),
        pytest.param(
            device_edit(compute=-5), "device 0 (gpu-0) has compute -5; it must be 0 to 100", id="compute-negative"
        ),
        pytest.param(
            device_edit(cdi_device_ids=()), "device 0 (gpu-0) has no CDI device ID (cdi_device_ids is empty)", id="cdi"
        ),
    ],
)
def test_an_entry_that_breaks_a_rule_is_refused_naming_the_file_the_entry_and_the_rule(
    tmp_path: Path, edit: Callable[[PreparedClaim], PreparedClaim], rule: str
) -> None:
    """Never trusted (a negative memory figure became a cap of 200000 MiB and threads 1000%), never dropped."""
    path = tmp_path / "checkpoint.json"
    broken = edit(CLAIMS[1])
    checkpoint.save(path, (CLAIMS[0], broken))
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value).startswith(f"the DRA checkpoint {path} entry 1 (claim {broken.claim}) {rule}")
    assert str(caught.value).endswith(f": {WAY_OUT}")
    with pytest.raises(checkpoint.EntryError) as entry:
        checkpoint.check_entry(1, broken)
    assert str(entry.value).startswith(f"entry 1 (claim {broken.claim}) {rule}")


def test_a_claim_listed_twice_is_refused_naming_both_entries(tmp_path: Path) -> None:
    """Two entries of one UID would hold its share twice, and its unprepare release one: a grant leaked."""
    path = tmp_path / "checkpoint.json"
    again = msgspec.structs.replace(CLAIMS[0], claim=msgspec.structs.replace(CLAIMS[0].claim, name="again"))
    checkpoint.save(path, (CLAIMS[0], CLAIMS[1], again))
    with pytest.raises(HostError) as caught:
        checkpoint.load(path)
    assert str(caught.value) == (
        f"the DRA checkpoint {path} entry 2 (claim team-a/again) has claim UID {CLAIMS[0].claim.uid}, as entry 0 "
        f"(claim team-a/small) has: a claim is prepared once: {WAY_OUT}"
    )


def test_the_entries_the_agent_writes_pass_the_check() -> None:
    for index, claim in enumerate(CLAIMS):
        checkpoint.check_entry(index, claim)
