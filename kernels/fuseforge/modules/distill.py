"""Distillation losses as nn.Modules: JSD on log-probs, JSD fused with both LM heads, and KL divergence."""

from __future__ import annotations

import torch

from fuseforge.loss_args import IGNORE_INDEX, check_chunk_size
from fuseforge.ops.jsd import JSD_REDUCTIONS, check_beta, fused_linear_jsd, jsd
from fuseforge.ops.kl_div import KL_REDUCTIONS, kl_div
from fuseforge.checks import check_int64, check_positive, check_reduction


class JSDLoss(torch.nn.Module):
    """Generalized JSD between student and teacher log-probs [..., V] (see fuseforge.ops.jsd).

    forward(student_logp, teacher_logp, target=None): rows whose target is `ignore_index` are skipped.
    """

    def __init__(self, beta: float = 0.5, ignore_index: int = IGNORE_INDEX, reduction: str = "batchmean"):
        super().__init__()
        self.beta = check_beta(beta)
        self.ignore_index = check_int64("ignore_index", ignore_index)
        self.reduction = check_reduction(reduction, JSD_REDUCTIONS)

    def forward(self, student_logp, teacher_logp, target=None):
        return jsd(student_logp, teacher_logp, target, self.beta, self.ignore_index, self.reduction)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}, reduction={self.reduction!r}"


class FusedLinearJSDLoss(torch.nn.Module):
    """JSD between two LM heads' tempered distributions without materialising [tokens, V] logits.

    forward(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None) -> batchmean loss.
    """

    def __init__(
        self, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None
    ):
        super().__init__()
        self.beta = check_beta(beta)
        self.temperature = check_positive("temperature", temperature)
        self.ignore_index = check_int64("ignore_index", ignore_index)
        self.chunk_size = check_chunk_size(chunk_size)

    def forward(self, student_hidden, student_weight, teacher_hidden, teacher_weight, target=None):
        return fused_linear_jsd(
            student_hidden, student_weight, teacher_hidden, teacher_weight, target,
            beta=self.beta, temperature=self.temperature, ignore_index=self.ignore_index, chunk_size=self.chunk_size,
        )

    def extra_repr(self) -> str:
        return f"beta={self.beta}, temperature={self.temperature}, ignore_index={self.ignore_index}"


class KLDivLoss(torch.nn.Module):
    """torch.nn.KLDivLoss on fused kernels. Default reduction "batchmean" (torch's default is "mean")."""

    def __init__(self, reduction: str = "batchmean", log_target: bool = False):
        super().__init__()
        self.reduction = check_reduction(reduction, KL_REDUCTIONS)
        if not isinstance(log_target, bool):
            raise TypeError(f"log_target must be a bool, got {type(log_target).__name__}")
        self.log_target = log_target

    def forward(self, input, target):
        return kl_div(input, target, reduction=self.reduction, log_target=self.log_target)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}"
