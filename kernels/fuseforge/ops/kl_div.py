"""KL divergence with exactly torch.nn.functional.kl_div's pointwise semantics, one streaming pass each way.

Pointwise, with `input` = log-probabilities x and `target` y:
    log_target=False: xlogy(y, y) - y * x      (0 where y == 0, as torch's xlogy; NaN for y < 0)
    log_target=True:  exp(y) * (y - x)
Reductions as torch: "none" (elementwise), "sum", "mean" (sum / numel: NOT the KL divergence),
"batchmean" (sum / input.size(0): the KL divergence per sample). The DEFAULT differs from torch:
"batchmean" here (the mathematically meaningful one) vs "mean" in torch; pass `reduction`
explicitly where exact torch defaults matter. Shapes broadcast like torch (broadcast operands are
materialised). Gradients flow to `input` and, when it requires grad, to `target`; at y == 0 with
log_target=False torch's target gradient is NaN (0/0 inside xlogy's derivative), and so is ours.
Math is fp32 (so float64 is rejected rather than silently downcast); the result has
torch.result_type(input, target).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from fuseforge.checks import check_reduction
from fuseforge.ops._shared.utils import (
    TRAINING_DTYPES,
    check_device_supported,
    check_same_device,
    check_tensor,
    is_interpreter,
    row_launch_config,
)

KL_REDUCTIONS = ("none", "sum", "mean", "batchmean")

# Elements per program: large under the CPU interpreter (per-program overhead dominates there).
_GPU_BLOCK = 4096
_INTERPRETER_BLOCK = 65536


def _launch_config(numel: int) -> tuple[int, int, int]:
    """(grid, BLOCK, num_warps) for the flat elementwise kernels."""
    block = _INTERPRETER_BLOCK if is_interpreter() else _GPU_BLOCK
    block = min(block, triton.next_power_of_2(max(numel, 1)))
    _, warps = row_launch_config(block)
    return triton.cdiv(numel, block), block, warps


@triton.jit
def _kl_pointwise(x, y, LOG_TARGET: tl.constexpr):
    if LOG_TARGET:
        return tl.exp(y) * (y - x)
    # torch.xlogy(y, y): exactly 0 at y == 0 (the 0 * log 0 limit), NaN for negative y.
    return tl.where(y == 0, 0.0, y * tl.log(y)) - y * x


@triton.jit
def _kl_div_forward_kernel(
    x_ptr, y_ptr, out_ptr, numel,
    LOG_TARGET: tl.constexpr, ELEMENTWISE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Elementwise loss (ELEMENTWISE) or one fp32 partial sum per program."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    loss = _kl_pointwise(x, y, LOG_TARGET)
    if ELEMENTWISE:
        tl.store(out_ptr + offs, loss.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid, tl.sum(tl.where(mask, loss, 0.0), axis=0))


@triton.jit
def _kl_div_backward_kernel(
    x_ptr, y_ptr, g_ptr, grad_x_ptr, grad_y_ptr, numel,
    LOG_TARGET: tl.constexpr, ELEMENTWISE_GRAD: tl.constexpr,
    NEED_GRAD_X: tl.constexpr, NEED_GRAD_Y: tl.constexpr, BLOCK: tl.constexpr,
):
    """d/dx = -p * g and d/dy = (log-target: p * (y - x + 1); else log y + y/y - x) * g, p = target prob."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if ELEMENTWISE_GRAD:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr)  # upstream grad already divided by the reduction's denominator
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if LOG_TARGET:
        p = tl.exp(y)
    else:
        p = y
    if NEED_GRAD_X:
        tl.store(grad_x_ptr + offs, (-p * g).to(grad_x_ptr.dtype.element_ty), mask=mask)
    if NEED_GRAD_Y:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if LOG_TARGET:
            dy = p * (y - x + 1.0)
        else:
            # torch differentiates xlogy(y, y) as xlogy(y != 0, y) + y / y: NaN at y == 0.
            dy = tl.where(y != 0, tl.log(y), 0.0) + y / y - x
        tl.store(grad_y_ptr + offs, (dy * g).to(grad_y_ptr.dtype.element_ty), mask=mask)


def _denominator(reduction: str, numel: int, batch_size: int) -> int:
    return {"sum": 1, "mean": numel, "batchmean": batch_size}[reduction]


class _KLDivFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, reduction, log_target, batch_size):
        numel = x.numel()
        grid, block, warps = _launch_config(numel)
        out_dtype = torch.result_type(x, y)
        if reduction == "none":
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        else:
            out = torch.empty(grid, dtype=torch.float32, device=x.device)
        if numel > 0:
            _kl_div_forward_kernel[(grid,)](
                x, y, out, numel,
                LOG_TARGET=log_target, ELEMENTWISE=reduction == "none", BLOCK=block, num_warps=warps,
            )
        if reduction != "none":
            # Tensor division: numel == 0 gives NaN for "mean"/"batchmean", as torch does.
            out = (out.sum() / _denominator(reduction, numel, batch_size)).to(out_dtype)
        ctx.save_for_backward(x, y)
        ctx.reduction, ctx.log_target, ctx.batch_size = reduction, log_target, batch_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        x, y = ctx.saved_tensors
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if need_x else None
        grad_y = torch.empty_like(y) if need_y else None
        numel = x.numel()
        if numel > 0 and (need_x or need_y):
            elementwise = ctx.reduction == "none"
            if elementwise:
                g = grad_output.contiguous()
            else:
                g = grad_output.to(torch.float32) / _denominator(ctx.reduction, numel, ctx.batch_size)
            grid, block, warps = _launch_config(numel)
            _kl_div_backward_kernel[(grid,)](
                x, y, g, grad_x if need_x else x, grad_y if need_y else y, numel,
                LOG_TARGET=ctx.log_target, ELEMENTWISE_GRAD=elementwise,
                NEED_GRAD_X=need_x, NEED_GRAD_Y=need_y, BLOCK=block, num_warps=warps,
            )
        return grad_x, grad_y, None, None, None


def kl_div(
    input: torch.Tensor,
    target: torch.Tensor,
    reduction: str = "batchmean",
    log_target: bool = False,
) -> torch.Tensor:
    """torch.nn.functional.kl_div(input, target, reduction, log_target) as fused Triton kernels.

    `input` holds log-probabilities; `target` probabilities (or log-probabilities with
    log_target=True). Any shape; the two broadcast. Default reduction "batchmean" (torch: "mean").
    """
    check_tensor("input", input, dtypes=TRAINING_DTYPES)
    check_tensor("target", target, dtypes=TRAINING_DTYPES)
    check_reduction(reduction, KL_REDUCTIONS)
    if not isinstance(log_target, bool):
        raise TypeError(f"log_target must be a bool, got {type(log_target).__name__}")
    check_same_device(input=input, target=target)
    check_device_supported("input", input)
    try:
        shape = torch.broadcast_shapes(input.shape, target.shape)
    except RuntimeError:
        raise ValueError(
            f"input of shape {tuple(input.shape)} and target of shape {tuple(target.shape)} do not broadcast"
        ) from None
    # torch divides "batchmean" by the size of input's first dimension (none for a 0-d input).
    batch_size = input.shape[0] if input.dim() > 0 else 1
    x = input.expand(shape).contiguous()
    y = target.expand(shape).contiguous()
    return _KLDivFunction.apply(x, y, reduction, log_target, batch_size)
