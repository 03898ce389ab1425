"""A grant's kind, the one word for it on both routes, and the one wording of a share (`describe_share`), which
the logs, `--status` and `--once` use."""

from __future__ import annotations

import enum
from typing import Protocol, assert_never

from mpsagent.base.words import counted


class GrantKind(enum.StrEnum):
    """Full: whole GPUs, no cap variables. Capped: anything less. The one word for this fact on both routes, stored
    as itself: the ledger's grants, a claim's devices (the checkpoint), the metrics' `kind` label, the status file
    and the `--once` report. Code that does one thing or another by kind matches every kind (`assert_never`), so a
    new kind is a type error wherever it needs a decision."""

    FULL = "full"
    CAPPED = "capped"


class ClaimShareFigures(Protocol):
    """What a prepared claim's device says of its share, wherever it is kept (the checkpoint, the status file)."""

    @property
    def kind(self) -> GrantKind: ...

    @property
    def memory_mib(self) -> int: ...

    @property
    def thread_percentage(self) -> int: ...

    @property
    def rounded_off_bytes(self) -> int: ...


def describe_share(kind: GrantKind, *, held: str, thread_percentage: int, rounded_off_bytes: int = 0) -> str:
    """A share in words: what it holds (`held`: `1/4 of GPU 0` of a resource's IDs, `8192 MiB` of a claim's
    device), then `(whole)` for a full share, or for a capped one its thread cap (after the allocation's rounding to
    whole MiB, which MPS limits are, when there was any)."""
    match kind:
        case GrantKind.FULL:
            return f"{held} (whole)"
        case GrantKind.CAPPED:
            rounded = (
                f" (the allocation rounded down to whole MiB: {counted(rounded_off_bytes, 'byte')} left out)"
                if rounded_off_bytes
                else ""
            )
            return f"{held}{rounded}, threads {thread_percentage}%"
        case _:
            assert_never(kind)


def describe_claim_share(device: ClaimShareFigures) -> str:
    """A prepared claim's device's share in words (`describe_share`): what it holds is its memory."""
    return describe_share(
        device.kind,
        held=f"{device.memory_mib} MiB",
        thread_percentage=device.thread_percentage,
        rounded_off_bytes=device.rounded_off_bytes,
    )
