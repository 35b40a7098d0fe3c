"""AdamW on fp32 master weights that also writes the model's bf16 (or fp16) copy, in one pass per tensor.

Mixed precision with master weights costs, per parameter and step, on top of the update itself: a cast of the
low-precision gradient into an fp32 gradient, and a cast of the updated master back into the model's copy.
torch's fused AdamW reads and writes fp32 tensors only, so those are two more passes over memory (and its
multi-tensor kernel moves about half the bytes per second a plain elementwise pass does on an H200, see
benchmarks/RESULTS.md s9). Here one kernel per tensor reads the master, its moments and the gradient in whatever
dtype it is (bf16 straight from backward, or an fp32 accumulation) and writes the master, the moments and the
model's copy: 28 bytes per bf16-gradient parameter instead of 44.

The update is torch.optim.AdamW's (decoupled weight decay, bias corrections, eps outside the square root), in
fp32 like torch's fused kernel; the state (`step`, `exp_avg`, `exp_avg_sq`) has torch's names and shapes, so
checkpoints move between the two. `step` is kept as a CPU tensor, so the bias corrections are computed on the host
without a device sync. The optimizer honours a `grad_scale` attribute as torch's fused AdamW does (the gradient is
divided by it as it is read): that is how gradient clipping costs one read of the gradients.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from fuseforge.ops.master_adamw import check_master_weight, master_adamw_update


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over fp32 master weights; each step also writes `model_copy_of(master)`.

    params: the fp32 masters (or groups of them). model_copy_of(master): the low-precision tensor the model computes
    with, overwritten with the rounded master after each update. gradient_of(master): the gradient to apply, fp32 or
    the model copy's own dtype (default: `master.grad`); None skips the master, as torch skips a parameter
    without a gradient. amsgrad, maximize and the foreach/fused/capturable switches are not supported.
    """

    def __init__(self, params: Iterable, *, model_copy_of: Callable[[torch.Tensor], torch.Tensor],
                 gradient_of: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.model_copy_of = model_copy_of
        self.gradient_of = gradient_of or (lambda master: master.grad)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, then `step` back on the CPU (a fused torch AdamW saves it on the GPU)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(state["step"]))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("MasterAdamW supports neither amsgrad nor maximize")
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            for master in group["params"]:
                grad = self.gradient_of(master)
                if grad is None:
                    continue
                copy = self.model_copy_of(master)
                check_master_weight(master, copy, grad)
                state = self.state[master]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                state["step"] += 1
                master_adamw_update(
                    master, grad, state["exp_avg"], state["exp_avg_sq"], copy, grad_scale, lr=lr, beta1=beta1,
                    beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=float(state["step"]),
                )
        return loss
