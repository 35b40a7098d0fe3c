"""LayerNorm over the last dimension: one-pass Triton forward and backward.

Matches torch.nn.functional.layer_norm: statistics and the affine transform in fp32
(fp64 when any operand is fp64), one rounding to x's dtype; the output has x's dtype.
weight and bias are optional and independent, and may have a different float dtype
than x (an fp32 weight with a bf16 x is allowed).

The forward saves only the per-row mean and rstd; the backward recomputes the
normalized rows, reads x and dy once, writes dx once, and reduces the weight and bias
gradients deterministically (one partial row per program, both summed by one small kernel).
Wide rows (rowwise.split_backward) read x and dy once more instead: dx from a row kernel
without accumulators, dw and db from a column-parallel kernel (rowwise.param_grads). Input rows
may have any row stride; other layouts are copied to contiguous first.
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
from fuseforge.ops._shared.utils import check_device_supported, check_same_device, check_tensor, is_interpreter


@triton.jit
def _layer_norm_fwd_kernel(
    X, Y, W, B, MEAN, RSTD,
    n_rows, n_cols, stride_x, tiles_per_program, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr,
    EMULATE_RNE: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(COMPUTE)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(COMPUTE)
    for t in range(tiles_per_program):
        rows, row_mask, rows64, mask = row_tile(pid, t, tiles_per_program, n_rows, col_mask, ROW_BLOCK)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        mean = tl.sum(x, axis=1) / n_cols
        centered = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
        tl.store(MEAN + rows, mean, mask=row_mask)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = centered * rstd[:, None]
        if HAS_WEIGHT:
            y = y * w[None, :]
        if HAS_BIAS:
            y = y + b[None, :]
        y = round_to(y, Y.dtype.element_ty, EMULATE_RNE)
        tl.store(Y + rows64[:, None] * n_cols + cols[None, :], y, mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    X, DY, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    n_rows, n_cols, stride_x, stride_dy, tiles_per_program,
    HAS_WEIGHT: tl.constexpr, STORE_DX: tl.constexpr, STORE_DW: tl.constexpr, STORE_DB: tl.constexpr,
    COMPUTE: tl.constexpr, EMULATE_RNE: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w; partial
    dw = sum dy * xhat and db = sum dy over this program's rows."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(COMPUTE)
    dw_acc = tl.zeros([BLOCK_N], dtype=COMPUTE)
    db_acc = tl.zeros([BLOCK_N], dtype=COMPUTE)
    for t in tl.range(0, tiles_per_program, num_stages=NUM_STAGES):
        rows, row_mask, rows64, mask = row_tile(pid, t, tiles_per_program, n_rows, col_mask, ROW_BLOCK)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0).to(COMPUTE)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0).to(COMPUTE)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if STORE_DX:
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            g_mean = tl.sum(g, axis=1) / n_cols
            proj = tl.sum(g * xhat, axis=1) / n_cols
            dx = (g - g_mean[:, None] - xhat * proj[:, None]) * rstd[:, None]
            dx = round_to(dx, DX.dtype.element_ty, EMULATE_RNE)
            tl.store(DX + rows64[:, None] * n_cols + cols[None, :], dx, mask=mask)
        if STORE_DW:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if STORE_DB:
            db_acc += tl.sum(dy, axis=0)
    if STORE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc, mask=col_mask)
    if STORE_DB:
        tl.store(DB_PARTIAL + pid * n_cols + cols, db_acc, mask=col_mask)


def _layer_norm_forward(x, weight, bias, eps):
    """The forward launch (eager and compiled paths): (y, mean, rstd, x as [rows, N])."""
    torch_compute, tl_compute = compute_dtype(x, weight, bias)
    n_cols = x.shape[-1]
    n_rows = math.prod(x.shape[:-1])
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch_compute, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch_compute, device=x.device)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    x_rows = x
    if x.numel() > 0:
        x_rows = as_rows(x)
        plan = plan_row_tiles(n_rows, n_cols, x.device, persistent=False)
        _layer_norm_fwd_kernel[(plan.num_programs,)](
            x_rows, y, weight if weight is not None else x_rows, bias if bias is not None else x_rows, mean, rstd,
            n_rows, n_cols, x_rows.stride(0), plan.tiles_per_program, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, COMPUTE=tl_compute,
            EMULATE_RNE=is_interpreter(), ROW_BLOCK=plan.row_block, BLOCK_N=plan.block_n, num_warps=plan.num_warps,
        )
    return y, mean, rstd, x_rows


def _layer_norm_backward(x_rows, weight, bias, mean, rstd, dy, need_dx, need_dw, need_db, x_shape):
    """The backward launches: (dx in x_shape, dw, db), None for each one not needed."""
    if x_rows.numel() == 0:
        dx = torch.zeros(x_shape, dtype=x_rows.dtype, device=x_rows.device) if need_dx else None
        dw = torch.zeros_like(weight) if need_dw else None
        db = torch.zeros_like(bias) if need_db else None
        return dx, dw, db
    if not (need_dx or need_dw or need_db):
        return None, None, None
    n_rows, n_cols = x_rows.shape
    torch_compute, tl_compute = compute_dtype(x_rows, weight, bias)
    dy_rows = as_rows(dy)
    split = split_backward(n_cols)
    # Split: the row kernel writes dx only, and param_grads reduces dw/db down the columns.
    fused_dw, fused_db = need_dw and not split, need_db and not split
    dx = torch.empty((n_rows, n_cols), dtype=x_rows.dtype, device=x_rows.device) if need_dx else dy_rows
    plan = plan_row_tiles(n_rows, n_cols, x_rows.device, persistent=fused_dw or fused_db)
    partial_shape = (plan.num_programs, n_cols)
    dw_partial = torch.empty(partial_shape, dtype=torch_compute, device=x_rows.device) if fused_dw else rstd
    db_partial = torch.empty(partial_shape, dtype=torch_compute, device=x_rows.device) if fused_db else rstd
    if need_dx or fused_dw or fused_db:
        _layer_norm_bwd_kernel[(plan.num_programs,)](
            x_rows, dy_rows, weight if weight is not None else x_rows, mean, rstd, dx, dw_partial, db_partial,
            n_rows, n_cols, x_rows.stride(0), dy_rows.stride(0), plan.tiles_per_program,
            HAS_WEIGHT=weight is not None, STORE_DX=need_dx, STORE_DW=fused_dw, STORE_DB=fused_db,
            COMPUTE=tl_compute, EMULATE_RNE=is_interpreter(),
            ROW_BLOCK=plan.row_block, BLOCK_N=plan.block_n, NUM_STAGES=plan.num_stages, num_warps=plan.num_warps,
        )
    dx = dx.view(x_shape) if need_dx else None
    dw_dtype = weight.dtype if need_dw else None
    db_dtype = bias.dtype if need_db else None
    dw = db = None
    if split and (need_dw or need_db):
        dw, db = param_grads(x_rows, dy_rows, rstd, mean=mean, dw_dtype=dw_dtype, db_dtype=db_dtype)
    elif need_dw or need_db:
        dw, db = sum_partials(dw_partial if need_dw else None, dw_dtype, db_partial if need_db else None, db_dtype)
    return dx, dw, db


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd, x_rows = _layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x_rows, weight.contiguous() if weight is not None else None,
                              bias.contiguous() if bias is not None else None, mean, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x_rows, weight, bias, mean, rstd = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = _layer_norm_backward(x_rows, weight, bias, mean, rstd, dy, need_dx, need_dw, need_db, ctx.x_shape)
        return dx, dw, db, None


# --- torch.compile: the same launches as custom ops (ops/_shared/compiled.py says why) ---------------


@torch.library.custom_op("fuseforge::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd)."""
    return _layer_norm_forward(x, weight, bias, eps)[:3]


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    stats = x.new_empty(math.prod(x.shape[:-1]), dtype=compute_dtype(x, weight, bias)[0])
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


