"""Fused LM head + cross-entropy: loss and gradients without materialising the [N, V] logits.

Why: at 8k tokens and a 128k vocabulary the bf16 logits alone take 2 GiB, their fp32 upcast
and gradient several more. Here the logits only ever exist one chunk at a time:

* Tokens are processed in chunks: logits = hidden_chunk @ weight.T (+ bias) by cuBLAS, the
  cross-entropy kernels turn them into dloss/dlogits in place (fp32 math, chunk dtype out),
  then grad_hidden[chunk] = g @ weight and grad_weight += g.T @ hidden_chunk (addmm_, beta=1,
  accumulated in the weight's dtype like Liger-Kernel; one bf16 rounding per chunk).
  Chunks hold <= 64 MiB of logits by default (256 tokens at V=128256 in bf16), or as much as
  `hidden` itself when that is larger, and at least 256 tokens (see default_chunk_tokens).
* Small chunks make every chunk re-read and re-write all of grad_weight (V x H). To halve
  that traffic at no memory cost, the first min(N, H) tokens use grad_weight's own storage
  as their scratch: before grad_weight holds anything, its V*H elements fit the logits of H
  tokens, stored vocab-major ([V, tokens]). grad_weight is then produced in vocab slices
  through a small temporary, each slice overwriting only rows whose logits are consumed.
  That block's cross-entropy runs on ops/_shared/vocab_major_cross_entropy.py (tiles whose
  reduction stays in a thread on this layout); token-major chunks use ops/cross_entropy.py.
* Where the time goes (H200, 8192 x 4096 -> 128256 bf16, 256-token chunks): the GEMMs at
  full size take ~37 ms; each of the 16 chunks after the first block adds a beta=1 GEMM over
  all of grad_weight that cuBLAS runs at ~2.5 TB/s (0.82 ms, against 0.37 ms of math), which
  is why small chunks cost ~1 ms each. See benchmarks/RESULTS.md (issue 3).
* For reduction "mean"/"sum" the gradients are computed in forward (the loss is a scalar) and
  backward only multiplies them by grad_output, on the device (nothing to do for 1; no host sync).
* For reduction "none" the upstream gradient differs per token, so forward computes only the
  loss and backward recomputes the logits chunk by chunk: one extra logits GEMM (~4/3 the
  FLOPs of the mean path), exact for any upstream gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import torch
from torch.autograd.function import once_differentiable

from fuseforge.ops._shared.compiled import compiling
from fuseforge.loss_args import IGNORE_INDEX, LossOptions, MIN_CHUNK_TOKENS, check_chunk_size, check_loss_options
from fuseforge.ops.cross_entropy import ce_forward_stats, ce_write_grad
from fuseforge.ops._shared.lm_head import check_lm_head_inputs
from fuseforge.ops._shared.scaling import scale_unless_one
from fuseforge.ops.targets import raise_pending_target_errors, scan_targets
from fuseforge.ops._shared.vocab_major_cross_entropy import vocab_major_grad_in_place, vocab_major_loss_and_lse

# Logits scratch per chunk (and the grad_weight slice temporary), the only O(V) extra memory.
DEFAULT_CHUNK_BYTES = 64 * 2**20

def _round_rows(rows: int) -> int:
    """Round a row count down to a tensor-core-friendly multiple (16, else 8), at least 1.

    Not to 128: at V=151936 that turned the 220 tokens the budget allows into 128, and every
    chunk costs a read-modify-write of all of grad_weight.
    """
    for multiple in (16, 8):
        if rows >= multiple:
            return rows - rows % multiple
    return max(rows, 1)


# The floor is MIN_CHUNK_TOKENS (fuseforge/loss_args.py says why): only vocabularies above 128k
# (bf16) go past DEFAULT_CHUNK_BYTES because of it (256k: 125 MiB, as Liger-Kernel takes there).
def default_chunk_tokens(n_vocab: int, element_size: int, hidden_bytes: int = 0) -> int:
    """Tokens per chunk: logits within DEFAULT_CHUNK_BYTES or the size of the hidden states
    (`hidden_bytes`), whichever is larger, but at least MIN_CHUNK_TOKENS.

    Why the hidden states' size: a big batch (an 8B model at 64k tokens) would otherwise cut its
    loss into hundreds of chunks, each re-reading grad_weight, to save memory that is small next
    to the batch's own activations (one more tensor the size of the input: 512 MiB there, the
    chunk Liger-Kernel takes at that shape; measured in benchmarks/RESULTS.md).
    """
    budget = max(DEFAULT_CHUNK_BYTES, hidden_bytes)
    return max(_round_rows(budget // (n_vocab * element_size)), MIN_CHUNK_TOKENS)


@dataclass(frozen=True)
class _Wanted:
    """Which gradients the caller needs."""

    hidden: bool
    weight: bool
    bias: bool

    @property
    def any(self) -> bool:
        return self.hidden or self.weight or self.bias


class _Gradients:
    """grad_hidden, grad_weight (weight dtype) and grad_bias (fp32 until finish) filled chunk by chunk."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wanted: _Wanted):
        self.hidden = torch.empty_like(hidden) if wanted.hidden else None
        self.weight = torch.empty_like(weight) if wanted.weight else None
        self.bias = None
        if wanted.bias and bias is not None:
            self.bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        self.weight_started = False

    def add_chunk(self, grad_logits: torch.Tensor, hidden_chunk: torch.Tensor, weight: torch.Tensor, rows: slice):
        if self.hidden is not None:
            torch.mm(grad_logits, weight, out=self.hidden[rows])
        if self.weight is not None:
            if self.weight_started:
                self.weight.addmm_(grad_logits.t(), hidden_chunk)
            else:
                torch.mm(grad_logits.t(), hidden_chunk, out=self.weight)
                self.weight_started = True
        if self.bias is not None:
            self.bias += grad_logits.sum(0, dtype=torch.float32)

    def finish(self, bias: torch.Tensor | None) -> None:
        if self.weight is not None and not self.weight_started:  # zero tokens
            self.weight.zero_()
        if self.bias is not None:
            self.bias = self.bias.to(bias.dtype)


