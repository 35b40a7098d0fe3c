"""Shared launch heuristics and tensor validation for every op.

Validation lives here (scalar arguments: fuseforge.checks) so that each op rejects bad input with the
same kind of message (naming the argument) before anything reaches a Triton kernel.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TRAINING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Largest row a single program keeps in registers/SRAM; wider rows are looped over.
MAX_FUSED_SIZE = 65536


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Triton chooses between compiling and interpreting a kernel when @triton.jit decorates it, i.e. when our
# op modules are imported: read once, so that launches (host-bound on small ops) skip an environment lookup.
_INTERPRETED_KERNELS = _interpret_env()


def is_interpreter() -> bool:
    """True when Triton runs our kernels on the CPU through its interpreter (decided at import)."""
    return _INTERPRETED_KERNELS


@functools.lru_cache(maxsize=1024)
def row_launch_config(n_cols: int, max_block: int = MAX_FUSED_SIZE) -> tuple[int, int]:
    """Block size and warp count for a kernel that reduces one row per program."""
    block = triton.next_power_of_2(max(int(n_cols), 1))
    block = min(block, max_block)
    if block >= 32768:
        warps = 32
    elif block >= 8192:
        warps = 16
    elif block >= 2048:
        warps = 8
    else:
        warps = 4
    return block, warps


@triton.jit
def upcast(x, FP64: tl.constexpr):
    """x in the kernel's math dtype: fp64 for exact gradchecks, fp32 otherwise (bf16 must be
    upcast right after the load, see NOTES)."""
    if FP64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


def num_programs_hint(device: torch.device) -> int:
    """Number of streaming multiprocessors (or a small constant on the CPU interpreter)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _sm_count(index: int) -> int:
    # Cached: every launch plans its grid with it, and launches are host-bound on small ops.
    return torch.cuda.get_device_properties(index).multi_processor_count


def may_overlap(t: torch.Tensor) -> bool:
    """True unless each element of `t` has a memory cell of its own (False for any dense or sliced
    layout; True for `expand`/broadcast views, stride 0): a kernel writing a result into `t`
    element by element would write such shared cells several times. Conservative: a layout that
    is not sorted-stride nested counts as overlapping."""
    span = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < span:
            return True
        span = stride * size
    return False


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Iterable[int] | None = None,
    min_ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = FLOAT_DTYPES,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming `name` unless `t` is a tensor of the expected rank/dtype."""
    # Runs on every launch of every op (host-bound at small sizes): the passing path builds nothing.
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        n = t.dim()
        if n != ndim if isinstance(ndim, int) else n not in tuple(ndim):
            allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = dtypes if isinstance(dtypes, tuple) else tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the tensors if they live on different devices."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; move them to one device")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    """Raise TypeError naming the tensors if their dtypes differ."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has dtype {first.dtype}")


def check_device_supported(name: str, t: torch.Tensor) -> None:
    """Triton kernels need a CUDA tensor, or any CPU tensor under TRITON_INTERPRET=1."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and is_interpreter() and _interpret_env():  # unset since import: refused too
        return
    hint = " (set TRITON_INTERPRET=1 to run on the CPU through Triton's interpreter)" if t.device.type == "cpu" else ""
    raise ValueError(f"{name} is on {t.device}; fuseforge kernels run on CUDA devices{hint}")


def check_target(target: object, expected_shape: torch.Size, what: str) -> torch.Tensor:
    """Class-index targets only: integer dtype, shape equal to the logits' leading dims."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.is_floating_point() or target.is_complex():
        raise TypeError(
            f"target must hold integer class indices (int64), got dtype {target.dtype}; "
            "probability (soft) targets are not supported"
        )
    if target.dtype == torch.bool:
        raise TypeError("target must hold integer class indices (int64), got dtype torch.bool")
    if target.shape != expected_shape:
        raise ValueError(f"target must have shape {tuple(expected_shape)} ({what}), got {tuple(target.shape)}")
    return target
