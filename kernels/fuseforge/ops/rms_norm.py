"""RMSNorm and fused residual-add + RMSNorm: one-pass Triton forward and backward.

Casting follows Hugging Face bit for bit (`casting`):

* "llama" (LlamaRMSNorm, Mistral, Qwen2, ...): the normalized value `x * rstd` is
  computed in fp32, rounded to x's dtype, then multiplied by `offset + weight`; the
  output dtype is `torch.promote_types(x.dtype, weight.dtype)` (bf16 x with an fp32
  weight gives an fp32 output, as in HF).
* "gemma" (GemmaRMSNorm, Gemma3RMSNorm): everything in fp32,
  `(x * rstd) * (offset + weight.float())`, rounded once to x's dtype. Gemma keeps
  zero-initialised weights with offset=1.0; any other offset is computed the same way,
  so a separate "none" mode (fp32 throughout, arbitrary offset) would be identical.

`offset + weight` is formed in fp32 (HF has no llama-cast model with an offset; torch
would round it to a bf16 weight's dtype first). x and weight may each be fp32, fp16,
bf16 or fp64; with an fp64 operand all math is fp64 (so torch.autograd.gradcheck
applies), while HF would compute in fp32.

Memory traffic: the forward reads x (and the residual) once and writes y (and the new
residual) plus one fp32 rstd per row; the backward recomputes the normalized rows from
x and rstd, reads dy once and writes dx once. The weight gradient is reduced
deterministically: each program writes one fp32 partial row, summed in a fixed order by one
small kernel (rowwise.sum_partials). Wide rows (rowwise.split_backward) read x and dy once
more instead, for a column-parallel dw kernel (rowwise.param_grads) and a dx kernel without
accumulators.
dx goes to a fresh buffer rather than into dy: the traffic is the same, and dy may be a
tensor someone else holds (the grad of an addition is handed to both of its inputs,
`y.backward(g)` passes the caller's g), so overwriting it is not safe in general.
Input rows may have any row stride (sliced or broadcast rows are read in place); other
layouts are copied to contiguous first.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fuseforge.ops._shared.rowwise import (
    as_rows,
    compute_dtype,
    param_grads,
    plan_row_tiles,
    round_to,
    row_tile,
    split_backward,
    sum_partials,
)
from fuseforge.ops._shared.compiled import compiling
from fuseforge.checks import check_positive
from fuseforge.ops._shared.utils import (
    check_device_supported,
    check_same_device,
    check_same_dtype,
    check_tensor,
    is_interpreter,
)

CASTING_MODES = ("llama", "gemma")


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, S, Y, W, RSTD,
    n_rows, n_cols, stride_x, stride_r, tiles_per_program, eps, offset,
    HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, COMPUTE: tl.constexpr,
    EMULATE_RNE: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(COMPUTE) + offset
    for t in range(tiles_per_program):
        rows, row_mask, rows64, mask = row_tile(pid, t, tiles_per_program, n_rows, col_mask, ROW_BLOCK)
        out_offsets = rows64[:, None] * n_cols + cols[None, :]
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        if HAS_RESIDUAL:
            r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
            # The sum is rounded to the input dtype before it is normalized, as `residual + x` is in HF.
            s = round_to(x + r, S.dtype.element_ty, EMULATE_RNE)
            tl.store(S + out_offsets, s, mask=mask)
            x = s.to(COMPUTE)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        normed = x * rstd[:, None]
        if ROUND_NORMED:
            normed = round_to(normed, X.dtype.element_ty, EMULATE_RNE).to(COMPUTE)
        y = round_to(normed * w[None, :], Y.dtype.element_ty, EMULATE_RNE)
        tl.store(Y + out_offsets, y, mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    X, DY, DS, W, RSTD, DX, DW_PARTIAL,
    n_rows, n_cols, stride_x, stride_dy, stride_ds, tiles_per_program, offset,
    HAS_DS: tl.constexpr, STORE_DX: tl.constexpr, STORE_DW: tl.constexpr, ROUND_NORMED: tl.constexpr,
    COMPUTE: tl.constexpr, EMULATE_RNE: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """dx = rstd * (g - normed * mean(g * normed)) with g = dy * (offset + w), plus the
    new-residual gradient DS when fused; dw partial = sum over this program's rows of dy * normed."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(COMPUTE) + offset
    dw_acc = tl.zeros([BLOCK_N], dtype=COMPUTE)
    for t in tl.range(0, tiles_per_program, num_stages=NUM_STAGES):
        rows, row_mask, rows64, mask = row_tile(pid, t, tiles_per_program, n_rows, col_mask, ROW_BLOCK)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0).to(COMPUTE)
        normed = x * rstd[:, None]
        if STORE_DX:
            g = dy * w[None, :]
            proj = tl.sum(g * normed, axis=1) / n_cols
            dx = (g - normed * proj[:, None]) * rstd[:, None]
            if HAS_DS:
                dx += tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
            dx = round_to(dx, DX.dtype.element_ty, EMULATE_RNE)
            tl.store(DX + rows64[:, None] * n_cols + cols[None, :], dx, mask=mask)
        if STORE_DW:
            if ROUND_NORMED:
                normed = round_to(normed, X.dtype.element_ty, EMULATE_RNE).to(COMPUTE)
            dw_acc += tl.sum(dy * normed, axis=0)
    if STORE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc, mask=col_mask)


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, casting: str) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if casting == "llama" else x.dtype


