"""Reading and writing the agent's files on a host where someone may have put a FIFO, a device, a link or a huge
file in their place."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mpsagent.base.host import (
    FileRefusedError,
    FileTooLargeError,
    open_private_file,
    read_regular_file,
    write_atomically,
)


def test_a_link_planted_as_the_temporary_file_is_replaced_not_followed(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    target = tmp_path / "status.json"
    (tmp_path / f".status.json.{os.getpid()}.tmp").symlink_to(precious)
    write_atomically(target, b"new\n", 0o600, what="the status file")
    assert precious.read_text() == "keep me\n"
    assert not target.is_symlink() and target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious", "status.json"]


@pytest.mark.parametrize(
    ("plant", "kind"),
    [
        (os.mkfifo, "a FIFO"),
        (lambda path: path.symlink_to("/dev/null"), "a symbolic link"),
        (os.mkdir, "a directory"),
    ],
)
def test_only_a_regular_file_is_replaced(tmp_path: Path, plant: object, kind: str) -> None:
    target = tmp_path / "mpsagent"
    plant(target)  # type: ignore[operator]
    with pytest.raises(FileRefusedError) as refused:
        write_atomically(target, b"a=1\n", 0o644, what="the node-feature-discovery file")
    assert str(refused.value) == f"the node-feature-discovery file {target} is {kind}, not a regular file"
    assert not stat.S_ISREG(target.lstat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["mpsagent"]


def test_a_regular_file_is_read_whole_up_to_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"x" * 100)
    assert read_regular_file(path, max_bytes=100, what="the config file") == b"x" * 100
    with pytest.raises(FileTooLargeError, match=f"^the config file {path} is larger than 99 bytes$"):
        read_regular_file(path, max_bytes=99, what="the config file")


@pytest.mark.parametrize(
    ("plant", "follow", "kind"),
    [
        (os.mkfifo, True, "a FIFO"),  # opening it would block until a writer came
        (lambda path: path.symlink_to("/dev/zero"), True, "a character device"),  # never ends
        (lambda path: path.symlink_to("/dev/zero"), False, "a symbolic link"),
    ],
)
def test_what_is_not_a_regular_file_is_refused_unread(tmp_path: Path, plant: object, follow: bool, kind: str) -> None:
    path = tmp_path / "file"
    plant(path)  # type: ignore[operator]
    with pytest.raises(FileRefusedError) as refused:
        read_regular_file(path, max_bytes=1 << 20, what="the file", follow_symlinks=follow)
    assert str(refused.value) == f"the file {path} is {kind}, not a regular file"


def test_a_link_to_a_regular_file_is_read_when_links_are_followed(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"data")
    (tmp_path / "link").symlink_to(tmp_path / "real")  # as a ConfigMap mounts its keys
    assert read_regular_file(tmp_path / "link", max_bytes=10, what="the config file") == b"data"


def test_a_private_file_is_never_another_files_name(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    (tmp_path / "linked").symlink_to(precious)
    os.link(precious, tmp_path / "hard")
    with pytest.raises(FileRefusedError, match=r"is a symbolic link, not a regular file$"):
        open_private_file(tmp_path / "linked", os.O_WRONLY | os.O_CREAT, 0o600, what="the agent lock")
    with pytest.raises(FileRefusedError, match=r"has 2 hard links: it may be another file$"):
        open_private_file(tmp_path / "hard", os.O_WRONLY | os.O_CREAT, 0o600, what="the agent lock")
    assert precious.read_text() == "keep me\n"
    fd = open_private_file(tmp_path / "new", os.O_WRONLY | os.O_CREAT, 0o600, what="the agent lock")
    os.close(fd)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_private_file_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "control.log"
    theirs.write_text("")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(FileRefusedError, match=f"^the daemon log {theirs} is owned by uid 65534, not by the agent$"):
        open_private_file(theirs, os.O_WRONLY | os.O_APPEND, 0o600, what="the daemon log")
