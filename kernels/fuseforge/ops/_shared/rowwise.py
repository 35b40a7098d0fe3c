"""Launch planning, 2-D row views and output rounding shared by the row-wise normalization kernels.

A row-wise kernel sees its input as [rows, N] with unit column stride. Each program
walks `tiles_per_program` tiles of `row_block` rows; every tile is held whole
(`block_n` >= N columns), so a row is read once per pass. The backward pass is
persistent (a few programs per SM) so that its per-program weight-gradient partial
sums stay small; the forward pass uses one tile per program.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuseforge.ops._shared.utils import MAX_FUSED_SIZE, is_interpreter, num_programs_hint, row_launch_config

# GPU: a tile holds about this many elements (one 4096-wide row, four 1024-wide rows, ...).
GPU_TILE_ELEMENTS = 4096
GPU_MAX_ROW_BLOCK = 32
# Elements per thread per tensor and persistent-backward programs per SM, as (rows narrower than
# GPU_WIDE_ROW, wider rows). Swept on the H200 at 4096x1024, 16384x4096 and 2048x16384 (benchmarks/
# RESULTS.md, session 3): narrow rows want few warps per program (32 bf16 = four 16-byte loads per
# thread) and 2 backward programs per SM; wide rows 16 elements (32 spill in LayerNorm's backward)
# and 1 program per SM (half as many [programs, N] partial sums to write and reduce).
GPU_WIDE_ROW = 8192
GPU_ELEMENTS_PER_THREAD = (32, 16)
GPU_BWD_PROGRAMS_PER_SM = (2, 1)
# Loop stages of the persistent backward, so the next tile's loads overlap this tile's math.
GPU_BWD_STAGES = 2
# Rows at least this wide take the split backward (`split_backward`): a row kernel without
# weight/bias accumulators writes dx, and `param_grads` reduces dw/db down the columns.
# Why: a persistent program holding [N] fp32 accumulators for dw and db runs out of
# registers at N = 16384 (one 32-warp program per SM, spilling), which left LayerNorm's
# backward at 1.2 TB/s on the H200. Reading x and dy a second time costs less than that at
# 16384 columns (LayerNorm 2048x16384: 0.213 -> 0.156 ms of kernels per step; RMSNorm level),
# but more at 8192 (LayerNorm 8192x8192: 0.249 -> 0.28-0.32 ms); session 4 in benchmarks/RESULTS.md.
SPLIT_BACKWARD_MIN_COLS = 16384
# Column kernel (GPU): tile of rows x columns, warps, and programs per SM it aims for.
GPU_PARAM_GRAD_TILE = (8, 512)
GPU_PARAM_GRAD_WARPS = 4
GPU_PARAM_GRAD_PROGRAMS_PER_SM = 4
# Interpreter: ~3.5 ms per program instance, while a tile's cost barely grows with its rows,
# so tiles are as tall as this (NOTES: 64 rows per program is ~20x faster than one).
INTERPRETER_ROW_BLOCK = 64
INTERPRETER_MAX_TILE_ELEMENTS = 1 << 19


@dataclass(frozen=True)
class RowTiling:
    block_n: int
    row_block: int
    num_warps: int
    num_programs: int
    tiles_per_program: int
    num_stages: int = 1


def plan_row_tiles(n_rows: int, n_cols: int, device: torch.device, *, persistent: bool) -> RowTiling:
    """Tile shape, warps and grid for `n_rows` rows of `n_cols` columns.

    `persistent=True` caps the grid near the number of resident programs (backward
    passes that write one partial-sum row per program); otherwise one tile per program.
    Plans are cached on every input they depend on (the tuning constants included, so that a
    changed constant takes effect): planning costs more host time than a small kernel launch.
    """
    if n_cols > MAX_FUSED_SIZE:
        raise ValueError(
            f"rows of {n_cols} elements exceed the {MAX_FUSED_SIZE} that one fused program holds; "
            "normalize over a smaller last dimension"
        )
    interpreter = is_interpreter()
    tuning = (INTERPRETER_ROW_BLOCK, INTERPRETER_MAX_TILE_ELEMENTS) if interpreter else (
        GPU_WIDE_ROW, GPU_MAX_ROW_BLOCK, GPU_TILE_ELEMENTS, GPU_ELEMENTS_PER_THREAD, GPU_BWD_PROGRAMS_PER_SM,
        GPU_BWD_STAGES)
    programs_hint = num_programs_hint(device) if persistent else 0
    return _plan_row_tiles(n_rows, n_cols, persistent, interpreter, programs_hint, tuning)


@functools.lru_cache(maxsize=4096)
def _plan_row_tiles(n_rows: int, n_cols: int, persistent: bool, interpreter: bool, programs_hint: int,
                    tuning: tuple) -> RowTiling:
    block_n, _ = row_launch_config(n_cols)
    if interpreter:
        row_block_cap, max_tile = tuning
        row_block = min(row_block_cap, triton.next_power_of_2(max(n_rows, 1)))
        row_block = max(1, min(row_block, max_tile // block_n))
        num_warps = row_launch_config(row_block * block_n)[1]
    else:
        wide_row, max_row_block, tile_elements, per_thread_by_width, programs_per_sm, bwd_stages = tuning
        wide = block_n >= wide_row
        row_block = max(1, min(max_row_block, tile_elements // block_n))
        per_thread = per_thread_by_width[wide]
        num_warps = min(32, max(1, triton.next_power_of_2(row_block * block_n // (32 * per_thread))))
    n_tiles = triton.cdiv(max(n_rows, 1), row_block)
    num_programs = n_tiles
    num_stages = 1
    if persistent:
        # A few resident programs per SM, each looping over an equal share of tiles, so
        # that the [programs, N] partial sums stay small.
        # (no more than fit at once: an SM holds 64 warps, and a second wave would idle half the GPU).
        per_sm = 1 if interpreter else max(1, min(programs_per_sm[wide], 64 // num_warps))
        num_programs = min(n_tiles, programs_hint * per_sm)
        num_stages = 1 if interpreter else bwd_stages
    tiles_per_program = triton.cdiv(n_tiles, num_programs)
    num_programs = triton.cdiv(n_tiles, tiles_per_program)
    return RowTiling(block_n, row_block, num_warps, num_programs, tiles_per_program, num_stages)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, N] with unit column stride; a view whenever one exists (sliced or
    broadcast rows keep their row stride), otherwise a contiguous copy."""
    rows = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])  # (no reshape call for rows already: host time)
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


