"""Preference-optimisation losses (DPO, CPO, SimPO, ORPO, KTO) from hidden states and the LM head.

Why here: each loss is a cheap function of per-sequence sums (or means) of the target tokens'
log-probs; only the [tokens, V] logits are expensive. The policy runs through
fused_linear_sequence_objective: the sequences of a pair are put next to each other, so every
chunk of logits holds whole pairs (KTO: whole sequences), the pair losses of a chunk are known
as soon as its log-probs are, and the gradients are computed in the same sweep (3 logits GEMMs,
no recompute in backward). A `chunk_size` below one pair's tokens (very long sequences) takes
fused_linear_token_logprobs instead: chunks of that size, and backward recomputes the logits. The reference head, when given as hidden states and weight, runs
through fused_linear_token_logprobs under no_grad in the same call.

Conventions (TRL's concatenated batch):
* Paired losses take chosen and rejected sequences stacked along dim 0: hidden [2B, T, H] and
  target [2B, T], rows 0..B-1 chosen, rows B..2B-1 rejected (pair i is rows i and B + i).
  hidden holds the states that predict target (already shifted), padding and prompt tokens are
  ignore_index in target.
* A sequence's log-prob is the sum over its non-ignored target tokens; "average" divides it by
  their count, at least 1 (a sequence with no target tokens has sum and average 0; TRL's CPO/ORPO
  divide 0 by 0 there and get NaN).
* Reference log-probs: either `ref_logps` [2B] (per-sequence sums over the same tokens, e.g.
  precomputed) or `ref_hidden` [2B, T, H_ref] + `ref_weight` [V, H_ref] (+ `ref_bias`).
* Losses are means over pairs (KTO: over sequences) as in TRL 1.16; rewards and log-probs in the
  returned output are detached, per pair (metrics() averages them under TRL's metric names
  without a host sync). Gradient accumulation: a mean over pairs splits exactly (average the
  micro-batch losses); the NLL terms of CPO and ORPO are means over the chosen tokens pooled over
  the batch, so they split exactly only when micro-batches hold equal token counts.

Formulas (beta > 0; pi = policy, ref = reference; c/r = chosen/rejected; h = logratio margin):
* DPO (TRL DPOTrainer, reverse KL): h = (log pi_c - log ref_c) - (log pi_r - log ref_r).
  sigmoid: -(1 - ls) log sig(beta h) - ls log sig(-beta h)  (ls = label_smoothing: cDPO; TRL 1.16
  ignores label_smoothing for sigmoid, so ls = 0 is exactly TRL); hinge: relu(1 - beta h);
  ipo: (h_avg - 1 / (2 beta))^2 with h_avg built from per-token averages (TRL's normalisation);
  robust: ((1 - ls)(-log sig(beta h)) + ls log sig(-beta h)) / (1 - 2 ls), ls in [0, 0.5).
  Rewards: beta * (log pi - log ref) of the summed log-probs, for every loss type.
* CPO (TRL CPOTrainer): h = log pi_c - log pi_r (sums; averages for ipo and simpo), no reference;
  sigmoid (with label smoothing), hinge, ipo as above; simpo: h - simpo_gamma / beta in the
  sigmoid form; plus cpo_alpha * NLL of the chosen tokens. Rewards: beta * log pi.
* SimPO: CPO with loss_type="simpo" and cpo_alpha=0 (beta * (avg_c - avg_r) - gamma).
* ORPO (TRL ORPOTrainer): averages; log_odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r));
  loss = NLL(chosen) - beta * mean(log sig(log_odds)). Rewards: beta * average log pi.
  A pair with an empty chosen or rejected sequence has no odds (its average is 0, probability 1):
  its odds-ratio term is 0.
* KTO (TRL KTOTrainer): unpaired, desirable [N] bool; kl = max(kl, 0) estimated from mismatched
  completions (fused_linear_kto_kl); desirable: w_d (1 - sig(beta (lr - kl))), undesirable:
  w_u (1 - sig(beta (kl - lr))), lr = log pi - log ref (sums); mean over the N sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fuseforge.loss_args import IGNORE_INDEX
from fuseforge.ops.token_logprobs import (
    check_reference_inputs,
    fused_linear_sequence_objective,
    fused_linear_token_logprobs,
    reference_token_logprobs,
)
from fuseforge.checks import check_int64, check_positive
from fuseforge.ops._shared.lm_head import check_lm_head_inputs
from fuseforge.ops._shared.utils import check_same_device, check_tensor

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


# ------------------------------------------------------------------------------------ options


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}: expected one of {allowed}")
    return value


def check_beta(beta: object) -> float:
    """beta scales every preference reward: it must be a finite number > 0."""
    return check_positive("beta", beta)


def check_nonnegative(name: str, value: object) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if not (v >= 0.0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return v


def check_label_smoothing(label_smoothing: object, loss_type: str) -> float:
    """In [0, 0.5) for robust DPO (a flip probability), [0, 1] for the sigmoid forms, 0 elsewhere."""
    ls = check_nonnegative("label_smoothing", label_smoothing)
    if loss_type == "robust" and not ls < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5) for loss_type='robust', got {label_smoothing}")
    if loss_type in ("sigmoid", "simpo") and ls > 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    if loss_type not in ("sigmoid", "simpo", "robust") and ls != 0.0:
        raise ValueError(f"label_smoothing applies to loss_type 'sigmoid', 'simpo' and 'robust', not {loss_type!r}")
    return ls


# ------------------------------------------------------------------------------------ outputs


@dataclass
class PreferenceOutput:
    """A paired preference loss and its per-pair statistics (detached, shape [B])."""

    loss: torch.Tensor
    chosen_logps: torch.Tensor  # the sequence log-probs the loss used (sums, or averages for ipo/simpo/orpo)
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extra: dict = field(default_factory=dict)  # nll_loss, log_odds_ratio, log_odds_chosen (0-dim tensors)

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> torch.Tensor:
        return (self.chosen_rewards > self.rejected_rewards).float()

    def metrics(self) -> dict[str, torch.Tensor]:
        """Batch means under TRL's metric names, as 0-dim tensors (no host sync)."""
        out = {
            "rewards/chosen": self.chosen_rewards.mean(),
            "rewards/rejected": self.rejected_rewards.mean(),
            "rewards/accuracies": self.accuracies.mean(),
            "rewards/margins": self.margins.mean(),
            "logps/chosen": self.chosen_logps.mean(),
            "logps/rejected": self.rejected_logps.mean(),
        }
        out.update(self.extra)
        return out