@torch.library.custom_op("fuseforge::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
    dy: torch.Tensor, need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db), each empty when not needed (or without its parameter)."""
    x_rows = as_rows(x) if x.numel() > 0 else x
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    grads = _layer_norm_backward(x_rows, weight, bias, mean, rstd, dy, need_dx, need_dw, need_db, x.shape)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@_layer_norm_backward_op.register_fake
def _(x, weight, bias, mean, rstd, dy, need_dx, need_dw, need_db):
    return (
        x.new_empty(x.shape) if need_dx else x.new_empty(0),
        weight.new_empty(weight.shape) if need_dw else x.new_empty(0),
        bias.new_empty(bias.shape) if need_db else x.new_empty(0),
    )


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _layer_norm_op_backward(ctx, dy, _d_mean, _d_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    need_dw, need_db = need_dw and weight is not None, need_db and bias is not None
    dx, dw, db = _layer_norm_backward_op(x, weight, bias, mean, rstd, dy, need_dx, need_dw, need_db)
    return (dx if need_dx else None), (dw if need_dw else None), (db if need_db else None), None


_layer_norm_op.register_autograd(_layer_norm_op_backward, setup_context=_layer_norm_setup)


def _check_affine(name: str, t: torch.Tensor | None, n_cols: int) -> None:
    if t is None:
        return
    check_tensor(name, t, ndim=1)
    if t.shape[0] != n_cols:
        raise ValueError(f"{name} must have shape ({n_cols},) to match x's last dimension, got {tuple(t.shape)}")


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over x's last dimension, then `* weight` and `+ bias` when given."""
    check_tensor("x", x, min_ndim=1)
    _check_affine("weight", weight, x.shape[-1])
    _check_affine("bias", bias, x.shape[-1])
    check_same_device(x=x, weight=weight, bias=bias)
    check_device_supported("x", x)
    eps = check_positive("eps", eps)
    if compiling():
        return _layer_norm_op(x, weight, bias, eps)[0]
    return _LayerNormFunction.apply(x, weight, bias, eps)