def _rms_norm_forward(x, residual, weight, eps, offset, casting):
    """The forward launch (eager and compiled paths alike): (y, new residual or None, rstd, the
    normalized input as [rows, N]: the new residual when fused, else x)."""
    fused = residual is not None
    torch_compute, tl_compute = compute_dtype(x, weight)
    n_cols = x.shape[-1]
    n_rows = math.prod(x.shape[:-1])
    # empty_like: cheaper on the host than torch.empty(shape, dtype=, device=), and this op is host-bound
    y = torch.empty_like(x, dtype=_output_dtype(x, weight, casting), memory_format=torch.contiguous_format)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if fused else None
    rstd = torch.empty(n_rows, dtype=torch_compute, device=x.device)
    weight = weight.contiguous()
    source = new_residual if fused else x  # the tensor that gets normalized
    if x.numel() > 0:
        x_rows = as_rows(x)
        r_rows = as_rows(residual) if fused else x_rows
        plan = plan_row_tiles(n_rows, n_cols, x.device, persistent=False)
        _rms_norm_fwd_kernel[(plan.num_programs,)](
            x_rows, r_rows, new_residual if fused else y, y, weight, rstd,
            n_rows, n_cols, x_rows.stride(0), r_rows.stride(0), plan.tiles_per_program, eps, offset,
            HAS_RESIDUAL=fused, ROUND_NORMED=casting == "llama" and x.dtype != torch_compute,
            COMPUTE=tl_compute, EMULATE_RNE=is_interpreter(),
            ROW_BLOCK=plan.row_block, BLOCK_N=plan.block_n, num_warps=plan.num_warps,
        )
        source = new_residual.view(n_rows, n_cols) if fused else x_rows
    return y, new_residual, rstd, source


class _RMSNormFunction(torch.autograd.Function):
    """Plain (residual=None) and fused-add RMSNorm; the fused form also returns x + residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting):
        ctx.set_materialize_grads(False)
        y, new_residual, rstd, source = _rms_norm_forward(x, residual, weight, eps, offset, casting)
        ctx.save_for_backward(source, weight.contiguous(), rstd)
        ctx.x_shape, ctx.offset, ctx.casting, ctx.fused = x.shape, offset, casting, residual is not None
        if ctx.fused:
            return y, new_residual
        return y

    @staticmethod
    def backward(ctx, dy, d_new_residual=None):
        source, weight, rstd = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dw = ctx.needs_input_grad[2]
        dx, dw = _rms_norm_grads(source, weight, rstd, dy, d_new_residual, need_dx, need_dw, ctx.x_shape,
                                 ctx.offset, ctx.casting)
        return dx, (dx if ctx.fused else None), dw, None, None, None


def _rms_norm_grads(source, weight, rstd, dy, d_new_residual, need_dx, need_dw, x_shape, offset, casting):
    """(dx in x_shape, dw) or None for each one not needed; dy None: the normed output got no gradient."""
    dx = dw = None
    if dy is None:  # only the new residual's gradient passes through
        if need_dx and d_new_residual is not None:
            dx = d_new_residual.reshape(x_shape)
    elif source.numel() == 0:
        dx = torch.zeros(x_shape, dtype=source.dtype, device=source.device) if need_dx else None
        dw = torch.zeros_like(weight) if need_dw else None
    elif need_dx or need_dw:
        dx, dw = _rms_norm_backward(as_rows(source), weight, rstd, dy, d_new_residual, need_dx, need_dw,
                                    x_shape, offset, casting)
    return dx, dw


def _rms_norm_backward(source, weight, rstd, dy, d_new_residual, need_dx, need_dw, x_shape, offset, casting):
    n_rows, n_cols = source.shape
    torch_compute, tl_compute = compute_dtype(source, weight)
    dy_rows = as_rows(dy)
    ds_rows = as_rows(d_new_residual) if d_new_residual is not None else dy_rows
    round_normed = casting == "llama" and source.dtype != torch_compute
    split = split_backward(n_cols)
    fused_dw = need_dw and not split  # split: param_grads reduces dw down the columns instead
    plan = plan_row_tiles(n_rows, n_cols, source.device, persistent=fused_dw)
    dx = torch.empty_like(source, memory_format=torch.contiguous_format) if need_dx else dy_rows
    dw_partial = (
        torch.empty((plan.num_programs, n_cols), dtype=torch_compute, device=source.device) if fused_dw else rstd
    )
    if need_dx or fused_dw:
        _rms_norm_bwd_kernel[(plan.num_programs,)](
            source, dy_rows, ds_rows, weight, rstd, dx, dw_partial,
            n_rows, n_cols, source.stride(0), dy_rows.stride(0), ds_rows.stride(0), plan.tiles_per_program, offset,
            HAS_DS=d_new_residual is not None, STORE_DX=need_dx, STORE_DW=fused_dw, ROUND_NORMED=round_normed,
            COMPUTE=tl_compute, EMULATE_RNE=is_interpreter(),
            ROW_BLOCK=plan.row_block, BLOCK_N=plan.block_n, NUM_STAGES=plan.num_stages, num_warps=plan.num_warps,
        )
    dx = dx.view(x_shape) if need_dx else None
    dw = None
    if split and need_dw:
        dw = param_grads(source, dy_rows, rstd, dw_dtype=weight.dtype, round_normed=round_normed)[0]
    elif need_dw:
        dw = sum_partials(dw_partial, weight.dtype)[0]
    return dx, dw


# --- torch.compile: the same launches as custom ops (ops/_shared/compiled.py says why) ---------------


@torch.library.custom_op("fuseforge::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, new residual (empty without a residual), rstd)."""
    y, new_residual, rstd, _ = _rms_norm_forward(x, residual, weight, eps, offset, casting)
    return y, (new_residual if new_residual is not None else x.new_empty(0)), rstd


