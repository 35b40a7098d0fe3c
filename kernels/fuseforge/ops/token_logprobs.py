"""Log-probabilities of the target tokens under an LM head, per token, without materialising the logits.

Why: DPO, CPO, ORPO, SimPO, KTO and GRPO are all cheap functions of log p(target_t) at each token
(summed or averaged per sequence, or combined per token); only the [tokens, V] logits are costly
(8 GiB of bf16 at 32k tokens and a 128k vocabulary, twice that once upcast). Two ops serve them:

* fused_linear_token_logprobs: log p per token, differentiable. It is fused_linear_cross_entropy's
  per-token path (reduction="none") with the sign flipped, so it runs the same kernels: forward
  streams chunks of logits through the cross-entropy statistics kernels (log-sum-exp and target
  logit per token, fp32 math); backward recomputes each chunk's logits and the cross-entropy
  gradient kernel writes dlogits = g * (onehot - softmax) for the per-token upstream gradient g.
  A loss built on top in torch (per-sequence sums, sigmoids, ...) backpropagates through it.
  Cost: one more logits GEMM than a loss whose gradient is known in forward (4 instead of 3).
* fused_linear_token_objective: for a loss that is a sum of per-token terms, each a function of its
  own token's log-prob only (GRPO's token-level surrogate, whose normalisation is fixed before the
  loss), d loss / d logp_t is known as soon as the chunk's log-probs are. The gradients are then
  computed in the forward sweep (3 GEMMs, no recompute), as fused_linear_cross_entropy's mean path does.

Both take hidden [..., H], weight [V, H] (lm_head layout) and an optional bias [V]; log-probs are fp32
and 0 at tokens whose target is ignore_index. `temperature` divides the logits (the hidden states and
bias are divided, a copy the size of `hidden`), as RL trainers sample and score at a temperature.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from fuseforge.loss_args import IGNORE_INDEX, LossOptions, check_chunk_size
from fuseforge.ops.cross_entropy import ce_forward_stats
from fuseforge.ops.fused_linear_cross_entropy import (
    _autocast_inputs,
    _chunked_sweep,
    _Gradients,
    _Wanted,
    default_chunk_tokens,
    fused_linear_cross_entropy,
)
from fuseforge.ops._shared.scaling import scale_unless_one
from fuseforge.ops.targets import raise_pending_target_errors, scan_targets
from fuseforge.checks import check_int64, check_positive
from fuseforge.ops._shared.lm_head import check_lm_head_inputs
from fuseforge.ops._shared.utils import TRAINING_DTYPES, check_same_device, check_tensor
from fuseforge.ops._shared.vocab_major_cross_entropy import vocab_major_loss_and_lse

# token_loss(logp [n] fp32, rows) -> [n]: the loss terms of tokens `rows` (a slice of the flattened tokens).
TokenLoss = Callable[[torch.Tensor, slice], torch.Tensor]


def _tempered(hidden, bias, temperature: float):
    """Inputs whose head gives logits / temperature (a copy of hidden; the logits are never built)."""
    if temperature == 1.0:
        return hidden, bias
    return hidden / temperature, (None if bias is None else bias / temperature)


def fused_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log_softmax((hidden @ weight.T + bias) / temperature)[target] per token: fp32, shape target.shape.

    0 at tokens whose target is ignore_index (they get no gradient). Differentiable w.r.t. hidden,
    weight and bias: backward recomputes the logits chunk by chunk (see the module docstring).
    Under torch.no_grad (a frozen reference head) nothing is saved.
    """
    # Checked here too: dividing by the temperature would turn an integer hidden or bias into a float one.
    check_lm_head_inputs(hidden, weight, bias, target)
    temperature = check_positive("temperature", temperature)
    hidden, bias = _tempered(hidden, bias, temperature)
    return -fused_linear_cross_entropy(
        hidden, weight, target, bias=bias, ignore_index=ignore_index, reduction="none", chunk_size=chunk_size
    )


def _coefficients(token_loss: TokenLoss, nll: torch.Tensor, valid: torch.Tensor, total: torch.Tensor,
                  rows: slice, need_grad: bool) -> torch.Tensor | None:
    """Add the loss of tokens `rows` to `total`; return -dloss/dlogp per token (fp32), the scale that
    turns the cross-entropy gradient d(-logp)/dz into dloss/dz; None when no gradient is wanted."""
    logp = (-nll[rows]).requires_grad_(need_grad)
    with torch.enable_grad():  # autograd.Function.forward runs without grad mode
        value = token_loss(logp, rows)
        if value.dim() == 0:  # the loss of whole sequences (fused_linear_sequence_objective)
            total += value.detach().to(torch.float32)
        elif value.shape != logp.shape:
            raise ValueError(f"token_loss must return one value per token, shape {tuple(logp.shape)}, "
                             f"got {tuple(value.shape)}")
        else:
            total += torch.where(valid[rows], value.detach(), 0.0).sum(dtype=torch.float32)
        if not need_grad:
            return None
        if not value.requires_grad:
            return torch.zeros_like(logp, dtype=torch.float32)
        (dlogp,) = torch.autograd.grad(value.sum(), logp)
    return (-dlogp).to(torch.float32).contiguous()


