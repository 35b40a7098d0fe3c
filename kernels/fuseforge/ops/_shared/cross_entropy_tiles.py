"""The per-tile math of the split-vocabulary cross-entropy, shared by its token-major kernels
(ops/cross_entropy.py) and vocab-major ones (vocab_major_cross_entropy.py), so that both layouts give the same loss:
softmax statistics folded tile by tile, their layout per vocabulary split, the merge into log-sum-exp and the
per-token loss, and the gradient of a tile."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

# Per (vocab split, token) the stats kernel leaves: running max, sum of exp(z - max),
# sum of z (label smoothing) and the target's logit (0 unless the split holds it).
N_STATS = 4


@triton.jit
def _capped_logits(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """softcap * tanh(x / softcap), with tanh from exp (libdevice is not portable)."""
    z = x
    if HAS_SOFTCAP:
        y = x / softcap
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        z = softcap * tl.where(y < 0.0, -t, t)
    return z


@triton.jit
def _softcap_slope(x, softcap):
    """d/dx softcap * tanh(x / softcap) = 1 - tanh^2, as 4e / (1 + e)^2 to avoid cancellation."""
    e = tl.exp(-2.0 * tl.abs(x / softcap))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def init_tile_stats(BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, VOCAB_AXIS: tl.constexpr):
    """Empty statistics: per-row max -inf; tile-shaped (vocabulary along VOCAB_AXIS) sums at 0."""
    run_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    if VOCAB_AXIS == 1:
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    else:
        acc = tl.zeros([BLOCK_V, BLOCK_T], tl.float32)
    return run_max, acc, acc


@triton.jit
def fold_tile_stats(
    x, mask, run_max, exp_acc, z_acc, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, VOCAB_AXIS: tl.constexpr,
):
    """Fold one tile of logits (vocabulary along VOCAB_AXIS) into the running softmax statistics.

    Only the row max is reduced per tile (exp() needs it to stay in range); the sums of
    exp(z - max) and of z stay tile-shaped, elementwise, until finish_tile_stats: each
    cross-warp reduction is a shared-memory round trip and a barrier, which bound this loop
    on the H200, not HBM. Shared by the token-major ([tokens, vocab] tiles, VOCAB_AXIS=1)
    and vocab-major ([vocab, tokens] tiles, VOCAB_AXIS=0) kernels so both give the same loss.
    """
    z = _capped_logits(x, softcap, HAS_SOFTCAP)
    z = tl.where(mask, z, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(z, axis=VOCAB_AXIS))
    # A row with nothing seen yet keeps max = -inf; shift by 0 there so exp() gives 0, not NaN.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    # One exp per row moves what was accumulated to the new max; masked lanes add exp(-inf) = 0.
    rescale = tl.exp(run_max - shift)
    exp_acc = exp_acc * tl.expand_dims(rescale, VOCAB_AXIS) + tl.exp(z - tl.expand_dims(shift, VOCAB_AXIS))
    if HAS_SMOOTHING:  # the sum of z only feeds the label-smoothing term
        z_acc += tl.where(mask, z, 0.0)
    return new_max, exp_acc, z_acc


@triton.jit
def finish_tile_stats(exp_acc, z_acc, HAS_SMOOTHING: tl.constexpr, VOCAB_AXIS: tl.constexpr):
    """(sum of exp(z - max), sum of z) per row: one reduction each, once after the loop."""
    run_sum = tl.sum(exp_acc, axis=VOCAB_AXIS)
    logit_sum = tl.zeros_like(run_sum)
    if HAS_SMOOTHING:
        logit_sum = tl.sum(z_acc, axis=VOCAB_AXIS)
    return run_sum, logit_sum


@triton.jit
def load_target_logit(row_ptr, stride_v, target, mask_t, v_begin, v_end, softcap, HAS_SOFTCAP: tl.constexpr):
    """z at each row's target, read directly (no scan for it) where [v_begin, v_end) holds the
    target, else 0 (splits merge by a sum); masked, so a bad index is never dereferenced."""
    held = mask_t & (target >= v_begin) & (target < v_end)
    x = tl.load(row_ptr + tl.where(held, target, 0).to(tl.int64) * stride_v, mask=held, other=0.0).to(tl.float32)
    # The same transform as the scanned tiles, so lse and the target's z agree exactly.
    return tl.where(held, _capped_logits(x, softcap, HAS_SOFTCAP), 0.0)


@triton.jit
def store_split_stats(stats_ptr, pid_s, n_splits, offs_t, mask_t, n_tokens, run_max, run_sum, logit_sum, target_logit):
    """Write one vocabulary split's statistics into stats [N_STATS, n_splits, n_tokens]."""
    field = n_splits * n_tokens
    out = stats_ptr + pid_s * n_tokens + offs_t
    tl.store(out, run_max, mask=mask_t)
    tl.store(out + field, run_sum, mask=mask_t)
    tl.store(out + 2 * field, logit_sum, mask=mask_t)
    tl.store(out + 3 * field, target_logit, mask=mask_t)


@triton.jit
def target_is_bad(target, n_vocab, ignore_index):
    """A class index outside [0, n_vocab) that is not ignore_index: its loss is NaN."""
    return (target != ignore_index) & ((target < 0) | (target >= n_vocab))


