"""The agent's exception tree; every module raises these, the entry point maps them to exit codes.

MpsAgentError                 base, never raised itself
├── UsageError                bad flag or environment variable (exit 2)
├── ConfigError               bad configuration file or plan (exit 2); carries the key path
├── FileReadError             a file to read is missing, not a regular file, too large or unreadable
├── DocumentError             a YAML/JSON text is malformed or too big to expand (aliases, nesting, numbers)
├── GpuDiscoveryError         NVML could not describe the GPUs (exit 1)
│   ├── GpuHealthError        NVML's event wait failed: the GPUs' health cannot be known
│   ├── MemoryLimitError      the driver did not set or give a container cgroup's memory limit on a GPU
│   └── SnapshotError         a node snapshot file is unreadable or malformed (exit 2)
├── RequestError              a kubelet request the agent refuses (gRPC INVALID_ARGUMENT); changes nothing
│   └── GrantRefusedError     a grant or a claim that does not fit its GPU beside the live shares of both routes
│                             (memory, SMs, MPS's client limit) or asks an unhealthy GPU; carries the kind and GPU
├── AgentLockedError          another agent already serves a resource (exit 1)
├── KubeApiError              a call to the Kubernetes API server failed: unreachable, timed out, or an HTTP error;
│   │                         carries the HTTP status (None when there was no answer)
│   └── ClaimRefusedError     a ResourceClaim the API server returned cannot be prepared: re-created since the
│                             kubelet asked, not allocated, or beyond the agent's bounds
├── HostError                 the node refuses what the agent needs: a directory it cannot create or trust, a file
│                             it cannot open, a socket it cannot serve (exit 1)
└── DaemonError               the MPS control daemon did not start, answer or hold a value (exit 1)
    ├── DaemonCommandError    one control command failed or timed out: the daemon's failure
    ├── ControlRunError       the agent could not run the control front-end at all: the agent's failure
    ├── DaemonBusyError       the daemon refused sessions while another one is open: busy, not hung
    ├── ControlSocketAccessError the agent cannot look into the daemon (no ptrace access): who holds its control
    │                         socket, and whether it is held or hung, cannot be told
    └── UnrecordedDaemonError a daemon answers on the pipe directory, but daemon.json names no live PID for it

OSError
└── FileRefusedError          a file the agent reads or writes is not a regular file, or is too large: an OSError,
    └── FileTooLargeError     so that whatever handles an unreadable file handles it too; readers that must say what
                              the file was for turn it into FileReadError (`host.read_input_file`)
"""

from __future__ import annotations

from pathlib import Path

MAX_SHOWN_CHARS = 80


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """An untrusted value as a message quotes it: at most `limit` characters, on one line, anything but printable
    ASCII escaped, so that a huge or hostile value can neither flood a log nor forge a line or text of its own."""
    text = str(value)
    short = text if len(text) <= limit else text[:limit] + "..."
    return short if short.isascii() and short.isprintable() else ascii(short)[1:-1]


class FileRefusedError(OSError):
    """A file the agent reads or writes is not a regular file (a FIFO blocks, a device never ends, a link may
    lead anywhere) or is larger than it accepts. An OSError, so that whatever handles an unreadable or unwritable
    file handles this one too; its message names the file (`what`, `path`) and what is wrong with it (`problem`)."""

    def __init__(self, path: Path, what: str, problem: str) -> None:
        super().__init__(f"{what} {path} {problem}")
        self.path = path
        self.what = what
        self.problem = problem


class FileTooLargeError(FileRefusedError):
    """A regular file larger than its reader accepts."""


class MpsAgentError(Exception):
    """Base of every error the agent raises on purpose."""


def agent_errors(group: BaseExceptionGroup[BaseException]) -> list[MpsAgentError]:
    """The MpsAgentErrors in a task group's exception group, however deeply nested, in order: what a supervisor
    turns into its one-line exit message."""
    found: list[MpsAgentError] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found += agent_errors(exc)
        elif isinstance(exc, MpsAgentError):
            found.append(exc)
    return found


