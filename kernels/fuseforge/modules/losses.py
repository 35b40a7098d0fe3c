"""Loss modules: a drop-in for torch.nn.CrossEntropyLoss and a fused LM-head loss.

Options are validated at construction so that a bad config fails when the model is built,
not at the first training step.
"""

from __future__ import annotations

import torch

from fuseforge.loss_args import IGNORE_INDEX, check_chunk_size, check_loss_options
from fuseforge.ops.cross_entropy import cross_entropy
from fuseforge.ops.fused_linear_cross_entropy import fused_linear_cross_entropy


class _CrossEntropyOptions(torch.nn.Module):
    """Holds the validated loss options that both cross-entropy modules pass to their op."""

    def __init__(self, ignore_index, reduction, label_smoothing, z_loss_scale, softcap):
        super().__init__()
        opts = check_loss_options(ignore_index, reduction, label_smoothing, z_loss_scale, softcap)
        self.ignore_index = opts.ignore_index
        self.reduction = reduction
        self.label_smoothing = opts.label_smoothing
        self.z_loss_scale = opts.z_loss_scale
        self.softcap = opts.softcap

    def _loss_options(self) -> dict:
        return dict(
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            z_loss_scale=self.z_loss_scale,
            softcap=self.softcap,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._loss_options().items())


class CrossEntropyLoss(_CrossEntropyOptions):
    """torch.nn.CrossEntropyLoss with class-index targets, backed by fuseforge's Triton kernel.

    forward(input [..., V], target [...]) -> loss. For inputs of rank > 2 the class dimension
    is the last one (LLM layout), not dim 1 as in torch. Adds z_loss_scale (PaLM z-loss),
    softcap (Gemma 2 logit softcapping) and inplace_grad (write the gradient into the
    logits' buffer instead of a new one; see fuseforge.ops.cross_entropy.cross_entropy).
    Class weights and probability targets are not supported.
    """

    def __init__(
        self,
        ignore_index: int = IGNORE_INDEX,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss_scale: float = 0.0,
        softcap: float | None = None,
        inplace_grad: bool = False,
    ):
        super().__init__(ignore_index, reduction, label_smoothing, z_loss_scale, softcap)
        self.inplace_grad = bool(inplace_grad)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(input, target, **self._loss_options(), inplace_grad=self.inplace_grad)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, inplace_grad={self.inplace_grad}"


class FusedLinearCrossEntropyLoss(_CrossEntropyOptions):
    """Cross-entropy of an LM head's logits, computed without materialising them.

    forward(hidden [..., H], weight [V, H], target [...], bias=None, num_items_in_batch=None)
    -> loss (fp32), or (loss, lse) with return_lse=True. The argument order is
    fuseforge.functional.fused_linear_cross_entropy's: activations first, then the head's
    parameters (note: Liger-Kernel's module takes the weight first). The module holds no
    parameters: pass the lm_head's weight (and bias) in, so tied embeddings keep working.
    """

    def __init__(
        self,
        ignore_index: int = IGNORE_INDEX,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss_scale: float = 0.0,
        softcap: float | None = None,
        return_lse: bool = False,
        chunk_size: int | None = None,
    ):
        super().__init__(ignore_index, reduction, label_smoothing, z_loss_scale, softcap)
        self.return_lse = bool(return_lse)
        self.chunk_size = check_chunk_size(chunk_size)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ):
        return fused_linear_cross_entropy(
            hidden,
            weight,
            target,
            bias=bias,
            **self._loss_options(),
            return_lse=self.return_lse,
            num_items_in_batch=num_items_in_batch,
            chunk_size=self.chunk_size,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, return_lse={self.return_lse}, chunk_size={self.chunk_size}"
