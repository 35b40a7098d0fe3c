"""Cross-entropy loss, log-sum-exp and gradient of a vocab-major logits block ([V, tokens], tokens contiguous).

Why a kernel of its own: fused_linear_cross_entropy keeps its first block of logits in
grad_weight's storage as [V, tokens] (so that grad_weight can overwrite rows already used).
The kernels of ops/cross_entropy.py reduce over the vocabulary every iteration across
warps (then four sums, now the max), which on this layout ran at ~340 GB/s on an H200
(3.1 ms for 4096 tokens at V=128256). Here a tile is [BLOCK_V, BLOCK_T] with 8 contiguous
tokens (16 B) per thread and the warps side by side along the tokens, so the per-iteration
reduction over BLOCK_V never leaves the thread: 0.62 ms there (gradient pass: 1.15 -> 0.76 ms).

Token-major chunks stay on ops/cross_entropy.py, which was faster for them on the H200.
Only the tile walk is this module's own: the per-tile math (softmax statistics, gradient),
the statistics layout and the merge kernel are cross_entropy_tiles.py's, shared with
ops/cross_entropy.py, so both layouts give the same loss. Loss options (label smoothing, z-loss,
softcap, ignore_index) mean the same as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseforge.loss_args import LossOptions
from fuseforge.ops._shared.cross_entropy_tiles import (
    N_STATS,
    VocabSplitTiling,
    ce_finalize_kernel,
    finish_tile_stats,
    fold_tile_stats,
    grad_tile,
    init_tile_stats,
    load_grad_coefficients,
    load_target_logit,
    store_split_stats,
)
from fuseforge.ops._shared.utils import is_interpreter, num_programs_hint


@triton.jit
def _stats_kernel(
    x_ptr, stride_v, target_ptr, stats_ptr,
    n_tokens, n_vocab, vocab_per_split, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Online max / sum of exp over one vocabulary split for BLOCK_T tokens (one read)."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    target = tl.load(target_ptr + offs_t, mask=mask_t, other=-1)
    v_begin = pid_s * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, n_vocab)

    z_target = load_target_logit(x_ptr + offs_t, stride_v, target, mask_t, v_begin, v_end, softcap, HAS_SOFTCAP)
    run_max, exp_acc, z_acc = init_tile_stats(BLOCK_T, BLOCK_V, VOCAB_AXIS=0)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask = (offs_v < v_end)[:, None] & mask_t[None, :]
        ptrs = x_ptr + offs_v.to(tl.int64)[:, None] * stride_v + offs_t[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        run_max, exp_acc, z_acc = fold_tile_stats(
            x, mask, run_max, exp_acc, z_acc, softcap, HAS_SOFTCAP, HAS_SMOOTHING, VOCAB_AXIS=0
        )
    run_sum, z_sum = finish_tile_stats(exp_acc, z_acc, HAS_SMOOTHING, VOCAB_AXIS=0)
    store_split_stats(stats_ptr, pid_s, tl.num_programs(1), offs_t, mask_t, n_tokens, run_max, run_sum, z_sum, z_target)


@triton.jit
def _grad_kernel(
    x_ptr, stride_v, target_ptr, lse_ptr, scale_ptr,
    n_tokens, n_vocab, vocab_per_split, ignore_index, label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, SCALE_PER_TOKEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """x <- scale * dloss/dlogits over one vocabulary split, in place (each element read, then written)."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    target, valid, softmax_coef, smooth, hit, lse = load_grad_coefficients(
        target_ptr, lse_ptr, scale_ptr, offs_t, mask_t, n_vocab, ignore_index, label_smoothing, z_loss_scale,
        SCALE_PER_TOKEN, BLOCK_T,
    )

    v_begin = pid_s * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, n_vocab)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask = (offs_v < v_end)[:, None] & mask_t[None, :]
        ptrs = x_ptr + offs_v.to(tl.int64)[:, None] * stride_v + offs_t[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        hits_target = offs_v[:, None] == target[None, :]
        g = grad_tile(x, hits_target, valid, lse, softmax_coef, smooth, hit, softcap, HAS_SOFTCAP, VOCAB_AXIS=0)
        tl.store(ptrs, g.to(x_ptr.dtype.element_ty), mask=mask)


def _tiling(logits_t: torch.Tensor) -> VocabSplitTiling:
    """8 tokens per thread, one warp per 256 tokens (see the module docstring); then split the
    vocabulary until about 8 programs per multiprocessor are running."""
    n_vocab, n_tokens = logits_t.shape
    if is_interpreter():
        # Few, large programs: the interpreter pays ~ms per program instance.
        block_t, block_v, warps = min(triton.next_power_of_2(max(n_tokens, 1)), 16), 512, 4
    else:
        block_t = min(1024, max(64, triton.next_power_of_2(n_tokens)))
        block_v, warps = 8, max(1, block_t // 256)
    block_v = min(block_v, triton.next_power_of_2(max(n_vocab, 1)))
    token_blocks = triton.cdiv(n_tokens, block_t)
    wanted = num_programs_hint(logits_t.device) * (1 if is_interpreter() else 8)
    n_splits = max(1, min(triton.cdiv(wanted, token_blocks), triton.cdiv(n_vocab, block_v), 256))
    vocab_per_split = triton.cdiv(triton.cdiv(n_vocab, n_splits), block_v) * block_v
    return VocabSplitTiling(block_t, block_v, warps, triton.cdiv(n_vocab, vocab_per_split), vocab_per_split)


def _check_layout(logits_t: torch.Tensor) -> None:
    if logits_t.dim() != 2 or (logits_t.shape[1] > 1 and logits_t.stride(1) != 1):
        raise ValueError(f"logits_t must be [V, tokens] with contiguous tokens, got shape {tuple(logits_t.shape)} "
                         f"and strides {tuple(logits_t.stride())}")


def vocab_major_loss_and_lse(logits_t: torch.Tensor, target: torch.Tensor, opts: LossOptions,
                             loss_out: torch.Tensor, lse_out: torch.Tensor) -> None:
    """Per-token loss and log-sum-exp (fp32, written into the given [tokens] buffers) of logits_t [V, tokens]."""
    _check_layout(logits_t)
    n_vocab, n_tokens = logits_t.shape
    if n_tokens == 0:
        return
    tiling = _tiling(logits_t)
    stats = torch.empty(N_STATS, tiling.n_splits, n_tokens, dtype=torch.float32, device=logits_t.device)
    _stats_kernel[(triton.cdiv(n_tokens, tiling.block_t), tiling.n_splits)](
        logits_t, logits_t.stride(0), target, stats,
        n_tokens, n_vocab, tiling.vocab_per_split, opts.softcap if opts.softcap is not None else 1.0,
        HAS_SOFTCAP=opts.softcap is not None, HAS_SMOOTHING=opts.label_smoothing > 0.0,
        BLOCK_T=tiling.block_t, BLOCK_V=tiling.block_v, num_warps=tiling.num_warps,
    )
    block_s = triton.next_power_of_2(tiling.n_splits)
    block_t = 16 if is_interpreter() else max(1, min(128, 4096 // block_s))
    ce_finalize_kernel[(triton.cdiv(n_tokens, block_t),)](
        stats, target, loss_out, lse_out,
        n_tokens, tiling.n_splits, n_vocab, opts.ignore_index, opts.label_smoothing, opts.z_loss_scale,
        HAS_SMOOTHING=opts.label_smoothing > 0.0, HAS_Z_LOSS=opts.z_loss_scale > 0.0,
        BLOCK_S=block_s, BLOCK_T=block_t, num_warps=4,
    )


def vocab_major_grad_in_place(logits_t: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                              scale: torch.Tensor, opts: LossOptions) -> None:
    """logits_t <- scale * dloss/dlogits (transposed); `scale` is fp32 with 1 element or one per token."""
    _check_layout(logits_t)
    n_vocab, n_tokens = logits_t.shape
    if n_tokens == 0:
        return
    tiling = _tiling(logits_t)
    _grad_kernel[(triton.cdiv(n_tokens, tiling.block_t), tiling.n_splits)](
        logits_t, logits_t.stride(0), target, lse, scale,
        n_tokens, n_vocab, tiling.vocab_per_split, opts.ignore_index, opts.label_smoothing, opts.z_loss_scale,
        opts.softcap if opts.softcap is not None else 1.0,
        HAS_SOFTCAP=opts.softcap is not None, SCALE_PER_TOKEN=scale.numel() != 1,
        BLOCK_T=tiling.block_t, BLOCK_V=tiling.block_v, num_warps=tiling.num_warps,
    )
