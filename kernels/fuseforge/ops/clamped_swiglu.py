"""Clamped SwiGLU, the gate of GPT-OSS's experts, on one packed gate/up projection.

With g = min(gate, limit) and u = clamp(up, -limit, limit):

    out = (u + 1) * g * sigmoid(alpha * g)

gate and up are read from one [..., 2 * I] tensor (the output of the experts' `gate_up_proj`):
layout="interleaved" (GPT-OSS: gate = x[..., 0::2], up = x[..., 1::2]) or "concatenated"
([gate | up] halves). Gradients are torch.clamp's: they pass where the clamp's bounds hold
(gate <= limit; -limit <= up <= limit, inclusive, so a value exactly at the limit keeps its
gradient) and are zero beyond them; NaN propagates forward and gets a zero gradient, as in torch.

Math runs in fp32 (fp64 for fp64 inputs) with one rounding at the end, so bf16 results are at
least as accurate as the unfused chain of bf16 ops. alpha and limit are the numbers PyTorch itself
uses: alpha rounded to fp32 (how `tensor * float` takes a scalar for fp32/bf16/fp16 tensors), limit
rounded to the input's dtype (how `clamp` and its gradient's bounds test take it: a bf16 value equal to
bf16(limit) keeps its gradient). Kernel scalars are fp32, so fp64 inputs see fp32-rounded constants.

Backward recomputes the activation from the saved packed input and writes the packed gradient
into a fresh buffer, in the input's layout, so it flows straight back into the projection.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fuseforge.ops.glu import _as_rows, _launch_config, _tile
from fuseforge.ops._shared.compiled import compiling
from fuseforge.ops._shared.utils import FLOAT_DTYPES, check_device_supported, check_tensor, upcast

LAYOUTS = ("interleaved", "concatenated")


@triton.jit
def _columns(cols, n_cols, INTERLEAVED: tl.constexpr):
    """Columns of gate and up in the packed row for output column `cols`."""
    if INTERLEAVED:
        return 2 * cols, 2 * cols + 1
    else:
        return cols, cols + n_cols


@triton.jit
def _clamped(gate, up, limit):
    """torch.clamp's forward (NaN stays NaN) and the masks where its gradient passes."""
    g = tl.where(gate > limit, limit, gate)
    u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    return g, u, gate <= limit, (up >= -limit) & (up <= limit)