def _rows(scale: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The part of a per-token scale that belongs to tokens [start, stop); a 1-element scale is shared."""
    return scale if scale.numel() == 1 else scale[start:stop]


def _first_block_in_grad_weight(hidden, weight, bias, target, opts, grads, slice_rows, n0, block_stats) -> int:
    """Process the first n0 <= min(N, H) tokens with their logits stored, vocab-major, in grad_weight.

    The transposed logits [V, n0] occupy the END of grad_weight's storage. grad_weight rows
    [v0, v1) are written (from a temporary) only after logits rows [v0, v1) were consumed, and
    they cover elements [v0*H, v1*H), which end before the unconsumed logits rows [v1, V)
    begin at V*(H - n0) + v1*n0 (because v1 <= V). block_stats(logits_t) computes the block's
    statistics from its logits and returns (the gradient scale: 1 element or n0, the block's lse).
    Returns n0, the number of tokens done.
    """
    n_vocab, n_hidden = weight.shape
    logits_t = grads.weight.view(-1)[n_vocab * (n_hidden - n0):].view(n_vocab, n0)
    h0 = hidden[:n0]
    if bias is None:
        torch.mm(weight, h0.t(), out=logits_t)
    else:
        torch.addmm(bias.unsqueeze(1), weight, h0.t(), out=logits_t)
    scale, lse = block_stats(logits_t)
    vocab_major_grad_in_place(logits_t, target[:n0], lse, scale, opts)
    if grads.hidden is not None:
        torch.mm(logits_t.t(), weight, out=grads.hidden[:n0])
    if grads.bias is not None:
        grads.bias += logits_t.sum(1, dtype=torch.float32)
    staging = weight.new_empty(min(slice_rows, n_vocab), n_hidden)
    for v0 in range(0, n_vocab, slice_rows):
        v1 = min(n_vocab, v0 + slice_rows)
        part = staging[: v1 - v0]
        torch.mm(logits_t[v0:v1], h0, out=part)
        grads.weight[v0:v1].copy_(part)
    grads.weight_started = True
    return n0


def _chunked_sweep(hidden, weight, bias, target, opts: LossOptions, grads, chunk: int, first: int,
                  first_block_stats, chunk_stats) -> None:
    """The chunk loop of every fused linear loss: the first `first` tokens with their logits in grad_weight's
    storage when that pays (_first_block_in_grad_weight, given `first_block_stats`), then chunks of `chunk`
    tokens through one scratch buffer. `chunk_stats(start, stop, logits)` records those rows' statistics and
    returns (the scale of their gradient, their lse); with `grads` the gradients are accumulated and finished."""
    n_tokens, n_hidden = hidden.shape
    n_vocab = weight.shape[0]
    start = 0
    if grads is not None and grads.weight is not None and first > chunk:
        slice_rows = _round_rows(max(1, chunk * n_vocab // n_hidden))  # staging ~ one chunk of logits
        start = _first_block_in_grad_weight(hidden, weight, bias, target, opts, grads, slice_rows, first,
                                            first_block_stats)
    if start < n_tokens:
        scratch = hidden.new_empty(min(chunk, n_tokens - start), n_vocab)
        for s in range(start, n_tokens, chunk):
            e = min(n_tokens, s + chunk)
            logits = scratch[: e - s]
            if bias is None:
                torch.mm(hidden[s:e], weight.t(), out=logits)
            else:
                torch.addmm(bias, hidden[s:e], weight.t(), out=logits)
            scale, lse = chunk_stats(s, e, logits)
            if grads is not None:
                ce_write_grad(logits, target[s:e], lse, scale, opts, out=logits)
                grads.add_chunk(logits, hidden[s:e], weight, slice(s, e))
        del scratch
    if grads is not None:
        grads.finish(bias)


def _sweep(hidden, weight, bias, target, opts: LossOptions, scale, wanted: _Wanted, chunk: int):
    """One pass over all tokens: per-token loss and lse, plus (if `scale` is given) the
    gradients of the loss scaled by `scale` (1 element, or one per token)."""
    n_tokens, n_hidden = hidden.shape
    loss = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    grads = _Gradients(hidden, weight, bias, wanted) if scale is not None else None
    n0 = min(n_tokens, n_hidden)

    def first_block_stats(logits_t):
        vocab_major_loss_and_lse(logits_t, target[:n0], opts, loss[:n0], lse[:n0])
        return _rows(scale, 0, n0), lse[:n0]

    def chunk_stats(s, e, logits):
        ce_forward_stats(logits, target[s:e], opts, loss_out=loss[s:e], lse_out=lse[s:e])
        return (_rows(scale, s, e) if grads is not None else None), lse[s:e]

    _chunked_sweep(hidden, weight, bias, target, opts, grads, chunk, n0, first_block_stats, chunk_stats)
    return loss, lse, grads


def _flce_forward(hidden, weight, bias, target, opts, reduction, scale, chunk, wanted: _Wanted):
    """The forward sweep (eager and compiled paths): (loss, lse, _Gradients of the scalar loss or None).
    Reduction "none" computes no gradients here; backward recomputes them (_flce_backward_none)."""
    with torch.autocast(hidden.device.type, enabled=False):
        if reduction == "none":
            loss, lse, _ = _sweep(hidden, weight, bias, target, opts, None, wanted, chunk)
            return loss, lse, None
        loss_tok, lse, grads = _sweep(hidden, weight, bias, target, opts, scale if wanted.any else None, wanted, chunk)
        return loss_tok.sum() * scale.reshape(()), lse, grads


def _flce_backward_none(hidden, weight, bias, target, grad_loss, opts, chunk, wanted: _Wanted) -> _Gradients:
    """Reduction "none": the gradients recomputed chunk by chunk, scaled per token by grad_loss."""
    raise_pending_target_errors()
    scale = grad_loss.to(torch.float32).contiguous()
    with torch.autocast(hidden.device.type, enabled=False):
        return _sweep(hidden, weight, bias, target, opts, scale, wanted, chunk)[2]


class _FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, opts, reduction, scale, chunk, grad_enabled):
        wanted = _Wanted(*(grad_enabled and bool(n) for n in ctx.needs_input_grad[:3]))
        ctx.reduction = reduction
        loss, lse, grads = _flce_forward(hidden, weight, bias, target, opts, reduction, scale, chunk, wanted)
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, target)
            ctx.opts, ctx.wanted, ctx.chunk = opts, wanted, chunk
        elif grads is not None:
            ctx.save_for_backward(grads.hidden, grads.weight, grads.bias)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros are built for lse's (unused) gradient
        return loss, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_lse):
        if grad_loss is None:
            return (None,) * 9
        if ctx.reduction == "none":
            hidden, weight, bias, target = ctx.saved_tensors
            grads = _flce_backward_none(hidden, weight, bias, target, grad_loss, ctx.opts, ctx.chunk, ctx.wanted)
            grad_hidden, grad_weight, grad_bias = grads.hidden, grads.weight, grads.bias
        else:
            raise_pending_target_errors()
            grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
            scale_unless_one((grad_hidden, grad_weight, grad_bias), grad_loss)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


# --- torch.compile: the same launches as custom ops (ops/_shared/compiled.py says why) ---------------


def _grads_or_empty(grads: _Gradients | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A custom op cannot return None: a gradient not computed comes back as an empty tensor."""
    found = (None, None, None) if grads is None else (grads.hidden, grads.weight, grads.bias)
    return tuple(g if g is not None else like.new_empty(0) for g in found)


@torch.library.custom_op("fuseforge::fused_linear_cross_entropy", mutates_args=())
def _flce_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    scale: torch.Tensor | None, ignore_index: int, label_smoothing: float, z_loss_scale: float,
    softcap: float | None, reduction: str, chunk: int, need_hidden: bool, need_weight: bool, need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, grad_hidden, grad_weight, grad_bias) of 2-D contiguous hidden and int64 [N] targets.

    The class-index scan (and its ValueError) runs here, eagerly, where a compiled graph cannot hold
    it; `scale` None means its 1 / count (reduction "mean"). The gradients of a scalar loss are
    computed here as in eager (unscaled by grad_output), empty when not wanted or for reduction "none".
    """
    opts = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
    inv_count = scan_targets(target, weight.shape[0], ignore_index, "fused_linear_cross_entropy")
    if scale is None:
        scale = inv_count if reduction == "mean" else torch.ones(1, dtype=torch.float32, device=hidden.device)
    wanted = _Wanted(need_hidden, need_weight, need_bias and bias is not None)
    loss, lse, grads = _flce_forward(hidden, weight, bias, target, opts, reduction, scale, chunk, wanted)
    return (loss, lse, *_grads_or_empty(grads, hidden))


@_flce_op.register_fake
def _(hidden, weight, bias, target, scale, ignore_index, label_smoothing, z_loss_scale, softcap, reduction, chunk,
      need_hidden, need_weight, need_bias):
    n_tokens = hidden.shape[0]
    loss = hidden.new_empty((n_tokens,) if reduction == "none" else (), dtype=torch.float32)
    scalar = reduction != "none"
    return (
        loss,
        hidden.new_empty(n_tokens, dtype=torch.float32),
        torch.empty_like(hidden) if scalar and need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if scalar and need_weight else hidden.new_empty(0),
        weight.new_empty(weight.shape[0], dtype=bias.dtype) if scalar and need_bias and bias is not None
        else hidden.new_empty(0),
    )


@torch.library.custom_op("fuseforge::fused_linear_cross_entropy_scale_grads", mutates_args=())
def _flce_scale_grads_op(
    grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor, grad_loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's gradients times grad_output. A custom op's outputs may not alias its inputs, so
    (unlike eager, which scales the saved buffers in place) they are copied first."""
    raise_pending_target_errors()
    out = tuple(g.clone() for g in (grad_hidden, grad_weight, grad_bias))
    scale_unless_one(out, grad_loss)
    return out


@_flce_scale_grads_op.register_fake
def _(grad_hidden, grad_weight, grad_bias, grad_loss):
    return torch.empty_like(grad_hidden), torch.empty_like(grad_weight), torch.empty_like(grad_bias)


@torch.library.custom_op("fuseforge::fused_linear_cross_entropy_backward", mutates_args=())
def _flce_backward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    grad_loss: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss_scale: float,
    softcap: float | None, chunk: int, need_hidden: bool, need_weight: bool, need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduction "none": the gradients recomputed, each empty when not wanted."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
    wanted = _Wanted(need_hidden, need_weight, need_bias and bias is not None)
    return _grads_or_empty(_flce_backward_none(hidden, weight, bias, target, grad_loss, opts, chunk, wanted), hidden)


@_flce_backward_op.register_fake
def _(hidden, weight, bias, target, grad_loss, ignore_index, label_smoothing, z_loss_scale, softcap, chunk,
      need_hidden, need_weight, need_bias):
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        weight.new_empty(weight.shape[0], dtype=bias.dtype) if need_bias and bias is not None else hidden.new_empty(0),
    )


