"""What every trainer family shares: the TrainerPolicy record, telling a trainer apart, and the model inside a
trainer's wrappers."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

# apply_kernels' switch of the fused losses: off, every trainer keeps its own loss.
FUSED_LOSS_FLAG = "fused_linear_cross_entropy"


@dataclass(frozen=True)
class TrainerPolicy:
    """What one trainer class needs from a patched model.

    uses_model_loss: the trainer trains on the model's own `loss`, so fused linear
    cross-entropy can compute it; otherwise the model gets no fused loss and `reason`
    says why. check(trainer) -> str | None, before patching: why this trainer's settings
    rule the fused loss out after all (None: they do not). adapt(trainer, model, options),
    after the model is patched (with or without the fused loss): adapts the trainer instance
    to the patched model and may return a note for the report. A trainer-specific fused loss
    (preference, RL) is installed here.
    """

    uses_model_loss: bool
    reason: str = ""
    check: Callable | None = None
    adapt: Callable | None = None


def is_trainer(obj) -> bool:
    """True for a transformers.Trainer instance (without importing transformers.trainer)."""
    module = sys.modules.get("transformers.trainer")
    return module is not None and isinstance(obj, module.Trainer)


def unwrap_model(trainer, model):
    """`model` without the accelerator's, DDP's and torch.compile's wrappers around it."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None and isinstance(model, nn.Module):
        model = accelerator.unwrap_model(model)
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper
