"""How messages, logs and `--status` say a count: `1 GPU`, `2 GPUs`, `0 bytes`."""

from __future__ import annotations


def counted(count: int, noun: str) -> str:
    """`count` and its noun, singular for exactly 1 (every noun counted so far makes its plural with an s)."""
    return f"{count} {noun if count == 1 else noun + 's'}"