class UsageError(MpsAgentError):
    """A flag or environment variable is wrong."""


class ConfigError(MpsAgentError):
    """The configuration is wrong; `path` names the offending key (e.g. `sharing.mps.resources[0].replicas`)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class FileReadError(MpsAgentError):
    """A file the agent must read is missing, not a regular file, too large, or unreadable.

    The caller says what the file is for (`what`, e.g. the flag that named it) and translates the error into its
    own kind (a config file's problem is a usage error, a status file's a runtime one)."""

    def __init__(self, path: Path, what: str, problem: str) -> None:
        self.path = path
        self.what = what
        self.problem = problem
        super().__init__(f"{what} {path}: {problem}")


class DocumentError(MpsAgentError):
    """A YAML or JSON text is not usable data: malformed, or expanding, nesting or counting beyond the bounds."""


class GpuDiscoveryError(MpsAgentError):
    """The GPUs of this node could not be discovered."""


class GpuHealthError(GpuDiscoveryError):
    """NVML's event wait failed: the GPUs' health cannot be known."""


class MemoryLimitError(GpuDiscoveryError):
    """The driver did not set or give a container cgroup's memory limit on a GPU; the message names both."""


class SnapshotError(GpuDiscoveryError):
    """A node snapshot file is unreadable or malformed (a user error: exit 2)."""


class RequestError(MpsAgentError):
    """A kubelet request is refused; the ledger is left exactly as it was."""


class GrantRefusedError(RequestError):
    """A grant or a claim refused by the node's accounting (`domain.accounting`): `kind` says why (clients, memory,
    compute, unhealthy), `gpu` which GPU; the message says it in words, with what happens next."""

    def __init__(self, message: str, *, kind: str, gpu: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.gpu = gpu


class AgentLockedError(MpsAgentError):
    """Another mpsagent process already serves the resource."""


class KubeApiError(MpsAgentError):
    """A call to the Kubernetes API server failed: no answer in time, no connection, or an HTTP error. `status` is
    the HTTP status (None when there was no answer), `message` what the server (or the client) said; the message
    starts with what the agent was doing ("reading ResourceClaim default/gpu")."""

    def __init__(self, doing: str, message: str, status: int | None = None) -> None:
        self.doing = doing
        self.message = message
        self.status = status
        suffix = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"{doing}: {message}{suffix}")


class ClaimRefusedError(KubeApiError):
    """A ResourceClaim the API server returned cannot be prepared: it is not the one the kubelet named (deleted and
    re-created: another UID), it is not allocated, or it holds more than the agent reads. Trying again with the
    same claim does not help."""

    def __init__(self, claim: str, problem: str) -> None:
        super().__init__(f"claim {claim}", problem)


class HostError(MpsAgentError):
    """The node's file system refuses what the agent needs, or offers something the agent must not use."""


class DaemonError(MpsAgentError):
    """The MPS control daemon is not usable."""


class DaemonCommandError(DaemonError):
    """A control command failed, timed out or read back a value other than the one set."""


class UnrecordedDaemonError(DaemonError):
    """A daemon answers on the resource's pipe directory, but `daemon.json` names no live PID for it: nobody can
    watch, adopt or stop it safely."""


class ControlRunError(DaemonError):
    """The agent could not run the control front-end (a missing binary, EMFILE, ENOMEM): this says nothing about
    the daemon, which must never be killed for it."""


class DaemonBusyError(DaemonError):
    """The daemon refused the agent's sessions for the bounded wait because another session is open (an
    administrator at the prompt, a root process in a client container): it lives and is busy, never to be killed
    for it. Nothing was sent."""


class ControlSocketAccessError(DaemonError):
    """The agent cannot look into the daemon's process (no ptrace access: CAP_SYS_PTRACE, the host's PID namespace):
    who holds its control socket, and whether a daemon that greets no connection is held or hung, cannot be told.
    The agent's limit, not the daemon's failure: it is reported, and never a reason to restart the daemon."""
