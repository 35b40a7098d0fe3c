"""Preference-optimisation losses as nn.Modules (DPO, CPO, SimPO, ORPO, KTO) over hidden states and the LM head.

Options are validated at construction, so a bad config fails when the trainer is built. The
modules hold no parameters: pass the lm_head's weight (and bias) in, so tied embeddings keep
working. Layout and formulas: fuseforge.ops.preference.
"""

from __future__ import annotations

import torch

from fuseforge.loss_args import IGNORE_INDEX, check_chunk_size
from fuseforge.ops.preference import (
    CPO_LOSS_TYPES,
    DPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    KTOOutput,
    PreferenceOutput,
    check_beta,
    check_choice,
    check_label_smoothing,
    check_nonnegative,
    fused_linear_cpo_loss,
    fused_linear_dpo_loss,
    fused_linear_kto_loss,
    fused_linear_orpo_loss,
    fused_linear_simpo_loss,
)
from fuseforge.checks import check_int64


class _HeadLoss(torch.nn.Module):
    """ignore_index and chunk_size, common to every fused-head loss."""

    def __init__(self, ignore_index: int, chunk_size: int | None):
        super().__init__()
        self.ignore_index = check_int64("ignore_index", ignore_index)
        self.chunk_size = check_chunk_size(chunk_size)

    def _head(self) -> dict:
        return dict(ignore_index=self.ignore_index, chunk_size=self.chunk_size)


class FusedLinearDPOLoss(_HeadLoss):
    """DPO on stacked [chosen; rejected] hidden states [2B, T, H].

    forward(hidden, weight, target, bias=None, ref_logps=None, ref_hidden=None, ref_weight=None,
    ref_bias=None) -> PreferenceOutput (loss + per-pair rewards and log-probs).
    """

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None):
        super().__init__(ignore_index, chunk_size)
        self.loss_type = check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
        self.beta = check_beta(beta)
        self.label_smoothing = check_label_smoothing(label_smoothing, loss_type)

    def forward(self, hidden, weight, target, bias=None, ref_logps=None, ref_hidden=None, ref_weight=None,
                ref_bias=None) -> PreferenceOutput:
        return fused_linear_dpo_loss(
            hidden, weight, target, bias, ref_logps=ref_logps, ref_hidden=ref_hidden, ref_weight=ref_weight,
            ref_bias=ref_bias, beta=self.beta, loss_type=self.loss_type, label_smoothing=self.label_smoothing,
            **self._head(),
        )

    def extra_repr(self) -> str:
        return f"beta={self.beta}, loss_type={self.loss_type!r}, label_smoothing={self.label_smoothing}"


class FusedLinearCPOLoss(_HeadLoss):
    """CPO (reference-free) on stacked [chosen; rejected] hidden states, plus cpo_alpha * NLL(chosen).

    forward(hidden, weight, target, bias=None, nll_target=None) -> PreferenceOutput.
    """

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 cpo_alpha: float = 1.0, simpo_gamma: float = 0.5, ignore_index: int = IGNORE_INDEX,
                 chunk_size: int | None = None):
        super().__init__(ignore_index, chunk_size)
        self.loss_type = check_choice("loss_type", loss_type, CPO_LOSS_TYPES)
        self.beta = check_beta(beta)
        self.label_smoothing = check_label_smoothing(label_smoothing, loss_type)
        self.cpo_alpha = check_nonnegative("cpo_alpha", cpo_alpha)
        self.simpo_gamma = check_nonnegative("simpo_gamma", simpo_gamma)

    def forward(self, hidden, weight, target, bias=None, nll_target=None) -> PreferenceOutput:
        return fused_linear_cpo_loss(
            hidden, weight, target, bias, beta=self.beta, loss_type=self.loss_type,
            label_smoothing=self.label_smoothing, cpo_alpha=self.cpo_alpha, simpo_gamma=self.simpo_gamma,
            nll_target=nll_target, **self._head(),
        )

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, loss_type={self.loss_type!r}, label_smoothing={self.label_smoothing}, "
                f"cpo_alpha={self.cpo_alpha}, simpo_gamma={self.simpo_gamma}")


class FusedLinearSimPOLoss(_HeadLoss):
    """SimPO: -log sig(beta * (avg log pi_c - avg log pi_r) - gamma) on stacked [chosen; rejected].

    forward(hidden, weight, target, bias=None, nll_target=None) -> PreferenceOutput.
    """

    def __init__(self, beta: float = 0.1, gamma: float = 0.5, label_smoothing: float = 0.0, cpo_alpha: float = 0.0,
                 ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None):
        super().__init__(ignore_index, chunk_size)
        self.beta = check_beta(beta)
        self.gamma = check_nonnegative("gamma", gamma)
        self.label_smoothing = check_label_smoothing(label_smoothing, "simpo")
        self.cpo_alpha = check_nonnegative("cpo_alpha", cpo_alpha)

    def forward(self, hidden, weight, target, bias=None, nll_target=None) -> PreferenceOutput:
        return fused_linear_simpo_loss(
            hidden, weight, target, bias, beta=self.beta, gamma=self.gamma, label_smoothing=self.label_smoothing,
            cpo_alpha=self.cpo_alpha, nll_target=nll_target, **self._head(),
        )

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, gamma={self.gamma}, label_smoothing={self.label_smoothing}, "
                f"cpo_alpha={self.cpo_alpha}")


class FusedLinearORPOLoss(_HeadLoss):
    """ORPO: NLL(chosen) - beta * mean log sig(log odds ratio) on stacked [chosen; rejected].

    forward(hidden, weight, target, bias=None, nll_target=None) -> PreferenceOutput
    (extra: nll_loss, log_odds_ratio, log_odds_chosen).
    """

    def __init__(self, beta: float = 0.1, ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None):
        super().__init__(ignore_index, chunk_size)
        self.beta = check_beta(beta)

    def forward(self, hidden, weight, target, bias=None, nll_target=None) -> PreferenceOutput:
        return fused_linear_orpo_loss(hidden, weight, target, bias, beta=self.beta, nll_target=nll_target,
                                      **self._head())

    def extra_repr(self) -> str:
        return f"beta={self.beta}"


class FusedLinearKTOLoss(_HeadLoss):
    """KTO on unpaired sequences [N, T, H] labelled desirable / undesirable.

    forward(hidden, weight, target, desirable, bias=None, ref_logps=None, ref_hidden=None, ref_weight=None,
    ref_bias=None, kl=None) -> KTOOutput.
    """

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 loss_type: str = "kto", ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None):
        super().__init__(ignore_index, chunk_size)
        self.loss_type = check_choice("loss_type", loss_type, KTO_LOSS_TYPES)
        self.beta = check_beta(beta)
        self.desirable_weight = check_nonnegative("desirable_weight", desirable_weight)
        self.undesirable_weight = check_nonnegative("undesirable_weight", undesirable_weight)

    def forward(self, hidden, weight, target, desirable, bias=None, ref_logps=None, ref_hidden=None,
                ref_weight=None, ref_bias=None, kl=None) -> KTOOutput:
        return fused_linear_kto_loss(
            hidden, weight, target, desirable, bias, ref_logps=ref_logps, ref_hidden=ref_hidden,
            ref_weight=ref_weight, ref_bias=ref_bias, kl=kl, beta=self.beta, desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight, loss_type=self.loss_type, **self._head(),
        )

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, loss_type={self.loss_type!r}, desirable_weight={self.desirable_weight}, "
                f"undesirable_weight={self.undesirable_weight}")
