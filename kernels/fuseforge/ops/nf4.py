"""Dequantization of a torchao NF4 weight in one Triton pass (QLoRA's per-matmul cost).

Why: torchao's `NF4Tensor.get_original_weight()` unpacks the two 4-bit codes of each byte into int64 index
tensors, gathers the NF4 table twice, expands the per-block scalers to the weight's size, multiplies and
interleaves: a dozen launches and several full-size temporaries (two int64 ones) for every frozen weight in
every forward and backward of a QLoRA step. Here one kernel reads each packed byte once (half a byte per
weight), looks its two codes up in the 16-entry table, scales them by their block's scaler and writes the
weight; the scalers themselves (one per 64 weights, double-quantized) are decoded by torchao's own
`dequantize_scalers`.

Same numbers as torchao: each value is `table[code] * scaler` in the weight's dtype, i.e. the exact fp32
product of two values of that dtype rounded once to it (to nearest even, emulated on the bits under
Triton's interpreter, which truncates): bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseforge.ops._shared.rowwise import round_to
from fuseforge.ops._shared.utils import is_interpreter

_BYTES_PER_PROGRAM = 2048


@triton.jit
def _nf4_dequantize_kernel(packed_ptr, scalers_ptr, table_ptr, out_ptr, n_bytes, BLOCK_SIZE: tl.constexpr,
                           EMULATE_RNE: tl.constexpr, BYTES: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    # the two codes of a byte are consecutive weights of one block (blocks have an even size)
    scaler = tl.load(scalers_ptr + (offs * 2) // BLOCK_SIZE, mask=mask, other=0.0).to(tl.float32)
    first = tl.load(table_ptr + ((byte >> 4) & 15), mask=mask, other=0.0).to(tl.float32)
    second = tl.load(table_ptr + (byte & 15), mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs * 2, round_to(first * scaler, out_ty, EMULATE_RNE), mask=mask)
    tl.store(out_ptr + offs * 2 + 1, round_to(second * scaler, out_ty, EMULATE_RNE), mask=mask)


def is_nf4(tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor" and hasattr(tensor, "quantized_data")


def dequantize_nf4(weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The plain weight an NF4Tensor stands for (torchao's `get_original_weight()`, then `.to(dtype)`)."""
    if not is_nf4(weight):
        raise TypeError(f"dequantize_nf4 takes a torchao NF4Tensor, got {type(weight).__name__}")
    if weight.block_size % 2:
        return weight.get_original_weight().to(dtype or weight.dtype)  # two codes of a byte in different blocks
    packed = weight.quantized_data.reshape(-1)
    scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                        weight.scaler_block_size).contiguous()
    table = weight.nf4.to(device=packed.device, dtype=weight.dtype).contiguous()
    out = torch.empty(weight.shape, dtype=weight.dtype, device=packed.device)
    n_bytes = packed.numel()
    grid = (triton.cdiv(n_bytes, _BYTES_PER_PROGRAM),)
    _nf4_dequantize_kernel[grid](packed, scalers, table, out, n_bytes, BLOCK_SIZE=weight.block_size,
                                 EMULATE_RNE=is_interpreter(), BYTES=_BYTES_PER_PROGRAM)
    return out if dtype in (None, weight.dtype) else out.to(dtype)
