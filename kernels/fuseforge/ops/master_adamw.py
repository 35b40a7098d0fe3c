"""The fused update of one fp32 master weight: torch.optim.AdamW's step on the master and its moments, and the
rounded master written into the model's bf16 / fp16 copy, in one pass (fuseforge.optim.MasterAdamW runs it per
tensor; its docstring says why)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fuseforge.ops._shared.rowwise import round_to
from fuseforge.ops._shared.utils import check_device_supported, is_interpreter

_BLOCK = 4096
_LOW_DTYPES = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _master_adamw_kernel(
    master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, grad_scale_ptr,
    n, lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt,
    HAS_GRAD_SCALE: tl.constexpr, EMULATE_RNE: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    param = tl.load(master_ptr + offsets, mask=mask, other=0.0)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        grad = grad / tl.load(grad_scale_ptr)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
    param = param - lr * weight_decay * param
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param = param - step_size * exp_avg / denom
    tl.store(master_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    tl.store(copy_ptr + offsets, round_to(param, copy_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


def check_master_weight(master: torch.Tensor, copy: torch.Tensor, grad: torch.Tensor) -> None:
    """Raise unless master_adamw_update can take this fp32 master, its bf16 / fp16 copy and its gradient."""
    if master.dtype != torch.float32:
        raise TypeError(f"MasterAdamW updates fp32 master weights, got a {master.dtype} parameter")
    if copy.dtype not in _LOW_DTYPES:
        raise TypeError(f"the model copy of a master weight must be bf16 or fp16, got {copy.dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"a master weight's gradient must be fp32, bf16 or fp16, got {grad.dtype}")
    if copy.shape != master.shape or grad.shape != master.shape:
        raise ValueError(f"master {tuple(master.shape)}, its model copy {tuple(copy.shape)} and its gradient "
                         f"{tuple(grad.shape)} must have the same shape")
    for name, t in (("master weight", master), ("model copy", copy), ("gradient", grad)):
        if not t.is_contiguous():
            raise ValueError(f"MasterAdamW needs a contiguous {name} (shape {tuple(t.shape)}, strides {t.stride()})")
        if t.device != master.device:
            raise ValueError(f"the {name} is on {t.device}, its master weight on {master.device}")
    check_device_supported("master weight", master)


def master_adamw_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        copy: torch.Tensor, grad_scale: torch.Tensor | None, *, lr: float, beta1: float, beta2: float,
                        eps: float, weight_decay: float, step: float) -> None:
    """One AdamW step of `master` (and its moments) in place, `copy` overwritten with the rounded master; the
    gradient is divided by `grad_scale` (one element) as it is read, when given. check_master_weight first."""
    n = master.numel()
    if n == 0:
        return
    _master_adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, copy,
        grad_scale if grad_scale is not None else master,
        n, lr, beta1, beta2, eps, weight_decay,
        lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step),
        HAS_GRAD_SCALE=grad_scale is not None, EMULATE_RNE=is_interpreter(), BLOCK=_BLOCK, num_warps=8,
    )
