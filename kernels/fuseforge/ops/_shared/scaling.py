"""In-place scaling of gradients by the upstream gradient, decided on the device.

Why: a loss whose gradients are computed in forward (fused_linear_cross_entropy with a
scalar loss, which never keeps its logits for backward) must multiply them by grad_output in
backward. Reading grad_output on the host to skip the usual factor of 1 is a host sync, which
stalls the GPU until the whole forward has run; multiplying unconditionally is a
read-modify-write of every gradient. Here each program reads the factor and returns at once when it is 1, so the
common `loss.backward()` costs one small launch and no sync (and CUDA graphs can capture it).
"""

from __future__ import annotations

from typing import Iterable

import torch
import triton
import triton.language as tl

from fuseforge.ops._shared.rowwise import round_to
from fuseforge.ops._shared.utils import is_interpreter, num_programs_hint

_BLOCK = 4096
_GPU_PROGRAMS_PER_SM = 8


@triton.jit
def _scale_unless_one_kernel(x_ptr, n, tiles_per_program, factor_ptr, EMULATE_RNE: tl.constexpr, BLOCK: tl.constexpr):
    """x *= factor (math in fp32, one rounding to x's dtype), unless factor is exactly 1."""
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        first = tl.program_id(0).to(tl.int64) * tiles_per_program * BLOCK
        for t in range(tiles_per_program):
            offs = first + t * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(x_ptr + offs, round_to(x * factor, x_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


def scale_unless_one(tensors: Iterable[torch.Tensor | None], factor: torch.Tensor) -> None:
    """Multiply each tensor in place by the 1-element tensor `factor`, skipped on the device when it is 1."""
    factor = factor.reshape(1)
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        if not t.is_contiguous() or t.device != factor.device or t.dtype == torch.float64:
            t.mul_(factor.to(t.dtype))  # layouts the flat kernel does not cover: a plain multiply
            continue
        n_tiles = triton.cdiv(t.numel(), _BLOCK)
        max_programs = num_programs_hint(t.device) * (1 if is_interpreter() else _GPU_PROGRAMS_PER_SM)
        tiles_per_program = triton.cdiv(n_tiles, min(n_tiles, max_programs))
        _scale_unless_one_kernel[(triton.cdiv(n_tiles, tiles_per_program),)](
            t, t.numel(), tiles_per_program, factor, EMULATE_RNE=is_interpreter(), BLOCK=_BLOCK, num_warps=8,
        )
