"""GRPO-family policy loss (grpo, dr_grpo, dapo, bnpo) from hidden states and the LM head.

Formulas as TRL 1.16's GRPOTrainer._compute_loss, per completion token t of sequence i
(lp = policy log-prob, old = behaviour log-probs, ref = reference log-probs, A = advantage):

    ratio   = exp(lp - old)                    (token level; sequence level: exp(mean_t(lp - old)))
    clipped = clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    ratio   = min(ratio, delta)                if delta is set (two-sided clipping)
    loss_t  = -min(ratio * A, clipped * A) + beta * kl_t
    kl_t    = exp(ref - lp) - (ref - lp) - 1   (k3 estimator), times the unclipped ratio when
                                               use_bias_correction_kl (TRL 1.16's default)

`old` defaults to lp detached (one policy update per generation: ratio 1, gradient A).
Normalisation of sum_t loss_t * mask_t (mask = target != ignore_index):
    grpo:    mean over sequences of (sum over the sequence / its token count, at least 1)
    bnpo:    / (tokens in this batch, at least 1)
    dr_grpo: / (batch size * max_completion_length)   (default: T, the padded completion length)
    dapo:    / num_items_in_batch (default: tokens in this batch, at least 1)
TRL then divides grpo, bnpo and dr_grpo by the gradient-accumulation steps and rescales dapo's
num_items_in_batch (a count over the whole generation batch) by processes and steps; this op
returns the per-micro-batch loss before that, so gradient accumulation is the caller's:
* grpo and dr_grpo: averaging the micro-batch losses gives the full-batch loss exactly (equal
  micro-batch sizes);
* dapo: with num_items_in_batch = the token count of the full batch, summing the micro-batch
  losses gives the full-batch loss exactly;
* bnpo: each micro-batch is normalised by its own token count, so micro-batches only add up to
  the full batch when they hold equal token counts (TRL shares this).

Token-level importance sampling makes the loss a sum of terms each depending on its own token's
log-prob only, so the gradients are computed in the forward sweep (fused_linear_token_objective:
3 GEMMs, no recompute). Sequence-level importance sampling (GSPO) couples a sequence's tokens and
goes through fused_linear_token_logprobs, whose backward recomputes the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fuseforge.loss_args import IGNORE_INDEX
from fuseforge.ops.preference import check_choice, check_nonnegative
from fuseforge.ops.token_logprobs import (
    check_reference_inputs,
    fused_linear_token_logprobs,
    fused_linear_token_objective,
    reference_token_logprobs,
)
from fuseforge.checks import check_int64, check_positive
from fuseforge.ops._shared.lm_head import check_lm_head_inputs
from fuseforge.ops._shared.utils import FLOAT_DTYPES, check_same_device, check_tensor

GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOOptions:
    """Validated loss options (shared by the function and the module)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    max_completion_length: int | None = None
    temperature: float = 1.0


def check_grpo_options(
    loss_type="dapo", beta=0.0, epsilon_low=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
    use_bias_correction_kl=True, max_completion_length=None, temperature=1.0,
) -> GRPOOptions:
    """Raise ValueError/TypeError naming the option; epsilon_high defaults to epsilon_low as in TRL."""
    loss_type = check_choice("loss_type", loss_type, GRPO_LOSS_TYPES)
    level = check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    beta = check_nonnegative("beta", beta)
    epsilon_low = check_nonnegative("epsilon_low", epsilon_low)
    epsilon_high = epsilon_low if epsilon_high is None else check_nonnegative("epsilon_high", epsilon_high)
    if epsilon_low >= 1.0:
        raise ValueError(f"epsilon_low must be < 1 (the ratio is clipped at 1 - epsilon_low > 0), got {epsilon_low}")
    if delta is not None:
        delta = check_positive("delta", delta)
        if delta <= 1.0 + epsilon_high:
            raise ValueError(f"delta must exceed 1 + epsilon_high = {1.0 + epsilon_high}, got {delta}")
    if not isinstance(use_bias_correction_kl, bool):
        raise TypeError(f"use_bias_correction_kl must be a bool, got {type(use_bias_correction_kl).__name__}")
    if max_completion_length is not None:
        if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int):
            raise TypeError(f"max_completion_length must be an int, got {type(max_completion_length).__name__}")
        if max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    temperature = check_positive("temperature", temperature)
    return GRPOOptions(loss_type, beta, epsilon_low, epsilon_high, delta, level, use_bias_correction_kl,
                       max_completion_length, temperature)