@triton.jit
def row_tile(pid, t, tiles_per_program, n_rows, col_mask, ROW_BLOCK: tl.constexpr):
    """Tile `t` of program `pid`: (rows, row mask, rows as int64 for addressing, [ROW_BLOCK, BLOCK_N] mask)."""
    rows = (pid * tiles_per_program + t) * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
    row_mask = rows < n_rows
    return rows, row_mask, rows.to(tl.int64), row_mask[:, None] & col_mask[None, :]


@triton.jit
def round_to(v, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """`v` rounded to DTYPE with round-to-nearest-even, as torch and the GPU round.

    Triton's interpreter truncates fp32 -> bf16, so there (EMULATE_RNE) the rounding
    is done on the bits; on the GPU the hardware conversion already rounds to nearest even.
    """
    if DTYPE == tl.bfloat16:
        v32 = v.to(tl.float32)
        if EMULATE_RNE:
            bits = v32.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            out = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
        else:
            out = v32.to(tl.bfloat16)
    else:
        out = v.to(DTYPE)
    return out


@triton.jit
def _sum_partials_kernel(
    P1, OUT1, P2, OUT2, n_partials, n_cols,
    HAS_SECOND: tl.constexpr, EMULATE_RNE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """OUT[c] = sum over rows of P[:, c] (fixed order: deterministic), rounded once to OUT's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc1 = tl.zeros([BLOCK_P, BLOCK_N], dtype=P1.dtype.element_ty)
    acc2 = tl.zeros([BLOCK_P, BLOCK_N], dtype=P1.dtype.element_ty)
    for p0 in range(0, n_partials, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        acc1 += tl.load(P1 + offsets, mask=mask, other=0.0)
        if HAS_SECOND:
            acc2 += tl.load(P2 + offsets, mask=mask, other=0.0)
    tl.store(OUT1 + cols, round_to(tl.sum(acc1, axis=0), OUT1.dtype.element_ty, EMULATE_RNE), mask=col_mask)
    if HAS_SECOND:
        tl.store(OUT2 + cols, round_to(tl.sum(acc2, axis=0), OUT2.dtype.element_ty, EMULATE_RNE), mask=col_mask)


def sum_partials(
    partial: torch.Tensor | None,
    dtype: torch.dtype | None,
    second: torch.Tensor | None = None,
    second_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Column sums of one or two [programs, N] partial-sum buffers (a weight's and a bias's
    gradient), each in its parameter's dtype: one launch where `.sum(0).to(dtype)` takes two per buffer.
    Either buffer may be None (that gradient is not wanted); its sum is then None too."""
    if partial is None:
        return None, (sum_partials(second, second_dtype)[0] if second is not None else None)
    n_partials, n_cols = partial.shape
    out = torch.empty(n_cols, dtype=dtype, device=partial.device)
    out2 = torch.empty(n_cols, dtype=second_dtype, device=partial.device) if second is not None else None
    if is_interpreter():
        block_n = 128
    else:  # narrow column blocks for narrow rows, so that a few hundred programs share the reads
        block_n = max(16, min(128, triton.next_power_of_2(triton.cdiv(n_cols, 2 * num_programs_hint(partial.device)))))
    block_p = min(64, triton.next_power_of_2(max(n_partials, 1)))
    _sum_partials_kernel[(triton.cdiv(n_cols, block_n),)](
        partial, out, second if second is not None else partial, out2 if out2 is not None else out, n_partials, n_cols,
        HAS_SECOND=second is not None, EMULATE_RNE=is_interpreter(), BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4,
    )
    return out, out2


def split_backward(n_cols: int) -> bool:
    """Whether rows of `n_cols` take the split backward (dx kernel + column-parallel dw/db)."""
    return row_launch_config(n_cols)[0] >= SPLIT_BACKWARD_MIN_COLS


@triton.jit
def _param_grads_kernel(
    X, DY, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL,
    n_rows, n_cols, stride_x, stride_dy, rows_per_group,
    HAS_MEAN: tl.constexpr, STORE_DW: tl.constexpr, STORE_DB: tl.constexpr, ROUND_NORMED: tl.constexpr,
    COMPUTE: tl.constexpr, EMULATE_RNE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Over one group of rows and one block of columns: dw = sum dy * normed and db = sum dy,
    with normed = (x - mean) * rstd (x * rstd without a mean; rounded to x's dtype when
    ROUND_NORMED, as the llama-cast RMSNorm forward multiplies it)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    first = tl.program_id(1) * rows_per_group
    end = tl.minimum(first + rows_per_group, n_rows)
    dw_acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=COMPUTE)
    db_acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=COMPUTE)
    for r0 in range(first, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        if STORE_DW:
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0).to(COMPUTE)
            if HAS_MEAN:
                x -= tl.load(MEAN + rows, mask=row_mask, other=0.0).to(COMPUTE)[:, None]
            normed = x * rstd[:, None]
            if ROUND_NORMED:
                normed = round_to(normed, X.dtype.element_ty, EMULATE_RNE).to(COMPUTE)
            dw_acc += dy * normed  # dy is 0 outside the mask
        if STORE_DB:
            db_acc += dy
    out = tl.program_id(1) * n_cols + cols
    if STORE_DW:
        tl.store(DW_PARTIAL + out, tl.sum(dw_acc, axis=0), mask=col_mask)
    if STORE_DB:
        tl.store(DB_PARTIAL + out, tl.sum(db_acc, axis=0), mask=col_mask)


def param_grads(
    x_rows: torch.Tensor,
    dy_rows: torch.Tensor,
    rstd: torch.Tensor,
    *,
    mean: torch.Tensor | None = None,
    dw_dtype: torch.dtype | None = None,
    db_dtype: torch.dtype | None = None,
    round_normed: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A norm's weight gradient (when `dw_dtype` is given) and bias gradient (`db_dtype`),
    reduced down the columns of x and dy [rows, N]: column blocks times row groups fill the
    GPU, each group writes one fp32 partial row, and sum_partials adds them in a fixed order."""
    n_rows, n_cols = x_rows.shape
    torch_compute, tl_compute = compute_dtype(x_rows, rstd)
    if is_interpreter():
        (block_r, block_c), warps, wanted = (64, 128), 4, num_programs_hint(x_rows.device)
    else:
        (block_r, block_c), warps = GPU_PARAM_GRAD_TILE, GPU_PARAM_GRAD_WARPS
        wanted = num_programs_hint(x_rows.device) * GPU_PARAM_GRAD_PROGRAMS_PER_SM
    block_c = min(block_c, triton.next_power_of_2(n_cols))
    col_blocks = triton.cdiv(n_cols, block_c)
    n_groups = max(1, min(triton.cdiv(wanted, col_blocks), triton.cdiv(n_rows, block_r)))
    rows_per_group = triton.cdiv(triton.cdiv(n_rows, n_groups), block_r) * block_r
    n_groups = triton.cdiv(n_rows, rows_per_group)
    store_dw, store_db = dw_dtype is not None, db_dtype is not None
    dw_partial = torch.empty((n_groups, n_cols), dtype=torch_compute, device=x_rows.device) if store_dw else None
    db_partial = torch.empty((n_groups, n_cols), dtype=torch_compute, device=x_rows.device) if store_db else None
    _param_grads_kernel[(col_blocks, n_groups)](
        x_rows, dy_rows, mean if mean is not None else rstd, rstd,
        dw_partial if store_dw else rstd, db_partial if store_db else rstd,
        n_rows, n_cols, x_rows.stride(0), dy_rows.stride(0), rows_per_group,
        HAS_MEAN=mean is not None, STORE_DW=store_dw, STORE_DB=store_db, ROUND_NORMED=round_normed,
        COMPUTE=tl_compute, EMULATE_RNE=is_interpreter(), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )
    return sum_partials(dw_partial, dw_dtype, db_partial, db_dtype)


def compute_dtype(*tensors: torch.Tensor | None) -> tuple[torch.dtype, tl.dtype]:
    """fp64 math when any operand is fp64 (exact gradchecks), fp32 otherwise."""
    for t in tensors:  # a loop, not any(): this runs on every launch
        if t is not None and t.dtype == torch.float64:
            return torch.float64, tl.float64
    return torch.float32, tl.float32
