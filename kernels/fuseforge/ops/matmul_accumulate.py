"""c += a @ b for a large 16-bit c and a short inner dimension, in one pass over c.

Why: fused_linear_cross_entropy adds every chunk's g.T @ hidden (inner dimension = the chunk's
~256 tokens) into the whole [V, H] grad_weight. That update is memory-bound: c is read and
written once per chunk (2 GiB at V=128k, H=4096 in bf16). On an H200, cuBLAS's beta=1 path
streamed c at ~2.5 TB/s (0.83 ms per chunk, against 0.52 ms for the same product with beta=0).
Here each program issues the load of its c tile before its K loop, so the read overlaps the
matrix work, and adds it in fp32 before the one rounding to c's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseforge.ops.utils import is_interpreter

# Above this inner dimension the update is compute-bound and cuBLAS's addmm is the better kernel.
MAX_INNER = 512
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _addmm_kernel(
    c_ptr, a_ptr, b_ptr, M, N, K, stride_cm, stride_am, stride_ak, stride_bk, stride_bn,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of c; consecutive programs share an a tile (n fastest), so it stays in L2."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // n_tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % n_tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    c_mask = mask_m[:, None] & mask_n[None, :]
    c_old = tl.load(c_ptrs, mask=c_mask, other=0.0)

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k.to(tl.int64)[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k.to(tl.int64)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        mask_k = (k + offs_k) < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # Triton's CPU interpreter multiplies 16-bit floats wrongly
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc += c_old.to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def uses_triton_addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether addmm_ takes the Triton path: 16-bit operands of one dtype, row-major c, short inner dim."""
    return (
        c.dtype in _DTYPES
        and a.dtype == b.dtype == c.dtype
        and c.stride(1) == 1
        and 0 < a.shape[1] <= MAX_INNER
        and (c.is_cuda or is_interpreter())
    )


def addmm_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c += a @ b in place (c [M, N], a [M, K], b [K, N], any strides for a and b); returns c."""
    if not uses_triton_addmm(c, a, b):
        return c.addmm_(a, b)
    M, N = c.shape
    K = a.shape[1]
    block_m, block_n, block_k = 128, 128, 64
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _addmm_kernel[grid](
        c, a, b, M, N, K, c.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        UPCAST=is_interpreter(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=8, num_stages=3,
    )
    return c