@dataclass
class KTOOutput:
    """The KTO loss and per-sequence statistics (detached, shape [N]); `desirable` says which is which."""

    loss: torch.Tensor
    logps: torch.Tensor
    rewards: torch.Tensor
    desirable: torch.Tensor
    kl: torch.Tensor  # the clamped KL estimate the loss used (0-dim)

    def metrics(self) -> dict[str, torch.Tensor]:
        """TRL's KTO metrics as 0-dim tensors: means over the desirable / undesirable sequences (0 if none)."""
        d = self.desirable.float()
        n_d, n_u = d.sum(), (1.0 - d).sum()

        def mean(x, w, n):
            return (x * w).sum() / n.clamp(min=1.0)

        out = {
            "kl": self.kl,
            "rewards/chosen": mean(self.rewards, d, n_d),
            "rewards/rejected": mean(self.rewards, 1.0 - d, n_u),
            "logps/chosen": mean(self.logps, d, n_d),
            "logps/rejected": mean(self.logps, 1.0 - d, n_u),
        }
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


# ------------------------------------------------------------------------------------ shared steps


def _check_policy(hidden, weight, bias, target, ignore_index, paired: bool) -> int:
    """Validate the policy head and the stacking; return B (pairs) or N (sequences)."""
    check_lm_head_inputs(hidden, weight, bias, target, ndim=3)
    check_int64("ignore_index", ignore_index)
    n = hidden.shape[0]
    if n == 0:
        raise ValueError("hidden holds no sequences (batch 0)")
    if paired and n % 2:
        raise ValueError(
            f"hidden holds chosen and rejected sequences stacked along dim 0 (first half chosen, second half "
            f"rejected), so its batch must be even; got {n}"
        )
    return n // 2 if paired else n


def _check_reference(loss_name, hidden, weight, ref_logps, ref_hidden, ref_weight, ref_bias, required=True) -> bool:
    return check_reference_inputs(
        loss_name, hidden, weight, ref_logps, ref_hidden, ref_weight, ref_bias,
        ref_logps_shape=(hidden.shape[0],),
        ref_logps_meaning="per-sequence sums of reference log-probs over the target tokens, stacked like hidden",
        required=required,
    )


