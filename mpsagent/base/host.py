"""What several parts of the agent ask of the host in the same way: whether a process lives, reading a file that
must be a small regular file (and, for what the agent trusts, its own user's alone to write), opening a private file
never through a link, replacing a file so that no reader ever
sees it half-written, and a lock file that names its holder."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mpsagent.base.errors import FileReadError, FileRefusedError, FileTooLargeError
from mpsagent.base.values import MIB

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def size_text(size: int) -> str:
    """A byte count as a message says it: `64 MiB`, or `1000 bytes`."""
    return f"{size // MIB} MiB" if size % MIB == 0 else f"{size} bytes"


def file_kind(mode: int) -> str:
    """What a file is, as a message says it: `a FIFO`, `a symbolic link`, ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def ownership_problem(status: os.stat_result) -> str | None:
    """Why a file or directory whose content the agent trusts may hold what someone else put there: another user
    owns it, or others (its group, anyone) can write it; None when it is the agent's own user's alone to write."""
    if status.st_uid == os.geteuid() and not status.st_mode & _WRITABLE_BY_OTHERS:
        return None
    return (
        f"is owned by UID {status.st_uid} with mode {stat.filemode(status.st_mode)}, and the agent trusts only what "
        f"its own user (UID {os.geteuid()}) owns and no one else can write"
    )


def _check_regular(path: Path, status: os.stat_result, *, max_bytes: int, what: str, own: bool) -> None:
    if not stat.S_ISREG(status.st_mode):
        raise FileRefusedError(path, what, f"is {file_kind(status.st_mode)}, not a regular file")
    problem = ownership_problem(status) if own else None
    if problem is not None:
        raise FileRefusedError(path, what, problem)
    if status.st_size > max_bytes:
        raise FileTooLargeError(path, what, f"is larger than {size_text(max_bytes)}")


def read_regular_file(
    path: Path, *, max_bytes: int, what: str, follow_symlinks: bool = True, own: bool = False
) -> bytes:
    """The content of `path`, which must be a regular file of at most `max_bytes` (`what` names it in errors:
    "the agent status"); with `own`, also the agent's own user's alone to write (`ownership_problem`), for a file
    whose content the agent trusts. Raises FileRefusedError, or OSError (FileNotFoundError, ...) as the system says.

    Checked before it is opened (opening a FIFO blocks, opening a device may act on it), and again on the open
    file (the path may have changed in between); the read stops at the bound whatever the file does meanwhile.
    """
    status = os.stat(path, follow_symlinks=follow_symlinks)
    _check_regular(path, status, max_bytes=max_bytes, what=what, own=own)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise FileRefusedError(path, what, "is a symbolic link, not a regular file") from None
        raise
    with os.fdopen(fd, "rb") as file:
        _check_regular(path, os.fstat(fd), max_bytes=max_bytes, what=what, own=own)
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLargeError(path, what, f"is larger than {size_text(max_bytes)}")
    return data


def read_input_file(path: Path, *, max_bytes: int, what: str) -> bytes:
    """A file the operator named (`what`: the flag, e.g. `--config-file`), read as `read_regular_file` does with
    links followed (ConfigMaps are links); every failure is a FileReadError naming the flag, the path and why."""
    try:
        return read_regular_file(path, max_bytes=max_bytes, what=what)
    except FileRefusedError as exc:
        hint = "" if isinstance(exc, FileTooLargeError) else "; give a regular file (or a link to one)"
        raise FileReadError(path, what, exc.problem + hint) from exc
    except FileNotFoundError as exc:
        raise FileReadError(path, what, "no such file") from exc
    except OSError as exc:
        raise FileReadError(path, what, f"cannot read it ({exc.strerror})") from exc


def _private_file_problem(status: os.stat_result) -> str | None:
    if not stat.S_ISREG(status.st_mode):
        return f"is {file_kind(status.st_mode)}, not a regular file"
    if status.st_uid != os.geteuid():
        return f"is owned by uid {status.st_uid}, not by the agent"
    if status.st_nlink > 1:
        return f"has {status.st_nlink} hard links: it may be another file"
    return None