def _flce_setup(ctx, inputs, output):
    hidden, weight, bias, target, _, *options = inputs
    ctx.options = options[:4]  # ignore_index, label_smoothing, z_loss_scale, softcap
    ctx.reduction, ctx.chunk, *ctx.needs = options[4:]
    if ctx.reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, target)
    else:
        ctx.save_for_backward(*output[2:])


def _flce_op_backward(ctx, grad_loss, _grad_lse, *_unused):
    if ctx.reduction == "none":
        hidden, weight, bias, target = ctx.saved_tensors
        grads = _flce_backward_op(hidden, weight, bias, target, grad_loss, *ctx.options, ctx.chunk, *ctx.needs)
    else:
        grads = _flce_scale_grads_op(*ctx.saved_tensors, grad_loss)
    need_bias = ctx.needs[2] and ctx.needs_input_grad[2]
    return (grads[0] if ctx.needs[0] else None, grads[1] if ctx.needs[1] else None,
            grads[2] if need_bias else None) + (None,) * 11


_flce_op.register_autograd(_flce_op_backward, setup_context=_flce_setup)


def _autocast_inputs(hidden, weight, bias):
    """Under torch.autocast, run the head in the autocast dtype, as nn.Linear would."""
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        return t if t is None or t.dtype == dtype else t.to(dtype)

    return cast(hidden), cast(weight), cast(bias)