@triton.jit
def _token_loss(
    lse, target_logit, logit_sum, target, n_vocab, ignore_index, label_smoothing, z_loss_scale,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):
    """Per-token loss from the row statistics; 0 at ignored tokens."""
    loss = lse - target_logit
    if HAS_SMOOTHING:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - logit_sum / n_vocab)
    if HAS_Z_LOSS:
        loss += z_loss_scale * lse * lse
    return tl.where(target != ignore_index, loss, 0.0)


@triton.jit
def grad_coefficients(scale, valid, lse, n_vocab, label_smoothing, z_loss_scale):
    """(softmax coefficient, smoothing term, target term, lse to shift by) of scale * dloss/dz."""
    scale = tl.where(valid, scale, 0.0)
    # d/dz [lse + z_loss_scale * lse^2] = (1 + 2 * z_loss_scale * lse) * softmax
    softmax_coef = scale * (1.0 + 2.0 * z_loss_scale * lse)
    smooth = scale * (label_smoothing / n_vocab)
    hit = scale * (1.0 - label_smoothing)
    # Ignored rows get lse = +inf so exp(z - lse) = 0 without ever producing inf * 0.
    return softmax_coef, smooth, hit, tl.where(valid, lse, float("inf"))


@triton.jit
def load_grad_coefficients(
    target_ptr, lse_ptr, scale_ptr, offs_t, mask_t, n_vocab, ignore_index, label_smoothing, z_loss_scale,
    SCALE_PER_ROW: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """(target, valid, then grad_coefficients' terms) for the tokens offs_t; `scale` holds one
    element, or one per token when SCALE_PER_ROW."""
    target = tl.load(target_ptr + offs_t, mask=mask_t, other=ignore_index)
    valid = mask_t & (target != ignore_index)
    if SCALE_PER_ROW:
        scale = tl.load(scale_ptr + offs_t, mask=mask_t, other=0.0).to(tl.float32)
    else:
        scale = tl.load(scale_ptr).to(tl.float32) + tl.zeros([BLOCK_T], tl.float32)
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    softmax_coef, smooth, hit, lse = grad_coefficients(scale, valid, lse, n_vocab, label_smoothing, z_loss_scale)
    return target, valid, softmax_coef, smooth, hit, lse


@triton.jit
def grad_tile(
    x, hits_target, valid, lse, softmax_coef, smooth, hit, softcap,
    HAS_SOFTCAP: tl.constexpr, VOCAB_AXIS: tl.constexpr,
):
    """scale * dloss/dlogits for one tile of logits x (fp32, vocabulary along VOCAB_AXIS);
    the per-token terms come from grad_coefficients."""
    z = _capped_logits(x, softcap, HAS_SOFTCAP)
    g = tl.expand_dims(softmax_coef, VOCAB_AXIS) * tl.exp(z - tl.expand_dims(lse, VOCAB_AXIS))
    g -= tl.expand_dims(smooth, VOCAB_AXIS)
    g -= tl.where(hits_target, tl.expand_dims(hit, VOCAB_AXIS), 0.0)
    if HAS_SOFTCAP:
        g *= _softcap_slope(x, softcap)
    return tl.where(tl.expand_dims(valid, VOCAB_AXIS), g, 0.0)


@triton.jit
def ce_finalize_kernel(
    stats_ptr, target_ptr, loss_ptr, lse_ptr,
    n_tokens, n_splits, n_vocab, ignore_index, label_smoothing, z_loss_scale,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the per-slice stats into log-sum-exp and the per-token loss (0 at ignored tokens)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    offs_s = tl.arange(0, BLOCK_S)
    mask = (offs_s < n_splits)[:, None] & mask_t[None, :]
    field = n_splits * n_tokens
    base = stats_ptr + offs_s[:, None] * n_tokens + offs_t[None, :]
    part_max = tl.load(base, mask=mask, other=float("-inf"))
    part_sum = tl.load(base + field, mask=mask, other=0.0)
    top = tl.max(part_max, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(part_sum * tl.exp(part_max - shift[None, :]), axis=0)
    lse = shift + tl.log(tl.where(mask_t, total, 1.0))
    target_logit = tl.sum(tl.load(base + 3 * field, mask=mask, other=0.0), axis=0)
    logit_sum = tl.sum(tl.load(base + 2 * field, mask=mask, other=0.0), axis=0)
    target = tl.load(target_ptr + offs_t, mask=mask_t, other=ignore_index)
    loss = _token_loss(
        lse, target_logit, logit_sum, target, n_vocab, ignore_index, label_smoothing, z_loss_scale,
        HAS_SMOOTHING, HAS_Z_LOSS,
    )
    loss = tl.where(target_is_bad(target, n_vocab, ignore_index), float("nan"), loss)
    tl.store(loss_ptr + offs_t, loss, mask=mask_t)
    tl.store(lse_ptr + offs_t, lse, mask=mask_t)


@dataclass(frozen=True)
class VocabSplitTiling:
    """Tile shape and vocabulary split of a cross-entropy launch, token- or vocab-major."""

    block_t: int
    block_v: int
    num_warps: int
    n_splits: int
    vocab_per_split: int