@triton.jit
def _forward_kernel(
    x_ptr, out_ptr, stride_x, stride_out, n_rows, n_cols, alpha, limit,
    INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP64: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    gate_cols, up_cols = _columns(cols, n_cols, INTERLEAVED)
    row_ptr = x_ptr + rows * stride_x
    gate = upcast(tl.load(row_ptr + gate_cols, mask=mask, other=0.0), FP64)
    up = upcast(tl.load(row_ptr + up_cols, mask=mask, other=0.0), FP64)
    g, u, _, _ = _clamped(gate, up, limit)
    out = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    tl.store(out_ptr + rows * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    grad_out_ptr, x_ptr, grad_x_ptr, stride_grad_out, stride_x, stride_grad_x, n_rows, n_cols, alpha, limit,
    INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP64: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    gate_cols, up_cols = _columns(cols, n_cols, INTERLEAVED)
    row_ptr = x_ptr + rows * stride_x
    dout = upcast(tl.load(grad_out_ptr + rows * stride_grad_out + cols, mask=mask, other=0.0), FP64)
    gate = upcast(tl.load(row_ptr + gate_cols, mask=mask, other=0.0), FP64)
    up = upcast(tl.load(row_ptr + up_cols, mask=mask, other=0.0), FP64)
    g, u, gate_passes, up_passes = _clamped(gate, up, limit)
    s = tl.sigmoid(g * alpha)
    glu = g * s
    dglu = s + g * alpha * s * (1.0 - s)  # d/dg of g * sigmoid(alpha * g)
    d_gate = tl.where(gate_passes, dout * (u + 1.0) * dglu, 0.0)
    d_up = tl.where(up_passes, dout * glu, 0.0)
    grad_row = grad_x_ptr + rows * stride_grad_x
    tl.store(grad_row + gate_cols, d_gate.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_row + up_cols, d_up.to(grad_x_ptr.dtype.element_ty), mask=mask)


def _clamped_swiglu_forward(gate_up, alpha, limit, interleaved):
    """The forward launch (eager and compiled paths): (out, gate_up as [rows, 2 * I])."""
    x_rows, _ = _as_rows(gate_up)
    n_rows, n_cols = x_rows.shape[0], x_rows.shape[1] // 2
    out = torch.empty((*gate_up.shape[:-1], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        cfg = _launch_config(n_rows, n_cols)
        _forward_kernel[cfg["grid"]](
            x_rows, out, x_rows.stride(0), n_cols, n_rows, n_cols, alpha, limit,
            INTERLEAVED=interleaved, FP64=gate_up.dtype == torch.float64, **cfg["meta"],
        )
    return out, x_rows


def _clamped_swiglu_backward(grad_out, x_rows, alpha, limit, interleaved) -> torch.Tensor:
    """The backward launch: the packed gradient as [rows, 2 * I], in a fresh buffer."""
    n_rows, n_cols = x_rows.shape[0], x_rows.shape[1] // 2
    grad_rows, _ = _as_rows(grad_out)
    grad_x = torch.empty((n_rows, 2 * n_cols), dtype=x_rows.dtype, device=x_rows.device)
    if grad_x.numel():
        cfg = _launch_config(n_rows, n_cols)
        _backward_kernel[cfg["grid"]](
            grad_rows, x_rows, grad_x, grad_rows.stride(0), x_rows.stride(0), 2 * n_cols,
            n_rows, n_cols, alpha, limit,
            INTERLEAVED=interleaved, FP64=x_rows.dtype == torch.float64, **cfg["meta"],
        )
    return grad_x


class _ClampedSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, alpha, limit, interleaved):
        out, x_rows = _clamped_swiglu_forward(gate_up, alpha, limit, interleaved)
        ctx.save_for_backward(x_rows)
        ctx.alpha, ctx.limit, ctx.interleaved, ctx.shape = alpha, limit, interleaved, gate_up.shape
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (x_rows,) = ctx.saved_tensors
        grad_x = _clamped_swiglu_backward(grad_out, x_rows, ctx.alpha, ctx.limit, ctx.interleaved)
        return grad_x.view(ctx.shape), None, None, None


# --- torch.compile: the same launches as custom ops (ops/_shared/compiled.py says why) ---------------


@torch.library.custom_op("fuseforge::clamped_swiglu", mutates_args=())
def _clamped_swiglu_op(gate_up: torch.Tensor, alpha: float, limit: float, interleaved: bool) -> torch.Tensor:
    return _clamped_swiglu_forward(gate_up, alpha, limit, interleaved)[0]


@_clamped_swiglu_op.register_fake
def _(gate_up, alpha, limit, interleaved):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("fuseforge::clamped_swiglu_backward", mutates_args=())
def _clamped_swiglu_backward_op(
    grad_out: torch.Tensor, gate_up: torch.Tensor, alpha: float, limit: float, interleaved: bool
) -> torch.Tensor:
    x_rows, _ = _as_rows(gate_up)
    return _clamped_swiglu_backward(grad_out, x_rows, alpha, limit, interleaved).view(gate_up.shape)


@_clamped_swiglu_backward_op.register_fake
def _(grad_out, gate_up, alpha, limit, interleaved):
    return gate_up.new_empty(gate_up.shape)


def _clamped_swiglu_setup(ctx, inputs, output):
    gate_up, ctx.alpha, ctx.limit, ctx.interleaved = inputs
    ctx.save_for_backward(gate_up)


def _clamped_swiglu_op_backward(ctx, grad_out):
    (gate_up,) = ctx.saved_tensors
    return _clamped_swiglu_backward_op(grad_out, gate_up, ctx.alpha, ctx.limit, ctx.interleaved), None, None, None


_clamped_swiglu_op.register_autograd(_clamped_swiglu_op_backward, setup_context=_clamped_swiglu_setup)


def _scalar(name: str, value, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (at most fp32: what a float kernel argument is once compiled; the
    interpreter would keep fp64), so that every backend applies the same constants as PyTorch."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return _rounded(float(value), torch.float32 if dtype == torch.float64 else dtype)


@torch.compiler.assume_constant_result  # a constant under torch.compile, not a tensor and .item() in the graph
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float, *, layout: str = "interleaved") -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU of a packed [..., 2 * I] gate/up tensor, fused: returns [..., I].

    out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = gate.clamp(max=limit),
    gradients exactly torch.clamp's (zero beyond the limits). layout: "interleaved" (gate at even,
    up at odd columns: GPT-OSS's gate_up_proj) or "concatenated" ([gate | up]). Output in the
    input's dtype; math in fp32 (fp64 for fp64 inputs), alpha and limit as fp32 scalars.
    """
    check_tensor("gate_up", gate_up, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_device_supported("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up halves), got {tuple(gate_up.shape)}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    alpha, limit = _scalar("alpha", alpha, torch.float32), _scalar("limit", limit, gate_up.dtype)
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha}")
    if math.isnan(limit) or limit < 0:
        raise ValueError(f"limit must be >= 0 (math.inf: no clamp), got {limit}")
    if compiling():
        return _clamped_swiglu_op(gate_up, alpha, limit, layout == "interleaved")
    return _ClampedSwiGLUFunction.apply(gate_up, alpha, limit, layout == "interleaved")
