"""How messages, logs and `--status` say a count (`1 GPU`, `2 GPUs`, `0 bytes`) and a list (`a, b and c`)."""

from __future__ import annotations


def counted(count: int, noun: str) -> str:
    """`count` and its noun, singular for exactly 1 (every noun counted so far makes its plural with an s)."""
    return f"{count} {noun if count == 1 else noun + 's'}"


def listed(words: tuple[str, ...] | list[str]) -> str:
    """The words as a sentence lists them: `a`, `a and b`, `a, b and c`."""
    return " and ".join(filter(None, (", ".join(words[:-1]), *words[-1:])))
