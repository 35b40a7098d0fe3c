"""Generalized Jensen-Shannon divergence for distillation: on log-probabilities and fused with the LM heads.

Definition (per row, P_s = student, P_t = teacher distribution over the vocabulary):

    M       = beta * P_t + (1 - beta) * P_s
    JSD_beta = beta * KL(P_t || M) + (1 - beta) * KL(P_s || M)

At beta = 0 and beta = 1 the mixture collapses onto one of the two distributions and
JSD_beta is identically 0, which would train nothing. The first-order expansion
JSD_beta = beta * KL(P_t || P_s) + O(beta^2) (and symmetrically around beta = 1) gives the
conventional endpoints used in distillation (GKD, Agarwal et al. 2024), implemented here:

    beta = 0:  KL(P_t || P_s)   forward KL  (= lim JSD_beta / beta)
    beta = 1:  KL(P_s || P_t)   reverse KL  (= lim JSD_beta / (1 - beta))

so the endpoints are not continuous with the unnormalised interior (JSD_beta -> 0 there).

The teacher is a constant: no gradient flows to teacher log-probs, hidden states or weights,
whatever their `requires_grad`, as in every distillation setup. The gradient w.r.t. the student
is computed in the forward pass (one streaming pass over the vocabulary, fp32 math) and only
scaled by the upstream gradient in backward, in place; so each graph can be backpropagated once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from fuseforge.loss_args import IGNORE_INDEX, MIN_CHUNK_TOKENS, check_chunk_size
from fuseforge.checks import check_int64, check_positive, check_reduction
from fuseforge.ops._shared.lm_head import check_lm_head_inputs
from fuseforge.ops._shared.utils import (
    TRAINING_DTYPES,
    check_device_supported,
    check_same_device,
    check_tensor,
    is_interpreter,
    row_launch_config,
)

JSD_REDUCTIONS = ("batchmean", "sum", "mean", "none")
INDEX_DTYPES = (torch.int64, torch.int32)

# Widest vocabulary block one program holds at a time (the row is streamed in blocks of this).
MAX_BLOCK_COLS = 4096
# Elements per program tile: several short rows share a program so that small vocabularies
# (and the CPU interpreter, ~3.5 ms per program) do not pay one launch slot per row.
_GPU_TILE = 4096
_INTERPRETER_TILE = 65536

_BETA_FORWARD_KL, _BETA_REVERSE_KL, _BETA_MIXTURE = 0, 1, 2


def _row_tiles(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) for kernels that stream rows block by block."""
    block_cols = min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK_COLS)
    tile = _INTERPRETER_TILE if is_interpreter() else _GPU_TILE
    block_rows = max(1, min(triton.next_power_of_2(max(n_rows, 1)), tile // block_cols))
    _, warps = row_launch_config(block_rows * block_cols)
    return block_rows, block_cols, warps


def check_beta(beta: float) -> float:
    try:
        b = float(beta)
    except (TypeError, ValueError):
        raise TypeError(f"beta must be a number in [0, 1], got {type(beta).__name__}") from None
    if not 0.0 <= b <= 1.0:  # also rejects NaN
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return b


def _beta_mode(beta: float) -> int:
    if beta == 0.0:
        return _BETA_FORWARD_KL
    if beta == 1.0:
        return _BETA_REVERSE_KL
    return _BETA_MIXTURE


def _check_target(target, lead_shape: torch.Size, like: str) -> None:
    if target is None:
        return
    check_tensor("target", target, dtypes=INDEX_DTYPES)
    if target.shape != lead_shape:
        raise ValueError(
            f"target must have shape {tuple(lead_shape)} (the leading dimensions of {like}), got {tuple(target.shape)}"
        )


def _row_scale(target, ignore_index: int, n_rows: int, per_row: int, device) -> torch.Tensor:
    """1 / (number of counted elements) as a device scalar: no host sync, 0 loss when all rows are ignored."""
    if target is None:
        count = torch.tensor(float(n_rows * per_row), device=device)
    else:
        # In int64, as the kernels compare: torch wraps 2**40 to 0 against an int32 tensor.
        count = (target.to(torch.int64) != ignore_index).sum().to(torch.float32) * per_row
    return 1.0 / count.clamp(min=1.0)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _jsd_pointwise(s, t, beta, BETA_MODE: tl.constexpr):
    """Elementwise generalized-JSD term and its derivative w.r.t. the student log-prob `s` (fp32).

    Terms with a zero probability contribute 0 (x log x -> 0), so -inf log-probs and masked
    lanes (s = t = -inf) give 0 loss and 0 gradient instead of NaN. The test is `p != 0`, not
    `p > 0`, so that a NaN input stays NaN in the loss and gradient, as in torch.
    """
    p_s = tl.exp(s)
    p_t = tl.exp(t)
    if BETA_MODE == 0:  # forward KL(P_t || P_s)
        loss = tl.where(p_t != 0.0, p_t * (t - s), 0.0)
        grad = -p_t
    elif BETA_MODE == 1:  # reverse KL(P_s || P_t)
        log_ratio = s - t
        loss = tl.where(p_s != 0.0, p_s * log_ratio, 0.0)
        grad = tl.where(p_s != 0.0, p_s * (log_ratio + 1.0), 0.0)
    else:
        log_m = tl.log(beta * p_t + (1.0 - beta) * p_s)
        student_term = tl.where(p_s != 0.0, p_s * (s - log_m), 0.0)
        teacher_term = tl.where(p_t != 0.0, p_t * (t - log_m), 0.0)
        # d/ds of the whole row loss reduces to (1 - beta) * p_s * (s - log m): the terms through M cancel.
        grad = (1.0 - beta) * student_term
        loss = beta * teacher_term + grad
    return loss, grad


@triton.jit
def _row_mask(target_ptr, rows, n_rows, ignore_index, HAS_TARGET: tl.constexpr):
    """Rows that exist and are not ignored."""
    ok = rows < n_rows
    if HAS_TARGET:
        tgt = tl.load(target_ptr + rows, mask=ok, other=0)
        ok = ok & (tgt != ignore_index)
    return ok


@triton.jit
def _jsd_logp_kernel(
    s_ptr, s_stride, t_ptr, t_stride, target_ptr, grad_ptr, loss_ptr, scale_ptr,
    n_rows, n_cols, beta, ignore_index,
    HAS_TARGET: tl.constexpr, BETA_MODE: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """One pass over each row block: per-row loss, and dLoss/d(student log-prob) * scale."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = _row_mask(target_ptr, rows, n_rows, ignore_index, HAS_TARGET)
    rows64 = rows.to(tl.int64)
    scale = tl.load(scale_ptr)
    acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = cols < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        s = tl.load(s_ptr + rows64[:, None] * s_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        t = tl.load(t_ptr + rows64[:, None] * t_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.where(mask, s, float("-inf"))
        t = tl.where(mask, t, float("-inf"))
        # Masked lanes (ignored rows, the tail block) are -inf on both sides: exactly 0 loss and gradient.
        loss, grad = _jsd_pointwise(s, t, beta, BETA_MODE)
        acc += tl.sum(loss, axis=1)
        if COMPUTE_GRAD:
            out_mask = (rows < n_rows)[:, None] & col_ok[None, :]
            grad = (grad * scale).to(grad_ptr.dtype.element_ty)
            tl.store(grad_ptr + rows64[:, None] * n_cols + cols[None, :], grad, mask=out_mask)
    tl.store(loss_ptr + rows, acc, mask=rows < n_rows)


@triton.jit
def _tempered_log_probs(zs_rows, zt_rows, cols, row_ok, col_ok, lse_s, lse_t, inv_temperature):
    """Student and teacher log-softmax(z / T) of one column block, given each row's log-sum-exp;
    -inf past the last column, so those lanes add exactly 0 loss and gradient."""
    mask = row_ok[:, None] & col_ok
    zs = tl.load(zs_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    zt = tl.load(zt_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.where(col_ok, zs * inv_temperature - lse_s[:, None], float("-inf"))
    t = tl.where(col_ok, zt * inv_temperature - lse_t[:, None], float("-inf"))
    return s, t


@triton.jit
def _jsd_logits_kernel(
    zs_ptr, zs_stride, zt_ptr, zt_stride, target_ptr, loss_ptr, scale_ptr,
    n_rows, n_cols, inv_temperature, beta, ignore_index,
    HAS_TARGET: tl.constexpr, BETA_MODE: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """JSD between softmax(z_s / T) and softmax(z_t / T); dLoss/dz_s * scale overwrites z_s.

    Pass 1: online log-sum-exp of both tempered rows. Pass 2: row loss and sum_j dL/ds_j.
    Pass 3: chain rule through log-softmax, dL/dz_i = (dL/ds_i - p_s,i * sum_j dL/ds_j) / T.
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = _row_mask(target_ptr, rows, n_rows, ignore_index, HAS_TARGET)
    rows64 = rows.to(tl.int64)
    zs_rows = zs_ptr + rows64[:, None] * zs_stride
    zt_rows = zt_ptr + rows64[:, None] * zt_stride

    # Ignored rows are never read (masked loads of 0 keep their arithmetic finite) and give 0.
    max_s = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    max_t = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    sum_s = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    sum_t = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = (cols < n_cols)[None, :]
        mask = row_ok[:, None] & col_ok
        zs = tl.load(zs_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * inv_temperature
        zt = tl.load(zt_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * inv_temperature
        zs = tl.where(col_ok, zs, float("-inf"))
        zt = tl.where(col_ok, zt, float("-inf"))
        new_max_s = tl.maximum(max_s, tl.max(zs, axis=1))
        new_max_t = tl.maximum(max_t, tl.max(zt, axis=1))
        sum_s = sum_s * tl.exp(max_s - new_max_s) + tl.sum(tl.exp(zs - new_max_s[:, None]), axis=1)
        sum_t = sum_t * tl.exp(max_t - new_max_t) + tl.sum(tl.exp(zt - new_max_t[:, None]), axis=1)
        max_s = new_max_s
        max_t = new_max_t
    lse_s = max_s + tl.log(sum_s)
    lse_t = max_t + tl.log(sum_t)

    loss_acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    grad_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = (cols < n_cols)[None, :]
        s, t = _tempered_log_probs(zs_rows, zt_rows, cols, row_ok, col_ok, lse_s, lse_t, inv_temperature)
        loss, grad = _jsd_pointwise(s, t, beta, BETA_MODE)
        loss_acc += tl.sum(loss, axis=1)
        grad_sum += tl.sum(grad, axis=1)
    tl.store(loss_ptr + rows, tl.where(row_ok, loss_acc, 0.0), mask=rows < n_rows)

    if COMPUTE_GRAD:
        scale = tl.load(scale_ptr) * inv_temperature
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            col_ok = (cols < n_cols)[None, :]
            s, t = _tempered_log_probs(zs_rows, zt_rows, cols, row_ok, col_ok, lse_s, lse_t, inv_temperature)
            _, grad = _jsd_pointwise(s, t, beta, BETA_MODE)
            dz = (grad - tl.exp(s) * grad_sum[:, None]) * scale
            dz = tl.where(row_ok[:, None], dz, 0.0)
            out_mask = (rows < n_rows)[:, None] & col_ok
            tl.store(zs_rows + cols[None, :], dz.to(zs_ptr.dtype.element_ty), mask=out_mask)


# ------------------------------------------------------------------------------ jsd on log-probs


_CONSUMED = object()


def _take_saved(ctx, name: str):
    """Hand over a gradient buffer computed in forward; it is scaled in place, so only once."""
    saved = getattr(ctx, name)
    if saved is _CONSUMED:
        raise RuntimeError(
            "fuseforge distillation losses compute their gradient in the forward pass and scale it in place during "
            "backward, so each graph can be backpropagated only once (recompute the loss instead of retain_graph=True)"
        )
    setattr(ctx, name, _CONSUMED)
    return saved


class _JSDFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logp, teacher_logp, target, beta, ignore_index, reduction, compute_grad):
        n_rows, n_cols = student_logp.shape
        device = student_logp.device
        per_row = n_cols if reduction == "mean" else 1
        if reduction in ("batchmean", "mean"):
            scale = _row_scale(target, ignore_index, n_rows, per_row, device)
        else:
            scale = torch.ones((), dtype=torch.float32, device=device)
        row_loss = torch.empty(n_rows, dtype=torch.float32, device=device)
        grad = torch.empty_like(student_logp) if compute_grad else None
        if n_rows > 0:
            block_rows, block_cols, warps = _row_tiles(n_rows, n_cols)
            _jsd_logp_kernel[(triton.cdiv(n_rows, block_rows),)](
                student_logp, student_logp.stride(0), teacher_logp, teacher_logp.stride(0),
                target if target is not None else row_loss, grad if compute_grad else row_loss, row_loss, scale,
                n_rows, n_cols, beta, ignore_index,
                HAS_TARGET=target is not None, BETA_MODE=_beta_mode(beta), COMPUTE_GRAD=compute_grad,
                BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps,
            )
        ctx.grad_student = grad
        ctx.reduction = reduction
        if reduction == "none":
            return row_loss.to(student_logp.dtype)
        return (row_loss.sum() * scale).to(student_logp.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad = _take_saved(ctx, "grad_student")
        if grad is None:
            return (None,) * 7
        if ctx.reduction == "none":
            grad.mul_(grad_output.unsqueeze(1))
        else:
            grad.mul_(grad_output)
        return grad, None, None, None, None, None, None


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Row views with any row stride are read in place; only a strided last dimension is copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def jsd(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    target: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Generalized JSD between student and teacher log-probabilities [..., V] (see the module docstring).

    Rows whose `target` equals `ignore_index` contribute neither loss nor gradient. Reductions:
    "batchmean" = sum / non-ignored rows (the divergence per token), "sum", "mean" = sum /
    (non-ignored rows * V), "none" = per-row divergences of shape [...] (0 for ignored rows).
    All-ignored input gives 0 loss and zero gradients. Math is fp32; the loss and the student
    gradient come back in `student_logp.dtype`. `teacher_logp` gets no gradient.
    """
    check_tensor("student_logp", student_logp, min_ndim=2, dtypes=TRAINING_DTYPES)
    check_tensor("teacher_logp", teacher_logp, min_ndim=2, dtypes=TRAINING_DTYPES)
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(
            f"student_logp and teacher_logp must have the same shape, got {tuple(student_logp.shape)} "
            f"and {tuple(teacher_logp.shape)}"
        )
    if student_logp.shape[-1] == 0:
        raise ValueError("student_logp has an empty vocabulary dimension (size 0)")
    _check_target(target, student_logp.shape[:-1], "student_logp")
    beta = check_beta(beta)
    check_reduction(reduction, JSD_REDUCTIONS)
    check_same_device(student_logp=student_logp, teacher_logp=teacher_logp, target=target)
    check_device_supported("student_logp", student_logp)

    lead_shape, n_cols = student_logp.shape[:-1], student_logp.shape[-1]
    s2 = _last_dim_contiguous(student_logp.reshape(-1, n_cols))
    t2 = _last_dim_contiguous(teacher_logp.detach().reshape(-1, n_cols))
    tgt = target.reshape(-1).contiguous() if target is not None else None
    compute_grad = torch.is_grad_enabled() and student_logp.requires_grad
    loss = _JSDFunction.apply(s2, t2, tgt, beta, check_int64("ignore_index", ignore_index), reduction, compute_grad)
    return loss.view(lead_shape) if reduction == "none" else loss


# ------------------------------------------------------------------------- fused linear + jsd

def default_chunk_size(n_tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: one [chunk, V] logits buffer about the size of the student hidden states,
    but at least MIN_CHUNK_TOKENS (and at most n_tokens)."""
    by_memory = math.ceil(n_tokens * hidden / max(vocab, 1))
    chunk = max(MIN_CHUNK_TOKENS, 64 * math.ceil(by_memory / 64))
    return max(1, min(n_tokens, chunk))


class _FusedLinearJSDFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, student_hidden, student_weight, teacher_hidden, teacher_weight, target,
        beta, temperature, ignore_index, chunk_size, grad_hidden_needed, grad_weight_needed,
    ):
        n_tokens = student_hidden.shape[0]
        vocab = student_weight.shape[0]
        device = student_hidden.device
        compute_grad = grad_hidden_needed or grad_weight_needed
        scale = _row_scale(target, ignore_index, n_tokens, 1, device)
        row_loss = torch.empty(n_tokens, dtype=torch.float32, device=device)
        grad_hidden = torch.empty_like(student_hidden) if grad_hidden_needed else None
        # Accumulated in the weight dtype, one rounding per chunk (cuBLAS adds in fp32).
        grad_weight = torch.zeros_like(student_weight) if grad_weight_needed else None

        chunk = max(1, min(chunk_size, n_tokens))
        student_logits = torch.empty(chunk, vocab, dtype=student_hidden.dtype, device=device)
        teacher_logits = torch.empty(chunk, vocab, dtype=teacher_hidden.dtype, device=device)
        with torch.autocast(device.type, enabled=False):  # the matmuls write into fixed-dtype buffers
            for start in range(0, n_tokens, chunk):
                end = min(start + chunk, n_tokens)
                h_s = student_hidden[start:end]
                z_s, z_t = student_logits[: end - start], teacher_logits[: end - start]
                torch.mm(h_s, student_weight.t(), out=z_s)
                torch.mm(teacher_hidden[start:end], teacher_weight.t(), out=z_t)
                block_rows, block_cols, warps = _row_tiles(end - start, vocab)
                _jsd_logits_kernel[(triton.cdiv(end - start, block_rows),)](
                    z_s, z_s.stride(0), z_t, z_t.stride(0),
                    target[start:end] if target is not None else row_loss, row_loss[start:end], scale,
                    end - start, vocab, 1.0 / temperature, beta, ignore_index,
                    HAS_TARGET=target is not None, BETA_MODE=_beta_mode(beta), COMPUTE_GRAD=compute_grad,
                    BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps,
                )
                # z_s now holds dLoss/dz_s for this chunk.
                if grad_hidden_needed:
                    torch.mm(z_s, student_weight, out=grad_hidden[start:end])
                if grad_weight_needed:
                    grad_weight.addmm_(z_s.t(), h_s)

        ctx.grad_hidden = grad_hidden
        ctx.grad_weight = grad_weight
        return (row_loss.sum() * scale).to(student_hidden.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad_hidden = _take_saved(ctx, "grad_hidden")
        grad_weight = _take_saved(ctx, "grad_weight")
        for g in (grad_hidden, grad_weight):
            if g is not None:
                g.mul_(grad_output)
        return (grad_hidden, grad_weight) + (None,) * 9


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Generalized JSD of softmax(h_s W_s^T / T) against softmax(h_t W_t^T / T), batchmean over tokens.

    The [tokens, V] logits are never materialised: tokens are processed in chunks (`chunk_size`,
    default `default_chunk_size`), each chunk's gradient w.r.t. the student logits overwrites its
    logits buffer and is folded into the student hidden/weight gradients right away. Hidden sizes
    of student [..., Hs] and teacher [..., Ht] may differ; the vocabulary (weights [V, Hs] and
    [V, Ht]) must match. Tokens whose `target` equals `ignore_index` are excluded from the loss and
    the mean. The loss is not multiplied by T^2 (multiply it yourself for Hinton-style scaling).
    Teacher tensors are constants: they get no gradient.
    """
    # Each head on its own (target against the student's tokens; the teacher's must be the same ones). The heads
    # do not run in the autocast dtype: each head's hidden and weight must share a dtype (the two heads need not).
    check_lm_head_inputs(student_hidden, student_weight, None, target, prefix="student_", min_ndim=2,
                         target_dtypes=INDEX_DTYPES, autocast=False)
    check_lm_head_inputs(teacher_hidden, teacher_weight, None, None, prefix="teacher_", min_ndim=2, autocast=False)
    check_same_device(student_hidden=student_hidden, teacher_hidden=teacher_hidden)
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"vocabulary size mismatch: student_weight has V={student_weight.shape[0]} but teacher_weight has "
            f"V={teacher_weight.shape[0]}; student and teacher must share one vocabulary"
        )
    if teacher_hidden.shape[:-1] != student_hidden.shape[:-1]:
        raise ValueError(
            f"teacher_hidden has leading shape {tuple(teacher_hidden.shape[:-1])} but student_hidden has "
            f"{tuple(student_hidden.shape[:-1])}; they must cover the same tokens"
        )
    beta = check_beta(beta)
    temperature = check_positive("temperature", temperature)
    chunk_size = check_chunk_size(chunk_size)

    hidden = student_hidden.shape[-1]
    h_s = student_hidden.reshape(-1, hidden).contiguous()
    h_t = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]).contiguous()
    tgt = target.reshape(-1).contiguous() if target is not None else None
    n_tokens, vocab = h_s.shape[0], student_weight.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(n_tokens, hidden, vocab)
    grad_enabled = torch.is_grad_enabled()
    return _FusedLinearJSDFunction.apply(
        h_s, student_weight.contiguous(), h_t, teacher_weight.detach().contiguous(), tgt,
        beta, temperature, check_int64("ignore_index", ignore_index), chunk_size,
        grad_enabled and student_hidden.requires_grad, grad_enabled and student_weight.requires_grad,
    )
