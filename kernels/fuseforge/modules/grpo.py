"""The GRPO-family policy loss as an nn.Module over hidden states and the LM head (see fuseforge.ops.grpo)."""

from __future__ import annotations

from dataclasses import asdict

import torch

from fuseforge.modules.preference import _HeadLoss
from fuseforge.loss_args import IGNORE_INDEX
from fuseforge.ops.grpo import GRPOOutput, check_grpo_options, fused_linear_grpo_loss


class FusedLinearGRPOLoss(_HeadLoss):
    """Clipped-ratio policy loss (grpo, dr_grpo, dapo, bnpo) with an optional k3 KL to a reference.

    forward(hidden [B, T, H], weight, target [B, T], advantages [B] or [B, T], bias=None, old_logps=None,
    ref_logps=None, ref_hidden=None, ref_weight=None, ref_bias=None, num_items_in_batch=None) -> GRPOOutput.
    Defaults are TRL 1.16's GRPOConfig (loss_type "dapo", beta 0, epsilon 0.2, bias-corrected KL).
    """

    def __init__(self, loss_type: str = "dapo", beta: float = 0.0, epsilon_low: float = 0.2,
                 epsilon_high: float | None = None, delta: float | None = None,
                 importance_sampling_level: str = "token", use_bias_correction_kl: bool = True,
                 max_completion_length: int | None = None, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX,
                 chunk_size: int | None = None):
        super().__init__(ignore_index, chunk_size)
        self.options = check_grpo_options(loss_type, beta, epsilon_low, epsilon_high, delta,
                                          importance_sampling_level, use_bias_correction_kl, max_completion_length,
                                          temperature)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
                bias=None, old_logps=None, ref_logps=None, ref_hidden=None, ref_weight=None, ref_bias=None,
                num_items_in_batch=None) -> GRPOOutput:
        return fused_linear_grpo_loss(
            hidden, weight, target, advantages, bias, old_logps=old_logps, ref_logps=ref_logps,
            ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias, num_items_in_batch=num_items_in_batch,
            options=self.options, **self._head(),
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in asdict(self.options).items())
