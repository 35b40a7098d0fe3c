"""Cross-entropy on logits: online softmax over the vocabulary (fp32) in split-vocabulary kernels.

A row of logits (128k-256k classes) is too long for one program, and a chunk of a few hundred
rows would not fill the GPU with one program per row, so the vocabulary of every row is split
between programs: a statistics kernel walks each slice in tiles with a running max / sum of
exp, a tiny finalize kernel merges the slices into the log-sum-exp and the per-token loss,
and in backward a gradient kernel sweeps the logits again and writes dloss/dlogits, already
multiplied by grad_output (into the logits' own buffer if asked). One design serves every
case: scalar and per-token losses, forward-only calls, token- and vocab-major views, and
fused_linear_cross_entropy's chunks.

Why not one kernel that reads the logits once: a group of programs holding a row between
them in registers and exchanging the slices' statistics was built and measured on an H200
(session 3 in benchmarks/RESULTS.md): 2.2 ms at 8192 x 128256 against 1.70 ms for these
kernels, whose three passes over HBM run at 3.7 TB/s; the group waits 4-10 us per row.

Class indices are counted and range-checked on the device (ops/targets.py), so no path syncs
with the host in forward or backward.

All kernels take explicit strides, so they also run on a transposed view ([tokens, vocab]
stored vocab-major), which fused_linear_cross_entropy relies on.

Semantics match torch.nn.functional.cross_entropy with class indices (label smoothing
included: loss = (1 - ls) * nll + ls * mean over classes of -log p), plus two extras used
by LLM recipes: a PaLM z-loss (z_loss_scale * lse**2 per token) and Gemma-2 final-logit
softcapping (logits -> softcap * tanh(logits / softcap) before the softmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from fuseforge.loss_args import IGNORE_INDEX, LossOptions, check_loss_options
from fuseforge.ops._shared.compiled import compiling
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
from fuseforge.ops.targets import raise_pending_target_errors, scan_targets
from fuseforge.ops._shared.utils import (
    TRAINING_DTYPES,
    check_device_supported,
    check_same_device,
    check_target,
    check_tensor,
    is_interpreter,
    may_overlap,
    num_programs_hint,
)


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _ce_stats_kernel(
    x_ptr, stride_xt, stride_xv, target_ptr, stats_ptr,
    n_tokens, n_vocab, vocab_per_split, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Online max / sum-of-exp over one vocabulary slice for BLOCK_T tokens (one read)."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    target = tl.load(target_ptr + offs_t, mask=mask_t, other=-1)
    row = x_ptr + offs_t.to(tl.int64) * stride_xt
    v_begin = pid_s * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, n_vocab)

    target_logit = load_target_logit(row, stride_xv, target, mask_t, v_begin, v_end, softcap, HAS_SOFTCAP)
    run_max, exp_acc, z_acc = init_tile_stats(BLOCK_T, BLOCK_V, VOCAB_AXIS=1)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask = mask_t[:, None] & (offs_v < v_end)[None, :]
        x = tl.load(row[:, None] + offs_v.to(tl.int64)[None, :] * stride_xv, mask=mask, other=0.0).to(tl.float32)
        run_max, exp_acc, z_acc = fold_tile_stats(
            x, mask, run_max, exp_acc, z_acc, softcap, HAS_SOFTCAP, HAS_SMOOTHING, VOCAB_AXIS=1
        )
    run_sum, logit_sum = finish_tile_stats(exp_acc, z_acc, HAS_SMOOTHING, VOCAB_AXIS=1)
    store_split_stats(stats_ptr, pid_s, n_splits, offs_t, mask_t, n_tokens, run_max, run_sum, logit_sum, target_logit)


@triton.jit
def _ce_grad_kernel(
    x_ptr, stride_xt, stride_xv, g_ptr, stride_gt, stride_gv, target_ptr, lse_ptr, scale_ptr,
    n_tokens, n_vocab, vocab_per_split, ignore_index, label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, SCALE_PER_ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """g = scale * dloss/dlogits for one vocabulary slice; g may alias x (read, then write)."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    target, valid, softmax_coef, smooth, hit, lse = load_grad_coefficients(
        target_ptr, lse_ptr, scale_ptr, offs_t, mask_t, n_vocab, ignore_index, label_smoothing, z_loss_scale,
        SCALE_PER_ROW, BLOCK_T,
    )

    x_row = x_ptr + offs_t.to(tl.int64) * stride_xt
    g_row = g_ptr + offs_t.to(tl.int64) * stride_gt
    v_begin = pid_s * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, n_vocab)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        offs_v64 = offs_v.to(tl.int64)
        mask = mask_t[:, None] & (offs_v < v_end)[None, :]
        x = tl.load(x_row[:, None] + offs_v64[None, :] * stride_xv, mask=mask, other=0.0).to(tl.float32)
        hits_target = offs_v[None, :] == target[:, None]
        g = grad_tile(x, hits_target, valid, lse, softmax_coef, smooth, hit, softcap, HAS_SOFTCAP, VOCAB_AXIS=1)
        tl.store(g_row[:, None] + offs_v64[None, :] * stride_gv, g.to(g_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# Launchers (shared with fused_linear_cross_entropy)
# --------------------------------------------------------------------------------------


def _tiling(logits: torch.Tensor, n_splits: int | None = None) -> VocabSplitTiling:
    """Tile shape by memory layout; split the vocabulary until the grid fills the device."""
    n_tokens, n_vocab = logits.shape
    if is_interpreter():
        # Few, large programs: the interpreter pays ~ms per program instance.
        block_t, block_v, warps = min(triton.next_power_of_2(max(n_tokens, 1)), 16), 1024, 4
    elif logits.stride(0) == 1 and n_tokens > 1:
        # Vocab-major storage (the transposed chunk of the fused linear path): tokens are
        # contiguous, so a tile spans 64 tokens (128 B of bf16) per vocabulary entry.
        block_t, block_v, warps = 64, 64, 8
    else:
        block_t, block_v, warps = 1, 4096, 8
    block_v = min(block_v, triton.next_power_of_2(max(n_vocab, 1)))
    max_splits = triton.cdiv(n_vocab, block_v)
    if n_splits is None:
        token_blocks = triton.cdiv(n_tokens, block_t)
        wanted = num_programs_hint(logits.device) * (1 if is_interpreter() else 4)
        n_splits = min(64, triton.cdiv(wanted, token_blocks))
    n_splits = max(1, min(int(n_splits), max_splits))
    vocab_per_split = triton.cdiv(triton.cdiv(n_vocab, n_splits), block_v) * block_v
    n_splits = triton.cdiv(n_vocab, vocab_per_split)
    return VocabSplitTiling(block_t, block_v, warps, n_splits, vocab_per_split)


def ce_forward_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    opts: LossOptions,
    loss_out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    n_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and log-sum-exp (fp32) of a [tokens, vocab] view with any strides."""
    n_tokens, n_vocab = logits.shape
    loss = loss_out if loss_out is not None else torch.empty(n_tokens, dtype=torch.float32, device=logits.device)
    lse = lse_out if lse_out is not None else torch.empty(n_tokens, dtype=torch.float32, device=logits.device)
    if n_tokens == 0:
        return loss, lse
    tiling = _tiling(logits, n_splits)
    stats = torch.empty(N_STATS, tiling.n_splits, n_tokens, dtype=torch.float32, device=logits.device)
    softcap = opts.softcap if opts.softcap is not None else 1.0
    grid = (triton.cdiv(n_tokens, tiling.block_t), tiling.n_splits)
    _ce_stats_kernel[grid](
        logits, logits.stride(0), logits.stride(1), target, stats,
        n_tokens, n_vocab, tiling.vocab_per_split, softcap,
        HAS_SOFTCAP=opts.softcap is not None, HAS_SMOOTHING=opts.label_smoothing > 0.0,
        BLOCK_T=tiling.block_t, BLOCK_V=tiling.block_v, num_warps=tiling.num_warps,
    )
    block_t = 16 if is_interpreter() else 128
    ce_finalize_kernel[(triton.cdiv(n_tokens, block_t),)](
        stats, target, loss, lse,
        n_tokens, tiling.n_splits, n_vocab, opts.ignore_index, opts.label_smoothing, opts.z_loss_scale,
        HAS_SMOOTHING=opts.label_smoothing > 0.0, HAS_Z_LOSS=opts.z_loss_scale > 0.0,
        BLOCK_T=block_t, BLOCK_S=triton.next_power_of_2(tiling.n_splits), num_warps=4,
    )
    return loss, lse


def ce_write_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    opts: LossOptions,
    out: torch.Tensor,
    n_splits: int | None = None,
) -> torch.Tensor:
    """out = scale * dloss/dlogits; `scale` is fp32 with 1 element or one per token; out may be logits."""
    n_tokens, n_vocab = logits.shape
    if n_tokens == 0:
        return out
    tiling = _tiling(logits, n_splits)
    grid = (triton.cdiv(n_tokens, tiling.block_t), tiling.n_splits)
    _ce_grad_kernel[grid](
        logits, logits.stride(0), logits.stride(1), out, out.stride(0), out.stride(1), target, lse, scale,
        n_tokens, n_vocab, tiling.vocab_per_split, opts.ignore_index, opts.label_smoothing, opts.z_loss_scale,
        opts.softcap if opts.softcap is not None else 1.0,
        HAS_SOFTCAP=opts.softcap is not None, SCALE_PER_ROW=scale.numel() != 1,
        BLOCK_T=tiling.block_t, BLOCK_V=tiling.block_v, num_warps=tiling.num_warps,
    )
    return out


def mark_overwritten(t: torch.Tensor) -> None:
    """Bump the version counter of a tensor a kernel wrote in place, so that any autograd node
    that saved it raises "modified by an inplace operation" instead of using garbage."""
    increment = getattr(torch.autograd.graph, "increment_version", None)
    if increment is not None:
        increment(t)


# --------------------------------------------------------------------------------------
# Autograd and public API
# --------------------------------------------------------------------------------------


def _ce_forward(logits, target, inv_count, opts: LossOptions, reduction: str):
    """The forward launches (eager and compiled paths): (loss in the logits' dtype, fp32 lse)."""
    loss_tok, lse = ce_forward_stats(logits, target, opts)
    if reduction == "none":
        loss = loss_tok
    elif reduction == "sum":
        loss = loss_tok.sum()
    else:
        loss = loss_tok.sum() * inv_count.reshape(())
    return loss.to(logits.dtype), lse


def _ce_backward(logits, target, lse, inv_count, grad_loss, opts: LossOptions, reduction: str, out) -> None:
    """The backward launch: out = grad_loss * dloss/dlogits (inv_count: the mean's 1 / count, else None)."""
    raise_pending_target_errors()
    if reduction == "none":
        scale = grad_loss.to(torch.float32).contiguous()
    else:
        scale = grad_loss.to(torch.float32).reshape(1)
        if inv_count is not None:
            scale = scale * inv_count
    ce_write_grad(logits, target, lse, scale, opts, out=out)


class _CrossEntropyFunction(torch.autograd.Function):
    """Forward reads the logits once for loss and lse; backward reads them again and writes the
    gradient already multiplied by grad_output (per token for reduction "none"), with no host
    sync and no second [N, V] buffer held between forward and backward."""

    @staticmethod
    def forward(ctx, logits, target, inv_count, opts: LossOptions, reduction: str, inplace_grad: bool):
        if reduction != "mean":
            inv_count = None
        loss, lse = _ce_forward(logits, target, inv_count, opts, reduction)
        ctx.save_for_backward(logits, target, lse, inv_count)
        ctx.opts, ctx.reduction, ctx.inplace_grad = opts, reduction, inplace_grad
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros are built for lse's (unused) gradient
        return loss, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_lse):
        if grad_loss is None:
            return None, None, None, None, None, None
        logits, target, lse, inv_count = ctx.saved_tensors
        inplace = ctx.inplace_grad
        grad = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        _ce_backward(logits, target, lse, inv_count, grad_loss, ctx.opts, ctx.reduction, grad)
        if inplace:
            mark_overwritten(logits)
        return grad, None, None, None, None, None


# --- torch.compile: the same launches as custom ops (ops/_shared/compiled.py says why) ---------------


@torch.library.custom_op("fuseforge::cross_entropy", mutates_args=())
def _cross_entropy_op(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss_scale: float,
    softcap: float | None, reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, 1 / count) of [N, V] logits and int64 [N] targets; the class-index scan (and its
    ValueError) runs here, eagerly, where a compiled graph cannot hold it."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
    inv_count = scan_targets(target, logits.shape[-1], ignore_index, "cross_entropy")
    loss, lse = _ce_forward(logits, target, inv_count, opts, reduction)
    return loss, lse, inv_count


@_cross_entropy_op.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss_scale, softcap, reduction):
    n_tokens = logits.shape[0]
    loss = logits.new_empty((n_tokens,) if reduction == "none" else ())
    return loss, logits.new_empty(n_tokens, dtype=torch.float32), logits.new_empty(1, dtype=torch.float32)


@torch.library.custom_op("fuseforge::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(
    logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, inv_count: torch.Tensor, grad_loss: torch.Tensor,
    ignore_index: int, label_smoothing: float, z_loss_scale: float, softcap: float | None, reduction: str,
) -> torch.Tensor:
    """The logits' gradient in a fresh buffer (no inplace_grad when compiled)."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _ce_backward(logits, target, lse, inv_count if reduction == "mean" else None, grad_loss, opts, reduction, grad)
    return grad


@_cross_entropy_backward_op.register_fake
def _(logits, target, lse, inv_count, grad_loss, ignore_index, label_smoothing, z_loss_scale, softcap, reduction):
    return logits.new_empty(logits.shape)


def _cross_entropy_setup(ctx, inputs, output):
    logits, target, *ctx.options = inputs
    _, lse, inv_count = output
    ctx.save_for_backward(logits, target, lse, inv_count)


def _cross_entropy_op_backward(ctx, grad_loss, _grad_lse, _grad_inv_count):
    logits, target, lse, inv_count = ctx.saved_tensors
    return (_cross_entropy_backward_op(logits, target, lse, inv_count, grad_loss, *ctx.options),) + (None,) * 6


_cross_entropy_op.register_autograd(_cross_entropy_op_backward, setup_context=_cross_entropy_setup)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    *,
    inplace_grad: bool = False,
    return_lse: bool = False,
):
    """Cross-entropy of `logits` [..., V] against class indices `target` [...] (int64).

    Same result as torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1),
    ignore_index=..., reduction=..., label_smoothing=...), except that the class dimension is
    the LAST one for inputs of rank > 2 (the LLM layout [batch, seq, vocab]), and that a mean
    over zero non-ignored tokens is 0 (torch gives NaN). The loss has the logits' dtype
    (math is fp32); reduction="none" returns one loss per token, 0 at ignored tokens.

    z_loss_scale adds z_loss_scale * lse**2 per non-ignored token (PaLM z-loss); softcap
    replaces the logits by softcap * tanh(logits / softcap) first (Gemma 2). Both are
    differentiated through.

    The gradient is computed in backward, already multiplied by grad_output (no host sync).

    inplace_grad=True writes the gradient into the logits' own buffer during backward (saves
    one [N, V] allocation). Opt in only when nothing reads the logits after backward; any
    autograd node that saved them then raises instead of silently using the gradient.
    Ignored for leaf tensors (their .grad must not alias their data) and for expanded logits
    (elements sharing memory cannot each hold their gradient): those get a fresh buffer.

    return_lse=True also returns the fp32 log-sum-exp per token (shape of target, not
    differentiable; defined at ignored tokens too).

    Class indices outside [0, V) other than ignore_index get a NaN loss and raise ValueError:
    on a CUDA device without a host sync, from the first later fuseforge loss call (or this
    loss's backward) that runs after the GPU has checked them; at once with
    fuseforge.ops.targets.TARGET_CHECK = "sync", and always on the CPU (see ops/targets.py).
    """
    opts = check_loss_options(ignore_index, reduction, label_smoothing, z_loss_scale, softcap)
    check_tensor("logits", logits, min_ndim=1, dtypes=TRAINING_DTYPES)
    n_classes = logits.shape[-1]
    if n_classes == 0:
        raise ValueError(f"logits must have at least one class in its last dimension, got shape {tuple(logits.shape)}")
    check_target(target, logits.shape[:-1], "logits.shape[:-1]")
    check_same_device(logits=logits, target=target)
    check_device_supported("logits", logits)

    flat_logits = logits.reshape(-1, n_classes)
    if compiling():
        loss, lse, _ = _cross_entropy_op(
            flat_logits, target.reshape(-1).to(torch.int64).contiguous(), opts.ignore_index, opts.label_smoothing,
            opts.z_loss_scale, opts.softcap, reduction,
        )
    else:
        loss, lse = _cross_entropy_eager(logits, flat_logits, target, opts, reduction, inplace_grad)
    if reduction == "none":
        loss = loss.view(target.shape)
    if return_lse:
        return loss, lse.view(target.shape)
    return loss


def _cross_entropy_eager(logits, flat_logits, target, opts, reduction, inplace_grad):
    """The autograd.Function path (no dispatcher cost per call), with the class-index scan in front."""
    # A leaf's .grad must not alias its data: logits that are (a view of) a leaf get a fresh buffer,
    # and so do expanded logits (one cell for many elements cannot hold all their gradients).
    base = logits if logits._base is None else logits._base
    inplace_grad = bool(inplace_grad) and not base.is_leaf and not may_overlap(flat_logits)
    flat_target = target.reshape(-1).to(torch.int64).contiguous()
    inv_count = scan_targets(flat_target, flat_logits.shape[1], opts.ignore_index, "cross_entropy")
    return _CrossEntropyFunction.apply(flat_logits, flat_target, inv_count, opts, reduction, inplace_grad)