@_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, casting):
    rstd = x.new_empty(math.prod(x.shape[:-1]), dtype=compute_dtype(x, weight)[0])
    new_residual = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape, dtype=_output_dtype(x, weight, casting)), new_residual, rstd


@torch.library.custom_op("fuseforge::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    source: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
    d_new_residual: torch.Tensor | None, need_dx: bool, need_dw: bool, offset: float, casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw), each empty when not needed."""
    dx, dw = _rms_norm_grads(source, weight.contiguous(), rstd, dy, d_new_residual, need_dx, need_dw, source.shape,
                             offset, casting)
    return (dx if dx is not None else source.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_rms_norm_backward_op.register_fake
def _(source, weight, rstd, dy, d_new_residual, need_dx, need_dw, offset, casting):
    return (source.new_empty(source.shape) if need_dx else source.new_empty(0)), (
        weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    )


def _rms_norm_setup(ctx, inputs, output):
    x, residual, weight, eps, offset, casting = inputs
    _, new_residual, rstd = output
    ctx.save_for_backward(new_residual if residual is not None else x, weight, rstd)
    ctx.offset, ctx.casting, ctx.fused = offset, casting, residual is not None


def _rms_norm_op_backward(ctx, dy, d_new_residual, _d_rstd):
    source, weight, rstd = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    need_dw = ctx.needs_input_grad[2]
    dx, dw = _rms_norm_backward_op(source, weight, rstd, dy, d_new_residual if ctx.fused else None,
                                   need_dx, need_dw, ctx.offset, ctx.casting)
    dx, dw = (dx if need_dx else None), (dw if need_dw else None)
    return dx, (dx if ctx.fused else None), dw, None, None, None


_rms_norm_op.register_autograd(_rms_norm_op_backward, setup_context=_rms_norm_setup)


def _rms_norm(x, residual, weight, eps, offset, casting):
    """The autograd.Function eagerly (no dispatcher cost per call), the custom op under torch.compile."""
    if compiling():
        y, new_residual, _ = _rms_norm_op(x, residual, weight, eps, offset, casting)
        return (y, new_residual) if residual is not None else y
    return _RMSNormFunction.apply(x, residual, weight, eps, offset, casting)


def _check_inputs(x, weight, eps, offset, casting, residual=None) -> tuple[float, float]:
    check_tensor("x", x, min_ndim=1)
    check_tensor("weight", weight, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(weight.shape)}")
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        check_same_dtype(x=x, residual=residual)
    check_same_device(x=x, weight=weight, residual=residual)
    check_device_supported("x", x)
    eps = check_positive("eps", eps)
    try:
        offset = float(offset)
    except (TypeError, ValueError):
        raise TypeError(f"offset must be a number, got {type(offset).__name__}") from None
    if not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset}")
    if casting not in CASTING_MODES:
        raise ValueError(f"casting must be one of {CASTING_MODES}, got {casting!r}")
    return eps, offset


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """RMS-normalize the last dimension of x and scale by `offset + weight` (HF casting, see module doc)."""
    eps, offset = _check_inputs(x, weight, eps, offset, casting)
    return _rms_norm(x, None, weight, eps, offset, casting)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the sum is in x's dtype.

    x and residual must share shape and dtype. Gradients reach x, residual and weight;
    a gradient on the returned residual is added to the norm's input gradient.
    residual=None raises: the result is always the pair, and one tensor back would let
    `y, r = fused_add_rms_norm(...)` silently split it by rows.
    """
    if residual is None:
        raise TypeError("residual must be a torch.Tensor, got NoneType; without a residual use rms_norm(x, weight)")
    eps, offset = _check_inputs(x, weight, eps, offset, casting, residual=residual)
    return _rms_norm(x, residual, weight, eps, offset, casting)