def _loss_scale(inv_count, reduction, num_items_in_batch, device) -> torch.Tensor:
    """The factor between the summed per-token loss and the returned loss, as 1 fp32 element on `device`."""
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, bool):
            raise TypeError("num_items_in_batch must be an int or a 1-element tensor, got bool")
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1 or num_items_in_batch.dtype == torch.bool:
                raise ValueError(
                    f"num_items_in_batch must be a 1-element numeric tensor, got shape "
                    f"{tuple(num_items_in_batch.shape)} and dtype {num_items_in_batch.dtype}"
                )
            denom = num_items_in_batch.detach().to(device=device, dtype=torch.float32).reshape(1)
            # Checked on the device, without a sync: a count of 0 (nothing to learn from) gives loss 0.
            return torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
        if not isinstance(num_items_in_batch, (int, float)):
            raise TypeError(f"num_items_in_batch must be an int or a tensor, got {type(num_items_in_batch).__name__}")
        if not (math.isfinite(num_items_in_batch) and num_items_in_batch > 0):
            raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch} (a finite count of target tokens)")
        return torch.full((1,), 1.0 / num_items_in_batch, dtype=torch.float32, device=device)
    if reduction == "mean":
        return inv_count
    return torch.ones(1, dtype=torch.float32, device=device)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
):
    """cross_entropy(hidden @ weight.T + bias, target) without materialising the logits.

    hidden [..., H], weight [V, H] (nn.Linear / lm_head layout), bias [V] or None, target [...]
    int64 class indices. Options as in fuseforge.ops.cross_entropy.cross_entropy. The loss is
    fp32. hidden, weight and bias must share one dtype (TypeError otherwise); under
    torch.autocast they are cast to the autocast dtype first, as nn.Linear would.

    num_items_in_batch (reduction="mean" only): divide the summed loss by this count instead of
    by this batch's non-ignored tokens (transformers' gradient-accumulation normalization).
    A tensor count of 0 gives loss 0. return_lse=True returns (loss, lse) with lse fp32 of
    shape target.shape (not differentiable). chunk_size overrides the tokens per chunk
    (default: chunk logits <= max(64 MiB, the size of `hidden`), at least 256 tokens); memory
    scales with it, speed improves up to a point.
    grad_weight is accumulated in the weight's dtype (one rounding per chunk).
    """
    opts = check_loss_options(ignore_index, reduction, label_smoothing, z_loss_scale, softcap)
    check_lm_head_inputs(hidden, weight, bias, target)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    n_vocab, n_hidden = weight.shape
    chunk = check_chunk_size(chunk_size) or default_chunk_tokens(
        n_vocab, hidden.element_size(), hidden.numel() * hidden.element_size()
    )
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(f"num_items_in_batch only applies to reduction='mean', got reduction={reduction!r}")
    flat_target = target.reshape(-1).to(torch.int64).contiguous()
    # 2-D hidden goes in as is (no view): autograd then hands our grad buffers over without copies
    # and still clones them when a graph is retained for another backward.
    flat_hidden = hidden if hidden.dim() == 2 else hidden.reshape(-1, n_hidden)
    if compiling():
        # The scan runs inside the custom op; without a given count the op divides by its result.
        scale = None if num_items_in_batch is None and reduction == "mean" else _loss_scale(
            None, reduction, num_items_in_batch, hidden.device)
        grad = torch.is_grad_enabled()
        loss, lse, *_ = _flce_op(
            flat_hidden.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), flat_target,
            scale, opts.ignore_index, opts.label_smoothing, opts.z_loss_scale, opts.softcap, reduction, chunk,
            grad and hidden.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad,
        )
        return _shaped(loss, lse, target, reduction, return_lse)
    inv_count = scan_targets(flat_target, n_vocab, opts.ignore_index, "fused_linear_cross_entropy")
    scale = _loss_scale(inv_count, reduction, num_items_in_batch, hidden.device)
    loss, lse = _FusedLinearCrossEntropyFunction.apply(
        flat_hidden.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        flat_target,
        opts,
        reduction,
        scale,
        chunk,
        torch.is_grad_enabled(),
    )
    return _shaped(loss, lse, target, reduction, return_lse)


def _shaped(loss, lse, target, reduction, return_lse):
    """The per-token loss (reduction "none") and lse in target's shape."""
    if reduction == "none":
        loss = loss.view(target.shape)
    if return_lse:
        return loss, lse.view(target.shape)
    return loss
