"""The MPS control commands: the daemon's defaults and a running server's caps as command text with the
`get_` read-back that proves each held, the comparison of read-back values, and how a daemon is started.

Pure functions of the ceilings (`shares`) and the resource's plan: the daemon supervisor, the daemon host's keeper
and `--once` (`report`) all take their commands from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpsagent.base.errors import ConfigError
from mpsagent.base.values import MultiUser
from mpsagent.domain.plan import ResourcePlan
from mpsagent.domain.shares import Ceilings


@dataclass(frozen=True, kw_only=True, slots=True)
class ControlStep:
    """One control command, the `get_` command that reads its value back, and the reply that means it held;
    `server` is the running MPS server it is about, None for the daemon's defaults."""

    command: str
    read_back: str
    expected: str
    server: int | None = None


def memory_read_back(mib: int) -> str:
    """How the control daemon prints a pinned-memory limit: whole GiB (rounded down) from 1 GiB up, else MiB."""
    return f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"


def daemon_default_steps(ceilings: Ceilings) -> tuple[ControlStep, ...]:
    """The control commands that set the daemon's defaults (its hard ceilings), with read-backs."""
    percentage = ceilings.thread_percentage
    return (
        ControlStep(
            command=f"set_default_active_thread_percentage {percentage}",
            read_back="get_default_active_thread_percentage",
            expected=f"{percentage:.1f}",
        ),
        *(
            ControlStep(
                command=f"set_default_device_pinned_mem_limit {ordinal} {mib}M",
                read_back=f"get_default_device_pinned_mem_limit {ordinal}",
                expected=memory_read_back(mib),
            )
            for ordinal, mib in enumerate(ceilings.memory_mib)
        ),
    )


def daemon_default_commands(ceilings: Ceilings) -> tuple[str, ...]:
    return tuple(step.command for step in daemon_default_steps(ceilings))


def running_server_steps(ceilings: Ceilings, server_pid: int) -> tuple[ControlStep, ...]:
    """Bring an already-running MPS server to the ceilings (defaults only apply to servers started later)."""
    percentage = ceilings.thread_percentage
    return (
        ControlStep(
            command=f"set_active_thread_percentage {server_pid} {percentage}",
            read_back=f"get_active_thread_percentage {server_pid}",
            expected=f"{percentage:.1f}",
            server=server_pid,
        ),
        *(
            ControlStep(
                command=f"set_device_pinned_mem_limit {server_pid} {ordinal} {mib}M",
                read_back=f"get_device_pinned_mem_limit {server_pid} {ordinal}",
                expected=memory_read_back(mib),
                server=server_pid,
            )
            for ordinal, mib in enumerate(ceilings.memory_mib)
        ),
    )


def running_server_commands(ceilings: Ceilings, server_pid: int) -> tuple[str, ...]:
    return tuple(step.command for step in running_server_steps(ceilings, server_pid))


@dataclass(frozen=True, kw_only=True, slots=True)
class CapDifference:
    """A value the daemon holds other than the one its ceilings need: someone with the control socket (every
    client container has it) changed it behind the agent."""

    step: ControlStep
    found: str | None
    """What the read-back printed; None: nothing, which means no limit at all."""

    def describe(self) -> str:
        found = "nothing (no limit)" if self.found is None else self.found
        return f"`{self.step.read_back}` reads {found}, expected {self.step.expected}"


def cap_differences(
    defaults: Sequence[ControlStep],
    default_values: Sequence[str | None],
    servers: Sequence[Sequence[ControlStep]] = (),
    server_values: Sequence[str | None] = (),
) -> tuple[CapDifference, ...]:
    """Where the daemon's values differ from the steps' expected ones. `server_values` follows `servers`, flat.

    A default that reads nothing is a difference (the agent always sets every one). A server that answers none of
    its values is not ready (starting, or gone since it was listed): it is read again on the next round.
    """
    found = [
        CapDifference(step=step, found=value)
        for step, value in zip(defaults, default_values, strict=True)
        if value != step.expected
    ]
    values = iter(server_values)
    for steps in servers:
        read = [next(values) for _ in steps]
        if any(value is not None for value in read):
            found += [
                CapDifference(step=step, found=value)
                for step, value in zip(steps, read, strict=True)
                if value != step.expected
            ]
    return tuple(found)


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonLaunch:
    """How a control daemon is started: its command line, and what its environment adds to the inherited one."""

    argv: tuple[str, ...]
    env: dict[str, str]
    unset: tuple[str, ...] = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    """Inherited variables the daemon must not see: it must not be able to speak for the agent to systemd."""

    def environment(self, inherited: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in inherited.items() if k not in self.unset} | self.env


def multi_user_server(resource: ResourcePlan, offered: bool | None, control_bin: str) -> bool:
    """Whether the daemon runs one MPS server for every user (`-M`): without it, a client of another user than
    the running server's waits until every client of that server has left. `offered`: whether the binary's `-h`
    lists the option (None: it could not be asked; starting it will say why)."""
    if resource.multi_user is MultiUser.OFF:
        return False
    if resource.multi_user is MultiUser.ON and offered is False:
        raise ConfigError(
            "sharing.mps.multiUser",
            f"is true, but `{control_bin} -h` does not list --multiuser-server (driver 580's control binary has "
            "it, 535's does not); use auto (multi-user where offered) or false, or a control binary that offers it",
        )
    return resource.multi_user is MultiUser.ON or bool(offered)


def daemon_launch(resource: ResourcePlan, control_bin: str, *, multi_user: bool) -> DaemonLaunch:
    """How the resource's control daemon is started: in the foreground (so the agent sees it exit at once), for
    the resource's GPUs only, with one server for every user when `multi_user`."""
    return DaemonLaunch(
        argv=(control_bin, "-f", *(("-M",) if multi_user else ())),
        env={
            "CUDA_VISIBLE_DEVICES": resource.visible_devices,
            "CUDA_MPS_PIPE_DIRECTORY": str(resource.pipe_directory),
            "CUDA_MPS_LOG_DIRECTORY": str(resource.log_directory),
        },
    )
