"""The CDI spec files of prepared claims: their content and names, replaced whole, removed idempotently, listed,
and never named after a UID that could leave the directory."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from mpsagent.base.errors import HostError, RequestError
from mpsagent.domain.container import Mount
from mpsagent.dra.cdi import cdi_device_id, claim_spec_uids, remove_claim_spec, write_claim_spec
from mpsagent.kubelet.cdi_spec import CdiDevice

UID = "0b3c6a5e-7f1d-4c2b-9a8e-1d2f3a4b5c6d"
OTHER_UID = "ffffffff-0000-4000-8000-000000000001"


def device(uid: str = UID, index: int = 0, memory: str = "8192M") -> CdiDevice:
    return CdiDevice(
        name=f"{uid}-gpu-{index}",
        envs={"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={memory}"},
        mounts=(
            Mount(container_path="/mps/nvidia.com/gpu/pipe", host_path="/run/mpsagent/gpu/pipe"),
            Mount(container_path="/dev/shm", host_path="/run/mpsagent/shm", read_only=True),
        ),
    )


def test_the_spec_holds_each_device_with_its_environment_and_mounts(tmp_path: Path) -> None:
    path = write_claim_spec(tmp_path / "cdi", UID, [device(index=0), device(index=1)])
    assert path == tmp_path / "cdi" / f"mpsagent.io-mps-share_{UID}.json"
    assert json.loads(path.read_bytes()) == {
        "cdiVersion": "0.6.0",
        "kind": "mpsagent.io/mps-share",
        "devices": [
            {
                "name": f"{UID}-gpu-{index}",
                "containerEdits": {
                    "env": [
                        "CUDA_MPS_PIPE_DIRECTORY=/mps/nvidia.com/gpu/pipe",
                        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
                    ],
                    "mounts": [
                        {
                            "hostPath": "/run/mpsagent/gpu/pipe",
                            "containerPath": "/mps/nvidia.com/gpu/pipe",
                            "options": ["rbind", "rw"],
                        },
                        {"hostPath": "/run/mpsagent/shm", "containerPath": "/dev/shm", "options": ["rbind", "ro"]},
                    ],
                },
            }
            for index in (0, 1)
        ],
    }


def test_the_device_id_is_the_vendor_class_and_the_name() -> None:
    assert cdi_device_id(f"{UID}-gpu-0") == f"mpsagent.io/mps-share={UID}-gpu-0"


def test_the_file_and_a_directory_it_creates_are_readable_by_the_runtime_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        path = write_claim_spec(tmp_path / "run" / "cdi", UID, [device()])
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755


def test_writing_again_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    write_claim_spec(tmp_path, UID, [device(memory="1024M")])
    inode = (tmp_path / f"mpsagent.io-mps-share_{UID}.json").stat().st_ino
    path = write_claim_spec(tmp_path, UID, [device(memory="2048M")])
    assert "0=2048M" in json.dumps(json.loads(path.read_bytes()))
    assert path.stat().st_ino != inode  # renamed into place, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_removal_is_idempotent(tmp_path: Path) -> None:
    path = write_claim_spec(tmp_path, UID, [device()])
    assert remove_claim_spec(tmp_path, UID) is True
    assert not path.exists()
    assert remove_claim_spec(tmp_path, UID) is False
    assert remove_claim_spec(tmp_path / "missing", UID) is False


def test_listing_names_only_our_specs(tmp_path: Path) -> None:
    assert claim_spec_uids(tmp_path / "missing") == set()
    write_claim_spec(tmp_path, UID, [device()])
    write_claim_spec(tmp_path, OTHER_UID, [device(OTHER_UID)])
    for stranger in (
        "nvidia.com-gpu_0b3c.json",  # another vendor's
        "mpsagent.io-mps-share_UPPER.json",
        f"mpsagent.io-mps-share_{UID}.yaml",
        f".mpsagent.io-mps-share_{UID}.json.123.tmp",  # a temporary file of a write cut short
        "mpsagent.io-mps-share_" + "a" * 65 + ".json",
    ):
        (tmp_path / stranger).write_text("{}")
    assert claim_spec_uids(tmp_path) == {UID, OTHER_UID}


@pytest.mark.parametrize(
    "uid",
    ["../../etc/passwd", "a/b", "..", "", "ABCDEF", "a" * 65, "0b3c\n", "-leading-dash", "0b3c.json"],
)
def test_a_uid_that_is_not_a_kubernetes_uid_names_no_file(tmp_path: Path, uid: str) -> None:
    with pytest.raises(RequestError, match=r"is not a Kubernetes UID \(at most 64 characters of 0-9, a-f and '-'"):
        write_claim_spec(tmp_path / "cdi", uid, [device()])
    with pytest.raises(RequestError, match="is not a Kubernetes UID"):
        remove_claim_spec(tmp_path / "cdi", uid)
    assert not (tmp_path / "cdi").exists()


@pytest.mark.parametrize("name", ["a/b", "gpu 0", "-gpu", "gpu-", ""])
def test_a_device_name_cdi_cannot_carry_is_refused(tmp_path: Path, name: str) -> None:
    bad = CdiDevice(name=name, envs={}, mounts=())
    with pytest.raises(RequestError, match=r"CDI device name `.*` is not valid"):
        write_claim_spec(tmp_path, UID, [bad])
    assert list(tmp_path.iterdir()) == []


def test_a_directory_in_the_files_place_is_a_host_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / f"mpsagent.io-mps-share_{UID}.json"
    path.mkdir()
    with pytest.raises(HostError) as caught:
        write_claim_spec(tmp_path, UID, [device()])
    assert str(caught.value) == f"cannot write the CDI spec {path}: it is a directory, not a regular file"


def test_a_directory_or_a_link_named_like_a_spec_is_skipped_with_one_warning_each(tmp_path: Path) -> None:
    """The agent lists its specs at start to remove stale ones: what is not one of its regular files is skipped
    (left alone, one warning naming it), never removed through a link and never a reason to stop."""
    write_claim_spec(tmp_path, UID, [device()])
    directory = tmp_path / f"mpsagent.io-mps-share_{OTHER_UID}.json"
    directory.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    link_uid = "ffffffff-0000-4000-8000-000000000002"
    link = tmp_path / f"mpsagent.io-mps-share_{link_uid}.json"
    link.symlink_to(target)
    odd = tmp_path / "mpsagent.io-mps-share_UPPER.json"
    odd.write_text("{}")
    (tmp_path / "nvidia.com-gpu_0b3c.json").write_text("{}")  # another vendor's: not the agent's to judge
    with capture_logs() as logs:
        assert claim_spec_uids(tmp_path) == {UID}
    skipped = sorted((entry["path"], entry["reason"]) for entry in logs)
    assert [entry["event"] for entry in logs] == ["cdi directory entry skipped"] * 3
    assert [entry["log_level"] for entry in logs] == ["warning"] * 3
    assert skipped == sorted(
        [
            (str(directory), "it is a directory, not a regular file"),
            (str(link), "it is a symbolic link, which the agent does not follow"),
            (str(odd), "its name is not a spec file name of the agent (mpsagent.io-mps-share_<claim UID>.json)"),
        ]
    )
    assert directory.is_dir()
    assert link.is_symlink()
    assert target.read_text() == "{}"


@pytest.mark.parametrize("kind", ["directory", "link"])
def test_removing_a_spec_that_is_not_a_regular_file_leaves_it_with_a_warning(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"mpsagent.io-mps-share_{UID}.json"
    target = tmp_path / "target"
    target.mkdir()
    (target / "kept").write_text("kept")
    if kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(target)
    with capture_logs() as logs:
        assert remove_claim_spec(tmp_path, UID) is False
    assert [(entry["event"], entry["path"]) for entry in logs] == [("cdi spec not removed", str(path))]
    assert os.path.lexists(path)
    assert (target / "kept").read_text() == "kept"