@dataclass
class GRPOOutput:
    """The loss and TRL's GRPO metrics (0-dim tensors, detached; kl is None when beta == 0)."""

    loss: torch.Tensor
    per_token_logps: torch.Tensor  # [B, T], detached, 0 at ignored tokens
    kl: torch.Tensor | None
    clip_ratio_low: torch.Tensor
    clip_ratio_high: torch.Tensor
    clip_ratio_region: torch.Tensor

    def metrics(self) -> dict[str, torch.Tensor]:
        out = {
            "clip_ratio/low_mean": self.clip_ratio_low,
            "clip_ratio/high_mean": self.clip_ratio_high,
            "clip_ratio/region_mean": self.clip_ratio_region,
        }
        if self.kl is not None:
            out["kl"] = self.kl
        return out


def grpo_token_terms(logp, old, ref, advantages, opts: GRPOOptions, log_ratio_override=None):
    """(per-token loss before masking, ratio after the delta clip, per-token kl or None), all broadcast.

    log_ratio_override: the log importance weight to use instead of logp - old (sequence level)."""
    log_ratio = logp - old if log_ratio_override is None else log_ratio_override
    ratio = torch.exp(log_ratio)
    kl = None
    if opts.beta != 0.0:
        diff = ref - logp
        kl = torch.exp(diff) - diff - 1.0
        if opts.use_bias_correction_kl:
            kl = kl * ratio
    clipped = torch.clamp(ratio, 1.0 - opts.epsilon_low, 1.0 + opts.epsilon_high)
    if opts.delta is not None:
        ratio = torch.clamp(ratio, max=opts.delta)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if kl is not None:
        loss = loss + opts.beta * kl
    return loss, ratio, kl


def token_weights(mask: torch.Tensor, opts: GRPOOptions, num_items_in_batch) -> torch.Tensor:
    """w [B, T] (fp32) such that the loss is sum(loss_t * w_t): the loss_type's normalisation folded in."""
    m = mask.to(torch.float32)
    n_seq, n_pos = m.shape
    if opts.loss_type == "grpo":
        return m / m.sum(-1, keepdim=True).clamp(min=1.0) / n_seq
    if opts.loss_type == "dr_grpo":
        return m / (n_seq * (opts.max_completion_length or n_pos))
    if opts.loss_type == "dapo" and num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            return m / num_items_in_batch.detach().to(device=m.device, dtype=torch.float32).reshape(()).clamp(min=1.0)
        return m / max(float(num_items_in_batch), 1.0)
    return m / m.sum().clamp(min=1.0)  # bnpo, and dapo without a global count


def _metrics(mask, ratio, kl, advantages, opts: GRPOOptions):
    """TRL's global masked means of the clip indicators and of kl (ratio [B, 1] at sequence level)."""
    m = mask.to(torch.float32)

    def masked_mean(x):
        if x.shape[-1] == 1 and m.shape[-1] != 1:  # one value per sequence (sequence-level ratio)
            return x.float().sum() / max(x.shape[0], 1)
        return (x.float() * m).sum() / m.sum().clamp(min=1.0)

    low = (ratio < 1.0 - opts.epsilon_low) & (advantages < 0)
    high = (ratio > 1.0 + opts.epsilon_high) & (advantages > 0)
    return (
        None if kl is None else masked_mean(kl),
        masked_mean(low),
        masked_mean(high),
        masked_mean(low | high),
    )


def _check_per_token(name, t, shape, hidden):
    check_tensor(name, t, dtypes=FLOAT_DTYPES)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (one value per completion token), "
                         f"got {tuple(t.shape)}")
    check_same_device(hidden=hidden, **{name: t})


