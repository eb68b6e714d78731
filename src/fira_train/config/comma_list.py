"""Comma-separated flag values (``--methods fira,adamw``, ``--ranks 4,16``, ``--lrs 1e-3,3e-3``).

One rule for every such flag: at least one entry, none empty (``fira,,adamw`` may have lost a
method), none twice (a repeated rank would be dropped, a repeated method would clash), each
refusal a ``ValueError`` naming the flag and the value given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["comma_list", "distinct"]

T = TypeVar("T")


def comma_list(text: str, flag: str) -> list[str]:
    """The stripped entries of ``text``, refused as the module says."""
    if not text.strip():
        raise ValueError(f"{flag} must list at least one entry, got {text!r}")
    entries = [entry.strip() for entry in text.split(",")]
    if not all(entries):
        raise ValueError(f"{flag} {text!r} has an empty entry (two commas, or one at an end)")
    return distinct(entries, text, flag)


def distinct(values: Sequence[T], text: str, flag: str) -> list[T]:
    """``values`` as a list, refused if two are equal (as numbers, after parsing: ``4,04``)."""
    repeated: list[Any] = [v for i, v in enumerate(values) if v in values[:i]]
    if repeated:
        raise ValueError(f"{flag} gives {repeated[0]!r} twice, in {text!r}")
    return list(values)
