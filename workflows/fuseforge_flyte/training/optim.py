"""AdamW with the usual decay/no-decay split and a warmup + cosine learning-rate schedule."""

from __future__ import annotations

import sys
from typing import Dict, Iterable, List

import torch

BETAS = (0.9, 0.95)
EPS = 1e-8
MIN_LR_RATIO = 0.1  # cosine decays to 10% of the peak learning rate at the last step


def param_groups(named_params: Iterable, weight_decay: float) -> List[Dict]:
    """Weight decay on matrices only: norms' scales and biases (1-D) are not decayed."""
    decay, no_decay = [], []
    for _, param in named_params:
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def adamw(groups: List[Dict], lr: float) -> torch.optim.Optimizer:
    """torch's AdamW; its fused CUDA kernel (one launch per step) when every parameter is a plain CUDA tensor
    (sharded DTensor parameters keep the default multi-tensor path)."""
    params = [p for group in groups for p in group["params"]]
    fused = bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, fused=fused or None)


def master_adamw(groups: List[Dict], lr: float, masters) -> torch.optim.Optimizer:
    """The same AdamW over fp32 master weights (precision.MasterWeights), fused with writing the bf16 model
    (fuseforge.optim.MasterAdamW: same update and state names as torch's)."""
    from fuseforge.optim import MasterAdamW

    return MasterAdamW(groups, lr=lr, betas=BETAS, eps=EPS, model_copy_of=masters.model_copy_of,
                       gradient_of=masters.gradient_of)


def divides_by_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` divides each gradient by `optimizer.grad_scale` as it reads it: torch's fused
    AdamW and MasterAdamW do."""
    if optimizer.param_groups[0].get("fused"):
        return True
    module = sys.modules.get("fuseforge.optim.master_adamw")  # not imported: it cannot be one
    return module is not None and isinstance(optimizer, module.MasterAdamW)


def scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' cosine schedule with linear warmup, down to MIN_LR_RATIO of the peak: the schedule TRL's
    trainers use too (training/dpo.py asks for the same one), so a model trains on one schedule on either path.

    The lr multiplier is step/warmup during the warmup (0 at the first step), then cosine from 1 to MIN_LR_RATIO
    at step `total`. Its lambda is a functools.partial that LambdaLR's state_dict does not save: a resumed run
    rebuilds it from its own settings (checkpoint/schedule.py)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total,
                                                       min_lr_rate=MIN_LR_RATIO)
