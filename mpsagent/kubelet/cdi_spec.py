"""Container Device Interface spec files, as both plugins write them for the container runtime: a spec of one kind
and its devices (each with its environment, mounts and hooks), serialized and replaced atomically. The DRA driver
writes a claim's spec (`dra.cdi`); both routes share the spec of the agent's memory-limit devices
(`memory_limit_devices`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from mpsagent.base.errors import FileRefusedError, HostError, RequestError, shown
from mpsagent.base.host import os_reason, write_atomically
from mpsagent.domain.container import Mount

CDI_VERSION = "0.6.0"
SPEC_MODE = 0o644
"""The container runtime reads the specs, possibly as another user."""
DIRECTORY_MODE = 0o755
MAX_DEVICE_NAME_CHARS = 1024
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
"""A CDI device name: letters, digits, `_`, `.`, `:` and `-`, from and to a letter or digit."""
CREATE_RUNTIME = "createRuntime"
"""The hook that runs once the container's namespaces and cgroups exist, before its process does (runc runs it on
the host, with the container's OCI state on its standard input)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hook:
    """A program the container runtime runs for a container given the device: its path on the host, its argv."""

    path: str
    args: tuple[str, ...]
    hook_name: str = CREATE_RUNTIME


@dataclass(frozen=True, kw_only=True, slots=True)
class CdiDevice:
    """One device of a spec: what a container given it gets."""

    name: str
    envs: Mapping[str, str]
    mounts: Sequence[Mount]
    hooks: Sequence[Hook] = ()


class _CdiMount(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    host_path: str
    container_path: str
    options: tuple[str, ...]


class _CdiHook(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    hook_name: str
    path: str
    args: tuple[str, ...]


class _ContainerEdits(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    env: tuple[str, ...] = ()
    mounts: tuple[_CdiMount, ...] = ()
    hooks: tuple[_CdiHook, ...] = ()


class _SpecDevice(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    name: str
    container_edits: _ContainerEdits


class _Spec(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    cdi_version: str
    kind: str
    devices: tuple[_SpecDevice, ...]


def _spec_device(device: CdiDevice) -> _SpecDevice:
    if len(device.name) > MAX_DEVICE_NAME_CHARS or _DEVICE_NAME.fullmatch(device.name) is None:
        raise RequestError(
            f"CDI device name `{shown(device.name)}` is not valid: letters, digits, '_', '.', ':' and '-', "
            f"from and to a letter or digit, at most {MAX_DEVICE_NAME_CHARS} characters"
        )
    mounts = tuple(
        _CdiMount(
            host_path=mount.host_path,
            container_path=mount.container_path,
            options=("rbind", "ro" if mount.read_only else "rw"),
        )
        for mount in device.mounts
    )
    envs = tuple(f"{key}={value}" for key, value in device.envs.items())
    hooks = tuple(_CdiHook(hook_name=hook.hook_name, path=hook.path, args=hook.args) for hook in device.hooks)
    return _SpecDevice(name=device.name, container_edits=_ContainerEdits(env=envs, mounts=mounts, hooks=hooks))


def spec_json(kind: str, devices: Sequence[CdiDevice]) -> bytes:
    """The spec file's content for these devices of `kind`. Raises RequestError for a device name CDI cannot carry."""
    spec = _Spec(cdi_version=CDI_VERSION, kind=kind, devices=tuple(_spec_device(d) for d in devices))
    return msgspec.json.format(msgspec.json.encode(spec), indent=2) + b"\n"


def _make_directory(directory: Path) -> None:
    try:
        directory.mkdir(mode=DIRECTORY_MODE)
    except FileExistsError:
        return
    except FileNotFoundError:
        directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    os.chmod(directory, DIRECTORY_MODE)  # whatever the umask: the container runtime reads it


def write_spec(path: Path, kind: str, devices: Sequence[CdiDevice], *, what: str = "the CDI spec") -> None:
    """Write (or replace) the spec at `path`, its directory created when missing; readers see the old file or the
    new one, never part of one. Raises RequestError for a device name CDI cannot carry, HostError when the file
    cannot be written."""
    data = spec_json(kind, devices)
    try:
        _make_directory(path.parent)
        write_atomically(path, data, SPEC_MODE, what=what)
    except FileRefusedError as exc:
        raise HostError(f"cannot write {what} {path}: it {exc.problem}") from exc
    except OSError as exc:
        raise HostError(f"cannot write {what} {path}: {os_reason(exc)}") from exc
