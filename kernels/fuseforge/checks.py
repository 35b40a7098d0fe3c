"""Scalar argument checks the ops, modules and apply_kernels share, with errors that name the argument.

Pure Python (no torch, no triton): the modules check their constructor arguments with them before any kernel
loads; the ops' tensor checks live with the ops (fuseforge.ops._shared.utils).
"""

from __future__ import annotations

from typing import Iterable


def check_positive(name: str, value: float) -> float:
    """Raise ValueError unless `value` is a finite number > 0."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return v


def check_int64(name: str, value: object) -> int:
    """Raise TypeError unless `value` is an int, ValueError unless it fits in int64: it is compared
    with int64 class indices on the device, and Triton cannot pass a larger Python int to a kernel."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must be an int in the int64 range [-2**63, 2**63 - 1], got {value}")
    return value


def check_reduction(reduction: str, allowed: Iterable[str] = ("mean", "sum", "none")) -> str:
    allowed = tuple(allowed)
    if reduction not in allowed:
        raise ValueError(f"reduction must be one of {allowed}, got {reduction!r}")
    return reduction