def _check_num_items(num_items_in_batch, opts, device):
    if num_items_in_batch is None:
        return
    if opts.loss_type != "dapo":
        raise ValueError(f"num_items_in_batch only applies to loss_type='dapo', got loss_type={opts.loss_type!r}")
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1 or num_items_in_batch.dtype == torch.bool:
            raise ValueError("num_items_in_batch must be a number or a 1-element numeric tensor")
        if num_items_in_batch.device != device:
            raise ValueError(f"num_items_in_batch is on {num_items_in_batch.device} but hidden is on {device}")
        return
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
        raise TypeError(f"num_items_in_batch must be a number or a tensor, got {type(num_items_in_batch).__name__}")
    if not (math.isfinite(num_items_in_batch) and num_items_in_batch > 0):
        raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch}")


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    use_bias_correction_kl: bool = True,
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    options: GRPOOptions | None = None,
) -> GRPOOutput:
    """GRPO-family clipped policy loss of completions, as TRL 1.16 (see the module docstring).

    hidden [B, T, H]: the states that predict the completion tokens target [B, T] (ignore_index at
    padding); advantages [B] or [B, T]; old_logps, ref_logps [B, T] (per-token, as the trainer
    stores them) or the frozen reference head ref_hidden [B, T, H_ref] + ref_weight (+ ref_bias),
    needed when beta > 0 (ignored when beta == 0). advantages, old and reference log-probs are
    constants. `options` (from check_grpo_options) replaces the individual options.
    """
    opts = options if options is not None else check_grpo_options(
        loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level, use_bias_correction_kl,
        max_completion_length, temperature,
    )
    check_lm_head_inputs(hidden, weight, bias, target, ndim=3)
    check_int64("ignore_index", ignore_index)
    n_seq, n_pos = target.shape
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    if tuple(advantages.shape) not in ((n_seq,), (n_seq, n_pos)):
        raise ValueError(f"advantages must have shape ({n_seq},) or ({n_seq}, {n_pos}), got {tuple(advantages.shape)}")
    check_same_device(hidden=hidden, advantages=advantages)
    if old_logps is not None:
        _check_per_token("old_logps", old_logps, (n_seq, n_pos), hidden)
    use_ref = opts.beta != 0.0
    if use_ref:
        check_reference_inputs(
            f"GRPO with beta={opts.beta}", hidden, weight, ref_logps, ref_hidden, ref_weight, ref_bias,
            ref_logps_shape=(n_seq, n_pos), ref_logps_meaning="per-token reference log-probs [B, T]", required=True,
        )
    _check_num_items(num_items_in_batch, opts, hidden.device)

    mask = target != ignore_index
    zero = torch.zeros((), dtype=torch.float32, device=hidden.device)

    def constant(t):  # fp32, detached, 0 at ignored tokens (whatever padding values the caller left there)
        return torch.where(mask, t.detach().to(torch.float32), zero)

    adv = advantages.detach().to(torch.float32)
    adv = constant(adv if adv.dim() == 2 else adv[:, None].expand(n_seq, n_pos))
    old = None if old_logps is None else constant(old_logps)
    ref = None
    if use_ref:
        if ref_logps is None:
            ref_logps = reference_token_logprobs(target, ref_hidden, ref_weight, ref_bias, ignore_index=ignore_index,
                                                 temperature=opts.temperature, chunk_size=chunk_size)
        ref = constant(ref_logps)
    weights = token_weights(mask, opts, num_items_in_batch)

    if opts.importance_sampling_level == "token":
        flat = {name: None if t is None else t.reshape(-1) for name, t in
                dict(adv=adv, old=old, ref=ref, w=weights).items()}

        def token_loss(lp, rows):
            old_rows = lp.detach() if flat["old"] is None else flat["old"][rows]
            ref_rows = None if flat["ref"] is None else flat["ref"][rows]
            loss, _, _ = grpo_token_terms(lp, old_rows, ref_rows, flat["adv"][rows], opts)
            return loss * flat["w"][rows]

        loss, logps = fused_linear_token_objective(
            hidden, weight, target, token_loss, bias, ignore_index=ignore_index, temperature=opts.temperature,
            chunk_size=chunk_size,
        )
        with torch.no_grad():
            _, ratio, kl = grpo_token_terms(logps, logps if old is None else old, ref, adv, opts)
    else:
        logps_graph = fused_linear_token_logprobs(hidden, weight, target, bias, ignore_index=ignore_index,
                                                  temperature=opts.temperature, chunk_size=chunk_size)
        old_seq = logps_graph.detach() if old is None else old
        counts = mask.sum(-1, keepdim=True).clamp(min=1).to(torch.float32)
        seq_log_ratio = ((logps_graph - old_seq) * mask).sum(-1, keepdim=True) / counts
        per_token, ratio, kl = grpo_token_terms(logps_graph, old_seq, ref, adv, opts, log_ratio_override=seq_log_ratio)
        loss = (per_token * weights).sum()
        logps = logps_graph.detach()
        ratio, kl = ratio.detach(), None if kl is None else kl.detach()

    # TRL broadcasts [B] advantages as [B, 1]: at sequence level its clip metrics are then per-sequence means.
    adv_for_metrics = advantages.detach().to(torch.float32)[:, None] if advantages.dim() == 1 else adv
    kl_mean, low, high, region = _metrics(mask, ratio, kl, adv_for_metrics, opts)
    return GRPOOutput(loss, logps, kl_mean, low, high, region)