def _side_by_side(x: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """[chosen; rejected] stacked rows -> rows c0, r0, c1, r1, ... (a copy; differentiable)."""
    return torch.stack((x[:n_pairs], x[n_pairs:]), 1).reshape(x.shape)


def _stacked(x: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """The inverse of _side_by_side."""
    return x.reshape(n_pairs, 2, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def _objective(hidden, weight, target, bias, ignore_index, chunk_size, group_loss, group_size):
    """(the summed group_loss, the token log-probs [N, T]) of the policy head.

    One sweep with whole groups per chunk (fused_linear_sequence_objective), unless chunk_size caps the
    logits below one group's tokens (very long sequences): then the token log-probs come from
    fused_linear_token_logprobs, whose backward recomputes the logits (one more GEMM), and group_loss
    takes the whole batch at once."""
    if chunk_size is not None and chunk_size < group_size * target.shape[1]:
        token = fused_linear_token_logprobs(hidden, weight, target, bias, ignore_index=ignore_index,
                                            chunk_size=chunk_size)
        return group_loss(token, 0), token.detach()
    return fused_linear_sequence_objective(hidden, weight, target, group_loss, bias, group_size=group_size,
                                           ignore_index=ignore_index, chunk_size=chunk_size)


def _pair_objective(hidden, weight, target, bias, ignore_index, chunk_size, n_pairs, pair_loss):
    """(mean over pairs of pair_loss, the policy's token log-probs [2B, T] in the stacked order).

    pair_loss(chosen [k, T], rejected [k, T], pairs: slice) -> [k] losses of pairs `pairs` from their
    token log-probs (fp32, 0 at ignored tokens); a chunk of logits holds whole pairs (see _objective)."""
    def group_loss(logps: torch.Tensor, first: int) -> torch.Tensor:
        pairs = slice(first // 2, first // 2 + logps.shape[0] // 2)
        return pair_loss(logps[0::2], logps[1::2], pairs).sum() / n_pairs

    loss, token = _objective(_side_by_side(hidden, n_pairs), weight, _side_by_side(target, n_pairs), bias,
                             ignore_index, chunk_size, group_loss, group_size=2)
    return loss, _stacked(token, n_pairs)


def _reference_sums(target, ref_logps, ref_hidden, ref_weight, ref_bias, ignore_index, chunk_size):
    if ref_logps is not None:
        return ref_logps.detach().to(torch.float32)
    token = reference_token_logprobs(target, ref_hidden, ref_weight, ref_bias, ignore_index=ignore_index,
                                     chunk_size=chunk_size)
    return token.sum(-1)


def _smoothed_sigmoid_loss(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - ls) log sig(z) - ls log sig(-z): the sigmoid loss against labels flipped with probability ls."""
    loss = -F.logsigmoid(z)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-z)
    return loss


def _check_nll_target(nll_target, target, ignore_index):
    """nll_target (the tokens the NLL term covers, e.g. prompt + response as TRL's ORPO) must agree
    with target wherever both hold a token: one head pass then serves both."""
    if nll_target is None:
        return
    check_tensor("nll_target", nll_target, dtypes=None)
    if nll_target.is_floating_point() or nll_target.dtype == torch.bool:
        raise TypeError(f"nll_target must hold integer class indices, got dtype {nll_target.dtype}")
    if nll_target.shape != target.shape:
        raise ValueError(f"nll_target must have target's shape {tuple(target.shape)}, got {tuple(nll_target.shape)}")
    check_same_device(target=target, nll_target=nll_target)
    both = (target != ignore_index) & (nll_target != ignore_index)
    if bool((both & (target != nll_target)).any()):  # one host sync, only when nll_target is given
        raise ValueError("nll_target and target disagree at a position where both hold a token")


def _nll_parts(target, nll_target, ignore_index, n_pairs):
    """The head's targets (target, else nll_target where only it holds a token), the preference mask, the
    chosen NLL mask [B, T] (fp32) and the pooled count of its tokens (at least 1)."""
    mask = target != ignore_index
    head_target = target if nll_target is None else torch.where(mask, target, nll_target)
    nll_mask = (mask if nll_target is None else nll_target != ignore_index)[:n_pairs].to(torch.float32)
    return head_target, mask, nll_mask, nll_mask.sum().clamp(min=1.0)


# ------------------------------------------------------------------------------------ losses


def fused_linear_dpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> PreferenceOutput:
    """DPO (Rafailov et al. 2023) and its sigmoid / hinge / ipo / robust variants, as TRL 1.16's DPOTrainer
    (see the module docstring for the formulas and the stacked [chosen; rejected] layout)."""
    loss_type = check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    beta = check_beta(beta)
    ls = check_label_smoothing(label_smoothing, loss_type)
    n_pairs = _check_policy(hidden, weight, bias, target, ignore_index, paired=True)
    _check_reference("DPO", hidden, weight, ref_logps, ref_hidden, ref_weight, ref_bias)

    ref_sums = _reference_sums(target, ref_logps, ref_hidden, ref_weight, ref_bias, ignore_index, chunk_size)
    counts = (target != ignore_index).sum(-1).to(torch.float32).clamp(min=1.0)

    def pair_loss(chosen, rejected, pairs):
        chosen_lr = chosen.sum(-1) - ref_sums[:n_pairs][pairs]
        rejected_lr = rejected.sum(-1) - ref_sums[n_pairs:][pairs]
        margin = chosen_lr - rejected_lr
        if loss_type == "sigmoid":
            return _smoothed_sigmoid_loss(beta * margin, ls)
        if loss_type == "hinge":
            return torch.relu(1.0 - beta * margin)
        if loss_type == "ipo":  # per-token averages: TRL's normalisation of IPO
            avg = chosen_lr / counts[:n_pairs][pairs] - rejected_lr / counts[n_pairs:][pairs]
            return (avg - 1.0 / (2.0 * beta)) ** 2
        # robust (Chowdhury et al. 2024): unbiased under label flips with probability ls
        return ((1.0 - ls) * -F.logsigmoid(beta * margin) + ls * F.logsigmoid(-beta * margin)) / (1.0 - 2.0 * ls)

    loss, token = _pair_objective(hidden, weight, target, bias, ignore_index, chunk_size, n_pairs, pair_loss)
    sums = token.sum(-1)
    logratios = sums - ref_sums
    return PreferenceOutput(
        loss=loss,
        chosen_logps=sums[:n_pairs],
        rejected_logps=sums[n_pairs:],
        chosen_rewards=beta * logratios[:n_pairs],
        rejected_rewards=beta * logratios[n_pairs:],
    )


def fused_linear_cpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    simpo_gamma: float = 0.5,
    nll_target: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> PreferenceOutput:
    """CPO (Xu et al. 2024) as TRL 1.16's CPOTrainer: a reference-free preference loss on the policy's
    sequence log-probs plus cpo_alpha * NLL of the chosen tokens (of nll_target if given)."""
    loss_type = check_choice("loss_type", loss_type, CPO_LOSS_TYPES)
    beta = check_beta(beta)
    ls = check_label_smoothing(label_smoothing, loss_type)
    cpo_alpha = check_nonnegative("cpo_alpha", cpo_alpha)
    simpo_gamma = check_nonnegative("simpo_gamma", simpo_gamma)
    n_pairs = _check_policy(hidden, weight, bias, target, ignore_index, paired=True)
    _check_nll_target(nll_target, target, ignore_index)

    head_target, mask, nll_mask, nll_count = _nll_parts(target, nll_target, ignore_index, n_pairs)
    counts = mask.sum(-1).to(torch.float32).clamp(min=1.0)
    averaged = loss_type in ("ipo", "simpo")

    def pair_loss(chosen, rejected, pairs):
        c = (chosen * mask[:n_pairs][pairs]).sum(-1)
        r = (rejected * mask[n_pairs:][pairs]).sum(-1)
        if averaged:
            c, r = c / counts[:n_pairs][pairs], r / counts[n_pairs:][pairs]
        h = c - r
        if loss_type == "simpo":
            per_pair = _smoothed_sigmoid_loss(beta * (h - simpo_gamma / beta), ls)
        elif loss_type == "sigmoid":
            per_pair = _smoothed_sigmoid_loss(beta * h, ls)
        elif loss_type == "hinge":
            per_pair = torch.relu(1.0 - beta * h)
        else:  # ipo on averaged log-probs
            per_pair = (h - 1.0 / (2.0 * beta)) ** 2
        if cpo_alpha:  # the pooled chosen NLL, this chunk's share (per pair, it sums to the whole)
            per_pair = per_pair - cpo_alpha * n_pairs * (chosen * nll_mask[pairs]).sum(-1) / nll_count
        return per_pair

    loss, token = _pair_objective(hidden, weight, head_target, bias, ignore_index, chunk_size, n_pairs, pair_loss)
    logps = (token * mask).sum(-1)
    if averaged:
        logps = logps / counts
    # TRL neither adds nor reports the NLL when cpo_alpha is 0
    nll = -(token[:n_pairs] * nll_mask).sum() / nll_count if cpo_alpha else torch.zeros((), device=token.device)
    return PreferenceOutput(
        loss=loss,
        chosen_logps=logps[:n_pairs],
        rejected_logps=logps[n_pairs:],
        chosen_rewards=beta * logps[:n_pairs],
        rejected_rewards=beta * logps[n_pairs:],
        extra={"nll_loss": nll},
    )


def fused_linear_simpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 0.0,
    nll_target: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> PreferenceOutput:
    """SimPO (Meng et al. 2024): -log sig(beta * (avg log pi_c - avg log pi_r) - gamma), no reference;
    TRL runs it as CPO with loss_type="simpo" (defaults beta=0.1, gamma=0.5; the paper uses beta ~2).
    cpo_alpha > 0 adds CPO's NLL term (CPO-SimPO)."""
    return fused_linear_cpo_loss(
        hidden, weight, target, bias, beta=beta, loss_type="simpo", label_smoothing=label_smoothing,
        cpo_alpha=cpo_alpha, simpo_gamma=gamma, nll_target=nll_target, ignore_index=ignore_index,
        chunk_size=chunk_size,
    )


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0 without cancellation (Maechler 2012: switch at -log 2)."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def fused_linear_orpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    nll_target: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> PreferenceOutput:
    """ORPO (Hong et al. 2024) as TRL 1.16's ORPOTrainer: NLL(chosen) - beta * mean log sig(log odds ratio)
    on per-token-averaged log-probs. TRL's NLL covers prompt and response: pass those labels as
    nll_target (default: target, the response only)."""
    beta = check_beta(beta)
    n_pairs = _check_policy(hidden, weight, bias, target, ignore_index, paired=True)
    _check_nll_target(nll_target, target, ignore_index)

    head_target, mask, nll_mask, nll_count = _nll_parts(target, nll_target, ignore_index, n_pairs)
    counts = mask.sum(-1).to(torch.float32)

    def odds(chosen_avg, rejected_avg, has_odds):
        """(log sig(log odds ratio), log odds ratio), 0 for a pair without odds."""
        # An empty sequence has average 0 (probability 1): infinite odds. Such a pair gets no odds-ratio term,
        # and its inputs are replaced before the log so that no inf reaches the backward pass.
        safe_c = torch.where(has_odds, chosen_avg, -1.0)
        safe_r = torch.where(has_odds, rejected_avg, -1.0)
        log_odds = (safe_c - safe_r) - (log1mexp(safe_c) - log1mexp(safe_r))
        return torch.where(has_odds, F.logsigmoid(log_odds), 0.0), torch.where(has_odds, log_odds, 0.0)

    def pair_loss(chosen, rejected, pairs):
        c_count, r_count = counts[:n_pairs][pairs], counts[n_pairs:][pairs]
        c = (chosen * mask[:n_pairs][pairs]).sum(-1) / c_count.clamp(min=1.0)
        r = (rejected * mask[n_pairs:][pairs]).sum(-1) / r_count.clamp(min=1.0)
        ratio, _ = odds(c, r, (c_count > 0) & (r_count > 0))
        nll_share = -n_pairs * (chosen * nll_mask[pairs]).sum(-1) / nll_count
        return nll_share - beta * ratio

    loss, token = _pair_objective(hidden, weight, head_target, bias, ignore_index, chunk_size, n_pairs, pair_loss)
    avg = (token * mask).sum(-1) / counts.clamp(min=1.0)
    ratio, log_odds = odds(avg[:n_pairs], avg[n_pairs:], (counts[:n_pairs] > 0) & (counts[n_pairs:] > 0))
    nll = -(token[:n_pairs] * nll_mask).sum() / nll_count
    return PreferenceOutput(
        loss=loss,
        chosen_logps=avg[:n_pairs],
        rejected_logps=avg[n_pairs:],
        chosen_rewards=beta * avg[:n_pairs],
        rejected_rewards=beta * avg[n_pairs:],
        extra={"nll_loss": nll, "log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean()},
    )


def _check_kl(kl, device) -> torch.Tensor:
    if isinstance(kl, torch.Tensor):
        if kl.numel() != 1 or not kl.is_floating_point():
            raise ValueError(f"kl must be a number or a 1-element float tensor, got shape {tuple(kl.shape)} "
                             f"and dtype {kl.dtype}")
        if kl.device != device:
            raise ValueError(f"kl is on {kl.device} but hidden is on {device}; move them to one device")
        return kl.detach().to(torch.float32).reshape(())
    if isinstance(kl, bool) or not isinstance(kl, (int, float)) or not math.isfinite(kl):
        raise ValueError(f"kl must be a finite number or a 1-element tensor, got {kl!r}")
    return torch.tensor(float(kl), dtype=torch.float32, device=device)


def fused_linear_kto_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    desirable: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    kl: torch.Tensor | float | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> KTOOutput:
    """KTO (Ethayarajh et al. 2024) as TRL 1.16's KTOTrainer, on unpaired sequences hidden [N, T, H]
    labelled by `desirable` [N] (bool). loss_type "kto" needs the KL estimate `kl` (a number or
    1-element tensor, e.g. fused_linear_kto_kl's, averaged over ranks; clamped at 0 here; pass 0.0
    to drop it); "apo_zero_unpaired" uses none."""
    loss_type = check_choice("loss_type", loss_type, KTO_LOSS_TYPES)
    beta = check_beta(beta)
    desirable_weight = check_nonnegative("desirable_weight", desirable_weight)
    undesirable_weight = check_nonnegative("undesirable_weight", undesirable_weight)
    n = _check_policy(hidden, weight, bias, target, ignore_index, paired=False)
    if not isinstance(desirable, torch.Tensor) or desirable.dtype != torch.bool or desirable.shape != (n,):
        got = f"shape {tuple(desirable.shape)} dtype {desirable.dtype}" if isinstance(desirable, torch.Tensor) else (
            type(desirable).__name__)
        raise ValueError(f"desirable must be a bool tensor of shape ({n},), one label per sequence; got {got}")
    check_same_device(hidden=hidden, desirable=desirable)
    _check_reference("KTO", hidden, weight, ref_logps, ref_hidden, ref_weight, ref_bias)
    if loss_type == "kto":
        if kl is None:
            raise ValueError("KTO needs the KL estimate `kl` (fused_linear_kto_kl on mismatched completions, "
                             "or 0.0 to leave it out)")
        kl_value = _check_kl(kl, hidden.device).clamp(min=0.0)
    else:
        kl_value = torch.zeros((), dtype=torch.float32, device=hidden.device)

    ref_sums = _reference_sums(target, ref_logps, ref_hidden, ref_weight, ref_bias, ignore_index, chunk_size)

    def sequence_loss(logps, first):
        rows = slice(first, first + logps.shape[0])
        logratios = logps.sum(-1) - ref_sums[rows]
        if loss_type == "kto":
            good = 1.0 - torch.sigmoid(beta * (logratios - kl_value))
            bad = 1.0 - torch.sigmoid(beta * (kl_value - logratios))
        else:
            good = 1.0 - torch.sigmoid(beta * logratios)
            bad = torch.sigmoid(beta * logratios)
        return torch.where(desirable[rows], desirable_weight * good, undesirable_weight * bad).sum() / n

    loss, token = _objective(hidden, weight, target, bias, ignore_index, chunk_size, sequence_loss, group_size=1)
    sums = token.sum(-1)
    return KTOOutput(
        loss=loss,
        logps=sums,
        rewards=beta * (sums - ref_sums),
        desirable=desirable,
        kl=kl_value,
    )


def fused_linear_kto_kl(
    kl_hidden: torch.Tensor,
    weight: torch.Tensor,
    kl_target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_kl_logps: torch.Tensor | None = None,
    ref_kl_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """KTO's KL estimate: mean over mismatched (prompt, completion) sequences of log pi - log ref (sums
    over kl_target's tokens), without gradient, NOT clamped (average it over ranks first; the loss clamps)."""
    _check_policy(kl_hidden, weight, bias, kl_target, ignore_index, paired=False)
    check_reference_inputs(
        "KTO's KL estimate", kl_hidden, weight, ref_kl_logps, ref_kl_hidden, ref_weight, ref_bias,
        ref_logps_shape=(kl_hidden.shape[0],), ref_logps_meaning="per-sequence reference log-prob sums",
        required=True,
    )
    with torch.no_grad():
        sums = fused_linear_token_logprobs(
            kl_hidden.detach(), weight.detach(), kl_target, None if bias is None else bias.detach(),
            ignore_index=ignore_index, chunk_size=chunk_size,
        ).sum(-1)
        ref = _reference_sums(kl_target, ref_kl_logps, ref_kl_hidden, ref_weight, ref_bias, ignore_index, chunk_size)
        return (sums - ref).mean()