class _ChunkStats:
    """Per-token statistics of one sweep, and the callback that turns a chunk's into loss and scale."""

    def __init__(self, n_tokens, device, target, opts, token_loss, need_grad):
        self.nll = torch.empty(n_tokens, dtype=torch.float32, device=device)
        self.lse = torch.empty(n_tokens, dtype=torch.float32, device=device)
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.valid = target != opts.ignore_index
        self.target, self.opts, self.token_loss, self.need_grad = target, opts, token_loss, need_grad

    def __call__(self, start, stop, logits, vocab_major=False):
        rows = slice(start, stop)
        if vocab_major:
            vocab_major_loss_and_lse(logits, self.target[rows], self.opts, self.nll[rows], self.lse[rows])
        else:
            ce_forward_stats(logits, self.target[rows], self.opts, loss_out=self.nll[rows], lse_out=self.lse[rows])
        return _coefficients(self.token_loss, self.nll, self.valid, self.total, rows, self.need_grad)


def _objective_sweep(hidden, weight, bias, target, opts, token_loss, wanted: _Wanted, chunk: int, align: int = 1):
    """One pass: the summed token loss, log-probs, and (if wanted) the gradients of the loss.

    Every chunk (and the first block) starts at a multiple of `align` tokens: token_loss then sees
    whole sequences (or groups of them) when align is their length."""
    n_tokens, n_hidden = hidden.shape
    grads = _Gradients(hidden, weight, bias, wanted) if wanted.any else None
    stats = _ChunkStats(n_tokens, hidden.device, target, opts, token_loss, grads is not None)
    first = min(n_tokens, n_hidden) // align * align
    _chunked_sweep(hidden, weight, bias, target, opts, grads, chunk, first,
                  lambda logits_t: (stats(0, first, logits_t, vocab_major=True), stats.lse[:first]),
                  lambda s, e, logits: (stats(s, e, logits), stats.lse[s:e]))
    return stats.total, -stats.nll, grads