def open_private_file(path: Path, flags: int, mode: int, *, what: str) -> int:
    """A descriptor of the agent's own file at `path` (created with `mode` when `flags` has O_CREAT): never
    through a link, never a FIFO or device, never a file of another user or one hard-linked elsewhere.

    Raises FileRefusedError naming `what` and the path, or OSError as the system says.
    """
    with contextlib.suppress(FileNotFoundError):
        existing = os.lstat(path)
        if not stat.S_ISREG(existing.st_mode):  # checked first: opening a FIFO would block
            raise FileRefusedError(path, what, f"is {file_kind(existing.st_mode)}, not a regular file")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileRefusedError(path, what, "is a symbolic link, not a regular file") from None
        raise
    problem = _private_file_problem(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise FileRefusedError(path, what, problem)
    os.set_blocking(fd, True)
    return fd


def os_reason(exc: OSError) -> str:
    """What went wrong, for a log line that names the path itself: "No space left on device"."""
    return exc.strerror or str(exc)


PID_MAX_LIMIT = 4_194_304
"""The largest PID a 64-bit Linux kernel gives (the ceiling of /proc/sys/kernel/pid_max)."""


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """A file's identity, to tell a socket re-created at the same path from the one seen before. The inode number
    alone is not one: ext4 hands a freed number out again at once, so a new socket often has its old socket's
    number; the change time is set when a file is created."""

    device: int
    inode: int
    changed_ns: int


def file_identity(path: Path, *, follow_symlinks: bool = True) -> FileIdentity | None:
    """The identity of what is at `path` now; None when nothing is (or it cannot be looked at)."""
    try:
        status = path.stat(follow_symlinks=follow_symlinks)
    except OSError:
        return None
    return FileIdentity(status.st_dev, status.st_ino, status.st_ctime_ns)


def node_name(configured: str | None) -> str:
    """The node's name in the API server: the one configured (--node-name), else the host name in lower case, as
    the kubelet names its node when not told otherwise."""
    return configured or os.uname().nodename.lower()


def valid_pid(pid: int) -> bool:
    """Whether `pid` can name a process the agent watches: above 1 (kill(-1) reaches every process, kill(0) the
    caller's group, PID 1 is init) and within the kernel's range."""
    return 1 < pid <= PID_MAX_LIMIT


def pid_alive(pid: int) -> bool:
    """True while a process with this PID exists (one of another user counts); False for a PID no process of
    the agent's can have (`valid_pid`)."""
    if not valid_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_started(pid: int, proc_root: Path = Path("/proc")) -> float | None:
    """When (wall clock, to about a second) the process with this PID started; None when it cannot be read."""
    try:
        stat_line = (proc_root / str(pid) / "stat").read_text()
        ticks = int(stat_line[stat_line.rindex(")") + 1 :].split()[19])  # starttime, after the command name
        boot = next(line for line in (proc_root / "stat").read_text().splitlines() if line.startswith("btime "))
        return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _create_exclusively(path: Path, mode: int) -> int:
    """A new file at `path`, never one that was there (a temporary left by a crash, or a link planted to make
    the agent write elsewhere): what is in the way is removed (the entry, not what a link points to) once."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, mode)
    except FileExistsError:
        path.unlink()
        return os.open(path, flags, mode)


def write_atomically(path: Path, data: bytes, mode: int, *, what: str, durable: bool = False) -> None:
    """Replace `path` with `data`, with exactly `mode` whatever the umask; `durable` also survives a power cut.

    Only a regular file is replaced: anything else at `path` (a FIFO, a directory, a link) raises
    FileRefusedError, named with `what`. The temporary file sits beside the target under a name starting with a
    dot, so that a reader listing the directory (node-feature-discovery does) never takes it for the real one.
    Raises OSError; leaves no temporary file behind when it does.
    """
    with _replacing(path, mode, what=what, durable=durable) as fd:
        left = memoryview(data)
        while left:
            left = left[os.write(fd, left) :]


def copy_atomically(path: Path, source: int, start: int, end: int, mode: int, *, what: str) -> None:
    """Replace `path` with the bytes from `start` to `end` of the file open as `source`, as `write_atomically` does;
    copied by the kernel, never whole in the agent's memory."""
    with _replacing(path, mode, what=what, durable=False) as fd:
        offset = start
        while offset < end:
            sent = os.sendfile(fd, source, offset, end - offset)
            if sent == 0:
                break  # the source is shorter now: what it holds is copied
            offset += sent


@contextlib.contextmanager
def _replacing(path: Path, mode: int, *, what: str, durable: bool) -> Iterator[int]:
    """A new private file beside `path` to write, which replaces `path` once the block ends (see write_atomically)."""
    with contextlib.suppress(FileNotFoundError):
        existing = os.lstat(path)
        if not stat.S_ISREG(existing.st_mode):
            raise FileRefusedError(path, what, f"is {file_kind(existing.st_mode)}, not a regular file")
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = _create_exclusively(temporary, mode)
    try:
        try:
            os.fchmod(fd, mode)
            yield fd
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise


class PidLock:
    """An exclusive flock on a file that holds its owner's PID, so that whoever finds it taken can name the holder.
    Held until released, or until the owner dies; the file stays (removing a lock file races with its next taker).
    The file is the agent's own regular file: never opened through a link, never another user's (`what` names it
    in refusals)."""

    def __init__(self, path: Path, *, what: str = "the lock file") -> None:
        self.path = path
        self._what = what
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; None when taken, else the PID the holder wrote ("unknown" when it wrote none). Raises
        FileRefusedError for a file that is not the agent's own regular file, OSError when it cannot be used."""
        fd = open_private_file(self.path, os.O_RDWR | os.O_CREAT, 0o600, what=self._what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            return holder if holder.isdigit() else "unknown"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None
