"""The prepared claims' checkpoint: what is saved loads back the same, a missing file holds no claims, and a file
that cannot be trusted is an error naming the file and the way out, never an empty set."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mpsagent.base.errors import HostError
from mpsagent.domain.claims import ClaimRef, PreparedClaim, PreparedDevice
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
        whole=whole,
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
    assert json.loads(path.read_bytes())["version"] == 1
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it names pods
    checkpoint.save(path, ())
    assert checkpoint.load(path) == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]


def test_the_file_is_versioned_json() -> None:
    document = json.loads(checkpoint.encode(CLAIMS[:1]))
    assert document == {
        "version": 1,
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
                        "whole": False,
                        "rounded_off_bytes": 0,
                    }
                ],
                "pods": ["team-a/trainer-0"],
                "prepared_at": 1764633600.5,
            }
        ],
    }


def test_a_checkpoint_written_before_the_rounding_was_recorded_reads_as_none_rounded(tmp_path: Path) -> None:
    """An older agent's checkpoint has no `rounded_off_bytes`: its claims were whole MiB, or rounded unsaid."""
    document = json.loads(checkpoint.encode(CLAIMS[:1]))
    del document["claims"][0]["devices"][0]["rounded_off_bytes"]
    (tmp_path / "checkpoint.json").write_text(json.dumps(document))
    (prepared,) = checkpoint.load(tmp_path / "checkpoint.json")
    assert prepared.devices[0].rounded_off_bytes == 0


def test_a_missing_file_holds_no_claims(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path / "checkpoint.json") == ()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"version": 1, "claims": [', "is not a checkpoint (Input data was truncated)"),
        (b"[]", "is not a checkpoint (Expected `object`, got `array`)"),
        (b'{"claims": []}', "is not a checkpoint (Object missing required field `version`)"),
        (b'{"version": 2, "claims": []}', "has version 2; this agent reads version 1"),
        (b'{"version": 1, "claims": [{"claim": {}}]}', "is not a valid checkpoint (Object missing required field"),
        (b'{"version": 1, "claims": [], "extra": 1}', "is not a valid checkpoint (Object contains unknown field"),
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