class _TokenObjectiveFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, opts, token_loss, chunk, grad_enabled, align=1):
        wanted = _Wanted(*(grad_enabled and bool(n) for n in ctx.needs_input_grad[:3]))
        with torch.autocast(hidden.device.type, enabled=False):
            total, logps, grads = _objective_sweep(hidden, weight, bias, target, opts, token_loss, wanted, chunk,
                                                   align)
        ctx.has_grads = grads is not None
        if grads is not None:
            ctx.save_for_backward(grads.hidden, grads.weight, grads.bias)
        ctx.mark_non_differentiable(logps)
        ctx.set_materialize_grads(False)
        return total, logps

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total, _grad_logps):
        if grad_total is None or not ctx.has_grads:
            return (None,) * 9
        raise_pending_target_errors()
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale_unless_one((grad_hidden, grad_weight, grad_bias), grad_total)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def fused_linear_token_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    token_loss: TokenLoss,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over non-ignored tokens of token_loss(logp), per-token log-probs) in one sweep over the tokens.

    token_loss(logp, rows) gets the fp32 log-probs of the flattened tokens `rows` (a slice; 0 at
    ignored tokens) and returns their loss terms, differentiably and elementwise: term t may depend
    on logp[t] only (it may use constants indexed by `rows`). Its values at ignored tokens must be
    finite; they are dropped. The gradient of the sum w.r.t. hidden, weight and bias is computed in
    forward and scaled by the upstream gradient in backward (backpropagate once). The log-probs
    (fp32, target.shape) are returned detached, for metrics.
    """
    check_lm_head_inputs(hidden, weight, bias, target)
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable, got {type(token_loss).__name__}")
    ignore_index = check_int64("ignore_index", ignore_index)
    temperature = check_positive("temperature", temperature)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    hidden, bias = _tempered(hidden, bias, temperature)
    return _objective(hidden, weight, bias, target, token_loss, ignore_index, chunk_size, 1,
                      "fused_linear_token_objective")


def _objective(hidden, weight, bias, target, token_loss, ignore_index, chunk_size, align, op_name):
    """The sweep both objectives run, on inputs already cast for autocast: chunks of a multiple of `align`
    tokens (at least one), the targets scanned, the loss and gradients from _TokenObjectiveFunction."""
    n_vocab, n_hidden = weight.shape
    chunk = check_chunk_size(chunk_size) or default_chunk_tokens(
        n_vocab, hidden.element_size(), hidden.numel() * hidden.element_size()
    )
    chunk = max(align, chunk // align * align)
    flat_target = target.reshape(-1).to(torch.int64).contiguous()
    scan_targets(flat_target, n_vocab, ignore_index, op_name)
    total, logps = _TokenObjectiveFunction.apply(
        hidden.reshape(-1, n_hidden).contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        flat_target,
        LossOptions(ignore_index=ignore_index),
        token_loss,
        chunk,
        torch.is_grad_enabled(),
        align,
    )
    return total, logps.view(target.shape)


# group_loss(logps [k * group_size, T] fp32, first: int) -> 0-dim: the loss of sequences first .. first + k*group_size - 1.
GroupLoss = Callable[[torch.Tensor, int], torch.Tensor]


def fused_linear_sequence_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group_loss: GroupLoss,
    bias: torch.Tensor | None = None,
    *,
    group_size: int = 1,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum of group_loss over groups of `group_size` consecutive sequences, per-token log-probs), in one
    sweep with the gradients computed in forward (3 GEMMs, as fused_linear_token_objective).

    For losses of per-sequence statistics (DPO's log-prob sums, KTO's): each chunk holds whole groups (a
    DPO pair is a group of 2 when chosen and rejected rows alternate), so d loss / d logp of its tokens
    is known from the chunk alone. hidden [N, T, H], target [N, T]; group_loss(logps, first) gets the
    fp32 log-probs [k * group_size, T] of sequences first, first + 1, ... (0 at ignored tokens) and
    returns their loss as a 0-dim tensor, differentiably; the groups of one call must not interact.
    Chunks hold at least one group (group_size * T tokens of logits, whatever chunk_size says).
    """
    check_lm_head_inputs(hidden, weight, bias, target, ndim=3)
    if not callable(group_loss):
        raise TypeError(f"group_loss must be callable, got {type(group_loss).__name__}")
    n_seqs, seq_len = target.shape
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or n_seqs % group_size:
        raise ValueError(f"group_size must be a positive integer dividing the {n_seqs} sequences, got {group_size!r}")
    ignore_index = check_int64("ignore_index", ignore_index)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)

    def token_loss(logp: torch.Tensor, rows: slice) -> torch.Tensor:
        return group_loss(logp.view(-1, seq_len), rows.start // seq_len)

    return _objective(hidden, weight, bias, target, token_loss, ignore_index, chunk_size, group_size * seq_len,
                      "fused_linear_sequence_objective")


def check_reference_inputs(
    loss_name: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ref_logps: object,
    ref_hidden: object,
    ref_weight: object,
    ref_bias: object,
    ref_logps_shape: tuple[int, ...],
    ref_logps_meaning: str,
    required: bool,
) -> bool:
    """Validate a reference given as log-probs (`ref_logps`, shape ref_logps_shape) or as a frozen head
    (ref_hidden [..., H_ref] over the same tokens as `hidden`, ref_weight [V, H_ref], ref_bias).
    Returns whether one was given; raises ValueError if both are, or none is and one is `required`."""
    head_given = ref_hidden is not None or ref_weight is not None or ref_bias is not None
    if ref_logps is not None and head_given:
        raise ValueError(f"{loss_name}: give the reference either as ref_logps or as ref_hidden + ref_weight, not both")
    if ref_logps is None and not head_given:
        if required:
            raise ValueError(
                f"{loss_name} needs a reference model: pass ref_logps ({ref_logps_meaning}) or the frozen reference "
                "head as ref_hidden and ref_weight (and ref_bias)"
            )
        return False
    if ref_logps is not None:
        check_tensor("ref_logps", ref_logps, dtypes=TRAINING_DTYPES + (torch.float64,))
        if tuple(ref_logps.shape) != tuple(ref_logps_shape):
            raise ValueError(
                f"ref_logps must have shape {tuple(ref_logps_shape)} ({ref_logps_meaning}), "
                f"got {tuple(ref_logps.shape)}"
            )
        check_same_device(hidden=hidden, ref_logps=ref_logps)
        return True
    if ref_hidden is None or ref_weight is None:
        raise ValueError("ref_hidden and ref_weight go together (ref_bias optional): the reference head needs both")
    check_lm_head_inputs(ref_hidden, ref_weight, ref_bias, None, prefix="ref_", ndim=hidden.dim())
    if ref_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"ref_hidden must cover the same sequences and positions as hidden: leading shape "
            f"{tuple(ref_hidden.shape[:-1])} vs {tuple(hidden.shape[:-1])}"
        )
    if ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"ref_weight has vocabulary {ref_weight.shape[0]} but weight has {weight.shape[0]}: policy and reference "
            "must share one vocabulary"
        )
    check_same_device(hidden=hidden, ref_hidden=ref_hidden)
    return True


def reference_token_logprobs(
    target: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    ref_bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-token log-probs of a frozen reference head (no graph, no gradient to any of its tensors)."""
    with torch.no_grad():
        return fused_linear_token_logprobs(
            ref_hidden.detach(), ref_weight.detach(), target, None if ref_bias is None else ref_bias.detach(),
            ignore_index=ignore_index, temperature=temperature, chunk_size=chunk_size,
        )
