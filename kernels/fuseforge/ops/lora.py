"""LoRA linear layer in one autograd node: y = x W^T + b + s * (drop(x) A^T) B^T.

Why: peft's `lora.Linear` computes the adapter's output as its own [tokens, out] tensor, scales it
(another [tokens, out] tensor) and adds it to the base output (a third): two extra passes over
[tokens, out] in the forward and again in the backward, for every adapted projection. Here the
adapter term is accumulated into the base output by the matmul itself (`addmm_` with alpha = s),
and the backward adds the adapter's input gradient into the base one the same way, so nothing of
size [tokens, out] is built besides the output and its gradient.

The base weight W is frozen: no gradient is computed for it unless it requires one (no [out, in]
gradient buffer). It may be a torchao NF4 tensor (QLoRA): forward and backward dequantize it to the
activations' dtype for their matmul (x W^T, grad W) with fuseforge's one-pass kernel (ops/nf4.py), as
torchao's own NF4 linear does with its multi-op `get_original_weight`; the dequantized weight is a
temporary of each matmul, never saved. Dropout is applied by the caller (peft's own dropout module, so the random masks
are peft's); `dropped` is None when the adapter sees x itself.

Gradients: with g the output gradient and u = drop(x) A^T (saved, [tokens, r]),
grad_x = g W + s (g B) A (+ the dropout branch's share through `dropped`), grad_A = s (g B)^T drop(x),
grad_B = s g^T u, grad_b = sum(g).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fuseforge.ops.nf4 import dequantize_nf4, is_nf4


def _dense(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a plain tensor of `dtype`: NF4 weights dequantized in one pass (ops/nf4.py), others cast."""
    if is_nf4(weight):
        return dequantize_nf4(weight, dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dropped, weight, bias, lora_a, lora_b, scaling: float):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        a_in = x2 if dropped is None else dropped.reshape(-1, shape[-1])
        out = F.linear(x2, _dense(weight, x.dtype), bias)  # NF4: dequantized for this matmul only
        u = a_in @ lora_a.t()
        out.addmm_(u, lora_b.t(), alpha=scaling)
        ctx.scaling, ctx.shape = scaling, shape
        ctx.has_dropped = dropped is not None
        ctx.save_for_backward(x2, a_in if dropped is not None else None, weight, lora_a, lora_b, u)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x2, dropped, weight, lora_a, lora_b, u = ctx.saved_tensors
        need_x, need_dropped, need_w, need_b, need_a, need_lb = ctx.needs_input_grad[:6]
        s = ctx.scaling
        g = grad_out.reshape(-1, grad_out.shape[-1])
        a_in = x2 if dropped is None else dropped
        gb = (g @ lora_b).mul_(s)  # [tokens, r]: s (g B)
        grad_x = grad_dropped = grad_w = grad_bias = grad_a = grad_lb = None
        if need_x:
            grad_x = g @ _dense(weight, g.dtype)
            if not ctx.has_dropped:
                grad_x.addmm_(gb, lora_a)
            grad_x = grad_x.view(ctx.shape)
        if need_dropped:
            grad_dropped = (gb @ lora_a).view(ctx.shape)
        if need_w:
            grad_w = g.t() @ x2
        if need_b:
            grad_bias = g.sum(0)
        if need_a:
            grad_a = gb.t() @ a_in
        if need_lb:
            grad_lb = g.t() @ u
            grad_lb.mul_(s)
        return grad_x, grad_dropped, grad_w, grad_bias, grad_a, grad_lb, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    dropped: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T + bias + scaling * (dropped A^T) B^T, with `dropped` (the adapter's dropout of x) defaulting to x.

    weight [out, in] (plain or torchao NF4, usually frozen), lora_a [r, in], lora_b [out, r]; x, the adapter
    weights and the (dequantized) base weight share one dtype. No [tokens, out] tensor besides the output.
    """
    if x.shape[-1] != weight.shape[1] or lora_a.shape != (lora_a.shape[0], weight.shape[1]) or \
            lora_b.shape != (weight.shape[0], lora_a.shape[0]):
        raise ValueError(f"lora_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, lora_a "
                         f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)} do not chain ([out, in], [r, in], [out, r])")
    if dropped is not None and dropped.shape != x.shape:
        raise ValueError(f"lora_linear: dropped {tuple(dropped.shape)} must have x's shape {tuple(x.shape)}")
    dtypes = {x.dtype, lora_a.dtype, lora_b.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"lora_linear: x, lora_a and lora_b must share one dtype, got {sorted(map(str, dtypes))}")
    return _LoraLinear.apply(x, dropped, weight, bias, lora_a, lora_b, float(scaling))
