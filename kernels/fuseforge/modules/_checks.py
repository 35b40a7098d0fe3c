"""Constructor argument checks shared by the modules (those the ops share too live in fuseforge.checks)."""

from __future__ import annotations


def check_size(name: str, value: object) -> int:
    """A layer size: a positive int (not a bool, not a float that would be truncated)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value
