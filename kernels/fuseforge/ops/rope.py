"""Rotary position embedding (RoPE) for queries and keys in one fused kernel.

Semantics are Hugging Face's `apply_rotary_pos_emb` (rotate-half convention),
including partial rotary (`cos`/`sin` narrower than the head: only the first
`Dr` dims rotate, the rest pass through). With h = Dr / 2:

    out[:h]   = x[:h] * cos[:h] - x[h:Dr] * sin[:h]
    out[h:Dr] = x[h:Dr] * cos[h:] + x[:h] * sin[h:]

With `layout="interleaved"` (GLM-4's `apply_rotary_pos_emb`: cos/sin are
`cos[..., :Dr/2].repeat_interleave(2)` and rotate_half pairs x[0::2] with
x[1::2]), pair i = (x[2i], x[2i+1]), i < Dr/2, rotates by cos[i], sin[i]:

    out[2i]   = x[2i] * cos[i] - x[2i+1] * sin[i]
    out[2i+1] = x[2i+1] * cos[i] + x[2i] * sin[i]

(only the first Dr/2 entries of cos/sin are read, as in HF), dims >= Dr pass through.

With `layout="interleaved_to_half"` (DeepSeek-V3's `apply_rotary_pos_emb_interleave`, used
when `config.rope_interleave`), the weights store each rotary pair interleaved and the output
lists the rotated pairs in halves: pair i = (x[2i], x[2i+1]) with cos[i], sin[i] as above, but

    out[i]        = x[2i] * cos[i] - x[2i+1] * sin[i]
    out[i + Dr/2] = x[2i+1] * cos[i] + x[2i] * sin[i]

i.e. rotate_half RoPE applied to the de-interleaved input, without materialising it.

One program handles a block of (batch, token) positions and every head of q
and k there, so cos/sin are read once per position. q/k are read through
their strides (HF hands over `view(...).transpose(1, 2)` views), so nothing is
copied. The op is linear in q/k: backward applies the transposed map to the
gradients (for HF's cos/sin, whose halves are equal, that is the inverse
rotation); only cos/sin are kept for it. When cos/sin require a gradient (a
learned position table), q and k are kept too and cos/sin's gradients come
from the same map written in PyTorch ops (`_rope_torch`): rare, so not fused.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuseforge.ops._shared.compiled import compiling
from fuseforge.ops._shared.launch import launch
from fuseforge.ops._shared.utils import (
    FLOAT_DTYPES,
    check_device_supported,
    check_same_device,
    check_same_dtype,
    check_tensor,
    is_interpreter,
    upcast,
)

# Elements of one half-head tile ([tokens, heads, Dr/2]) a program keeps live.
_GPU_TILE = 2048
# Half-tile elements per thread (sets num_warps); each thread holds this many of x1 and of x2.
_GPU_ELEMENTS_PER_THREAD = 16
# The interpreter pays per program and per op, not per element: use big tiles.
_INTERPRETER_TILE = 32768


@triton.jit
def _pair_offsets(d, HALF: tl.constexpr, PAIRS: tl.constexpr):
    """Where pair i's two members sit: (2i, 2i+1) when PAIRS (interleaved), else (i, i + Dr/2)."""
    if PAIRS:
        return 2 * d, 2 * d + 1
    else:
        return d, d + HALF


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr,
    sx_b, sx_h, sx_t,
    so_b, so_h, so_t,
    b, t, row_mask, cos1, cos2, sin1, sin2, n_heads,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    FP64: tl.constexpr, IN_PAIRS: tl.constexpr, OUT_PAIRS: tl.constexpr,
):
    """Rotate all heads of one tensor at the positions (b, t) ([BLOCK_T, 1, 1] each); the last dim of x and
    out has unit stride (_launch sees to it).

    Pair i is read from (x[2i], x[2i+1]) when IN_PAIRS, else from (x[i], x[i + Dr/2]); the
    rotated pair is written to the same kind of positions per OUT_PAIRS.
    """
    d = tl.arange(0, BLOCK_HALF)[None, None, :]
    d_mask = d < HALF
    d1, d2 = _pair_offsets(d, HALF, IN_PAIRS)
    e1, e2 = _pair_offsets(d, HALF, OUT_PAIRS)
    x_pos = x_ptr + b * sx_b + t * sx_t
    o_pos = out_ptr + b * so_b + t * so_t
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[None, :, None]
        head_mask = row_mask & (h < n_heads)
        mask = head_mask & d_mask
        x_head = x_pos + h * sx_h
        x1 = upcast(tl.load(x_head + d1, mask=mask, other=0.0), FP64)
        x2 = upcast(tl.load(x_head + d2, mask=mask, other=0.0), FP64)
        o1 = x1 * cos1 - x2 * sin1
        o2 = x2 * cos2 + x1 * sin2
        o_head = o_pos + h * so_h
        tl.store(o_head + e1, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_head + e2, o2.to(out_ptr.dtype.element_ty), mask=mask)
        if HEAD_DIM > 2 * HALF:
            p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, None, :]
            p_mask = head_mask & (p < HEAD_DIM)
            passed = tl.load(x_head + p, mask=p_mask, other=0.0)
            tl.store(o_head + p, passed, mask=p_mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    sq_b, sq_h, sq_t,
    sk_b, sk_h, sk_t,
    sqo_b, sqo_h, sqo_t,
    sko_b, sko_h, sko_t,
    sc_b, sc_t,
    n_rows, seq_len, n_q_heads, n_k_heads,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BACKWARD: tl.constexpr, FP64: tl.constexpr, HALF_COS: tl.constexpr,
    IN_PAIRS: tl.constexpr, OUT_PAIRS: tl.constexpr,
):
    """One program's block of (batch, token) rows, every head of q and k there; any q/k/output strides (unit
    last dim). Launched as is, or inlined by _rope_dense_kernel with strides that follow from the shapes."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = (rows < n_rows)[:, None, None]
    b = (rows // seq_len)[:, None, None]
    t = (rows % seq_len)[:, None, None]

    d = tl.arange(0, BLOCK_HALF)[None, None, :]
    cs_mask = row_mask & (d < HALF)
    # cos and sin share one layout with a unit last stride (_launch sees to it)
    position = b * sc_b + t * sc_t
    cos_pos = cos_ptr + position
    sin_pos = sin_ptr + position
    cos1 = upcast(tl.load(cos_pos + d, mask=cs_mask, other=0.0), FP64)
    sin1 = upcast(tl.load(sin_pos + d, mask=cs_mask, other=0.0), FP64)
    if HALF_COS:
        # HF reads only cos/sin[:Dr/2] (repeat-interleaved): both members of pair i use entry i.
        cos2 = cos1
        sin2 = sin1
    else:
        cos2 = upcast(tl.load(cos_pos + (d + HALF), mask=cs_mask, other=0.0), FP64)
        sin2 = upcast(tl.load(sin_pos + (d + HALF), mask=cs_mask, other=0.0), FP64)
    if BACKWARD:
        # Transpose of [[cos1, -sin1], [sin2, cos2]]: same kernel with the sines swapped and negated.
        sin1, sin2 = -sin2, -sin1

    _rotate_heads(q_ptr, q_out_ptr, sq_b, sq_h, sq_t, sqo_b, sqo_h, sqo_t,
                  b, t, row_mask, cos1, cos2, sin1, sin2, n_q_heads,
                  HALF, HEAD_DIM, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS, FP64, IN_PAIRS, OUT_PAIRS)
    _rotate_heads(k_ptr, k_out_ptr, sk_b, sk_h, sk_t, sko_b, sko_h, sko_t,
                  b, t, row_mask, cos1, cos2, sin1, sin2, n_k_heads,
                  HALF, HEAD_DIM, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, FP64, IN_PAIRS, OUT_PAIRS)


@triton.jit(do_not_specialize=["n_rows", "seq_len"])
def _rope_dense_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, n_rows, seq_len,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BACKWARD: tl.constexpr, FP64: tl.constexpr, HALF_COS: tl.constexpr,
    IN_PAIRS: tl.constexpr, OUT_PAIRS: tl.constexpr,
    N_Q_HEADS: tl.constexpr, N_K_HEADS: tl.constexpr, Q_T_MAJOR: tl.constexpr, K_T_MAJOR: tl.constexpr,
    COS_BATCHED: tl.constexpr,
):
    """Dense q/k ([B, T, H, D] as HF's projections give, or [B, H, T, D]), outputs laid out as their inputs,
    compact cos/sin: the strides follow from the shapes, so a launch passes 8 arguments instead of 24, and
    no integer is specialised on, so `launch` can reuse the compiled kernel (this small op is host-bound)."""
    # strides in (batch, head, token) order; the constant ones stay constexpr so that loads vectorise
    tokens = seq_len.to(tl.int64)
    sq_b = tokens * (N_Q_HEADS * HEAD_DIM)
    sk_b = tokens * (N_K_HEADS * HEAD_DIM)
    if Q_T_MAJOR:
        sq_h: tl.constexpr = HEAD_DIM
        sq_t: tl.constexpr = N_Q_HEADS * HEAD_DIM
    else:
        sq_h = tokens * HEAD_DIM
        sq_t: tl.constexpr = HEAD_DIM
    if K_T_MAJOR:
        sk_h: tl.constexpr = HEAD_DIM
        sk_t: tl.constexpr = N_K_HEADS * HEAD_DIM
    else:
        sk_h = tokens * HEAD_DIM
        sk_t: tl.constexpr = HEAD_DIM
    sc_t: tl.constexpr = 2 * HALF
    if COS_BATCHED:
        sc_b = tokens * sc_t
    else:
        sc_b: tl.constexpr = 0
    _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sc_b, sc_t,
                 n_rows, seq_len, N_Q_HEADS, N_K_HEADS,
                 HALF, HEAD_DIM, BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_PASS,
                 BACKWARD, FP64, HALF_COS, IN_PAIRS, OUT_PAIRS)


def _bht_strides(s: tuple, heads_dim: int) -> tuple[int, int, int]:
    """Strides `s` of a q/k tensor in (batch, head, token) order, whichever of dims 1/2 holds the heads."""
    return s[0], s[heads_dim], s[3 - heads_dim]


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """`x`, or a contiguous copy when its last dim is strided (HF's q/k and cos/sin never are): the kernel
    takes no last-dim strides, since every argument costs host time at each launch."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _one_layout(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin with the same strides and a unit last stride (tiny [1 or B, T, Dr] copies when not), so
    that the kernel takes one set of strides for both."""
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return cos.contiguous(), sin.contiguous()
    return cos, sin


@functools.lru_cache(maxsize=4096)
def _plan(n_rows: int, n_q_heads: int, n_k_heads: int, half: int, head_dim: int, tile: int, backward: bool,
          fp64: bool, layout: str) -> tuple:
    """(grid, num_warps, the constexprs both kernels share, in their order); cached: planning costs host time
    comparable to the launch itself."""
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(max(head_dim - 2 * half, 1))
    heads_per_tile = max(1, tile // block_half)
    block_hq = min(triton.next_power_of_2(n_q_heads), heads_per_tile)
    block_hk = min(triton.next_power_of_2(n_k_heads), heads_per_tile)
    block_t = max(1, tile // (block_hq * block_half))
    block_t = min(block_t, triton.next_power_of_2(n_rows))
    num_warps = min(16, max(1, block_t * block_hq * block_half // (32 * _GPU_ELEMENTS_PER_THREAD)))
    # interleaved_to_half maps pairs to halves; its transpose (backward) maps halves back to pairs.
    in_pairs = layout == "interleaved" or (layout == "interleaved_to_half" and not backward)
    out_pairs = layout == "interleaved" or (layout == "interleaved_to_half" and backward)
    constexprs = (half, head_dim, block_t, block_hq, block_hk, block_half, block_pass,
                  backward, fp64, layout != "rotate_half", in_pairs, out_pairs)
    return (triton.cdiv(n_rows, block_t),), num_warps, constexprs


def _dense_major(strides: tuple, heads_dim: int, n_heads: int, seq_len: int, head_dim: int):
    """For a dense q or k (unit last stride): True when laid out [B, T, H, D], as HF's projections give, False
    for [B, H, T, D], None for any other order (e.g. [T, B, H, D]). A dense tensor's batch stride follows
    from the other two; as for torch's contiguity, a size-1 dim's stride does not matter."""
    s_h, s_t = strides[heads_dim], strides[3 - heads_dim]
    if (n_heads == 1 or s_h == head_dim) and (seq_len == 1 or s_t == n_heads * head_dim):
        return True
    if (n_heads == 1 or s_h == seq_len * head_dim) and (seq_len == 1 or s_t == head_dim):
        return False
    return None


def _launch(q, k, q_out, k_out, cos, sin, heads_dim: int, backward: bool, layout: str) -> None:
    batch, seq_len, head_dim = q.shape[0], q.shape[3 - heads_dim], q.shape[3]
    n_q_heads, n_k_heads = q.shape[heads_dim], k.shape[heads_dim]
    n_rows = batch * seq_len
    if n_rows == 0 or n_q_heads == 0:
        return
    half = cos.shape[-1] // 2
    tile = _INTERPRETER_TILE if is_interpreter() else _GPU_TILE
    grid, num_warps, constexprs = _plan(
        n_rows, n_q_heads, n_k_heads, half, head_dim, tile, backward, q_out.dtype == torch.float64, layout)
    cos, sin = _one_layout(cos, sin)
    # each stride() read once: launches are host-bound
    q_strides, k_strides, cos_strides = q.stride(), k.stride(), cos.stride()
    q_out_strides, k_out_strides = q_out.stride(), k_out.stride()
    cos_batched = cos.shape[0] > 1
    q_major = k_major = None
    # outputs come from empty_like, which keeps the strides of dense inputs only: equal strides mean dense q/k
    if (q_out_strides == q_strides and k_out_strides == k_strides
            and (seq_len == 1 or cos_strides[1] == 2 * half)
            and (not cos_batched or cos_strides[0] == seq_len * 2 * half)):
        q_major = _dense_major(q_strides, heads_dim, n_q_heads, seq_len, head_dim)
        k_major = _dense_major(k_strides, heads_dim, n_k_heads, seq_len, head_dim)
    if q_major is not None and k_major is not None:
        launch(_rope_dense_kernel, grid, (q, k, q_out, k_out, cos, sin), (n_rows, seq_len),
               (*constexprs, n_q_heads, n_k_heads, q_major, k_major, cos_batched), num_warps)
        return
    _rope_kernel[grid](
        q, k, q_out, k_out, cos, sin,
        *_bht_strides(q_strides, heads_dim),
        *_bht_strides(k_strides, heads_dim),
        *_bht_strides(q_out_strides, heads_dim),
        *_bht_strides(k_out_strides, heads_dim),
        cos_strides[0] if cos_batched else 0, cos_strides[1],
        n_rows, seq_len, n_q_heads, n_k_heads,
        *constexprs,
        num_warps=num_warps,
    )


def _rope_forward(q, k, cos, sin, heads_dim, layout):
    # empty_like keeps q's memory layout (e.g. [B, T, H, D] under a transposed view), as HF's
    # elementwise formula would, so attention kernels downstream see the same strides.
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _launch(q, k, q_out, k_out, cos, sin, heads_dim, backward=False, layout=layout)
    return q_out, k_out


def _rope_backward(grad_q_out, grad_k_out, cos, sin, heads_dim, layout):
    grad_q_out, grad_k_out = _unit_last_stride(grad_q_out), _unit_last_stride(grad_k_out)
    grad_q, grad_k = torch.empty_like(grad_q_out), torch.empty_like(grad_k_out)
    _launch(grad_q_out, grad_k_out, grad_q, grad_k, cos, sin, heads_dim, backward=True, layout=layout)
    return grad_q, grad_k


def _rope_torch(q, k, cos, sin, heads_dim, layout):
    """The kernel's map in PyTorch ops (in fp32, fp64 for fp64 inputs), differentiable in cos/sin."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    rotary, half = cos.shape[-1], cos.shape[-1] // 2
    cos, sin = cos.to(compute).unsqueeze(heads_dim), sin.to(compute).unsqueeze(heads_dim)
    if layout == "interleaved":
        cos, sin = cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    elif layout == "interleaved_to_half":
        cos, sin = torch.cat((cos[..., :half],) * 2, dim=-1), torch.cat((sin[..., :half],) * 2, dim=-1)

    def apply(x):
        rot, passed = x.to(compute)[..., :rotary], x.to(compute)[..., rotary:]
        if layout == "interleaved_to_half":
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        if layout == "interleaved":
            turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        else:
            turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + turned * sin, passed), dim=-1)

    return apply(q), apply(k)


def _cos_sin_gradients(q, k, cos, sin, grad_q_out, grad_k_out, heads_dim, layout):
    """d(loss)/d(cos), d(loss)/d(sin) in cos/sin's dtype (summed over heads and a broadcast batch)."""
    with torch.enable_grad():
        c, s = cos.detach().requires_grad_(), sin.detach().requires_grad_()
        q_out, k_out = _rope_torch(q.detach(), k.detach(), c, s, heads_dim, layout)
        return torch.autograd.grad((q_out, k_out), (c, s), (grad_q_out.to(q_out.dtype), grad_k_out.to(k_out.dtype)))


def _save(ctx, q, k, cos, sin) -> None:
    """cos/sin for the backward kernel; q/k as well only when cos/sin need their own gradients."""
    ctx.cos_sin_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.cos_sin_grad else ()))


def _cos_sin_grad_outputs(ctx, grad_q_out, grad_k_out):
    if not ctx.cos_sin_grad:
        return None, None
    cos, sin, q, k = ctx.saved_tensors
    return _cos_sin_gradients(q, k, cos, sin, grad_q_out, grad_k_out, ctx.heads_dim, ctx.layout)


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, heads_dim, layout):
        _save(ctx, q, k, cos, sin)
        ctx.heads_dim, ctx.layout = heads_dim, layout
        return _rope_forward(q, k, cos, sin, heads_dim, layout)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_q_out, grad_k_out):
        cos, sin = ctx.saved_tensors[:2]
        grad_q, grad_k = _rope_backward(grad_q_out, grad_k_out, cos, sin, ctx.heads_dim, ctx.layout)
        grad_cos, grad_sin = _cos_sin_grad_outputs(ctx, grad_q_out, grad_k_out)
        return grad_q, grad_k, grad_cos, grad_sin, None, None


# --- torch.compile: the same launches as custom ops (ops/_shared/compiled.py says why) ---------------


@torch.library.custom_op("fuseforge::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_forward(q, k, cos, sin, heads_dim, layout)


@_rope_op.register_fake
def _(q, k, cos, sin, heads_dim, layout):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("fuseforge::rope_backward", mutates_args=())
def _rope_backward_op(
    grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_backward(grad_q_out, grad_k_out, cos, sin, heads_dim, layout)


@_rope_backward_op.register_fake
def _(grad_q_out, grad_k_out, cos, sin, heads_dim, layout):
    return torch.empty_like(grad_q_out), torch.empty_like(grad_k_out)


def _rope_setup(ctx, inputs, output):
    q, k, cos, sin, ctx.heads_dim, ctx.layout = inputs
    _save(ctx, q, k, cos, sin)


def _rope_op_backward(ctx, grad_q_out, grad_k_out):
    cos, sin = ctx.saved_tensors[:2]
    grad_q, grad_k = _rope_backward_op(grad_q_out, grad_k_out, cos, sin, ctx.heads_dim, ctx.layout)
    grad_cos, grad_sin = _cos_sin_grad_outputs(ctx, grad_q_out, grad_k_out)
    return grad_q, grad_k, grad_cos, grad_sin, None, None


_rope_op.register_autograd(_rope_op_backward, setup_context=_rope_setup)


LAYOUTS = ("rotate_half", "interleaved", "interleaved_to_half")


def _validate(q, k, cos, sin, unsqueeze_dim, layout="rotate_half") -> int:
    """Check the inputs; return the dim of q/k that holds the heads (1 or 2)."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("cos", cos, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("sin", sin, ndim=3, dtypes=FLOAT_DTYPES)
    check_same_dtype(q=q, k=k)
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    check_device_supported("q", q)
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"unsqueeze_dim must be an int, got {type(unsqueeze_dim).__name__}")
    heads_dim = unsqueeze_dim + 4 if unsqueeze_dim < 0 else unsqueeze_dim
    if heads_dim not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim must be 1 (q/k as [batch, heads, seq, head_dim]) or 2 "
            f"([batch, seq, heads, head_dim]), got {unsqueeze_dim}"
        )
    token_dim = 3 - heads_dim
    q_shape, k_shape, cos_shape = q.shape, k.shape, cos.shape  # read once: this runs on every launch
    batch, seq_len, head_dim = q_shape[0], q_shape[token_dim], q_shape[3]
    n_q_heads, n_k_heads = q_shape[heads_dim], k_shape[heads_dim]
    where = "[batch, heads, seq, head_dim]" if heads_dim == 1 else "[batch, seq, heads, head_dim]"
    if (batch, seq_len, head_dim) != (k_shape[0], k_shape[token_dim], k_shape[3]):
        raise ValueError(
            f"q {tuple(q_shape)} and k {tuple(k_shape)} must agree in batch, seq and head_dim (layout {where})"
        )
    if n_k_heads == 0 or n_q_heads % n_k_heads != 0:
        raise ValueError(f"k's {n_k_heads} heads must divide q's {n_q_heads} heads (layout {where})")
    if cos_shape != sin.shape:
        raise ValueError(f"cos {tuple(cos_shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos_shape[0] not in (1, batch) or cos_shape[1] != seq_len:
        raise ValueError(
            f"cos/sin must have shape [1 or batch={batch}, seq={seq_len}, rotary_dim], got {tuple(cos_shape)}"
        )
    rotary_dim = cos_shape[2]
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos/sin's last dim (rotary_dim={rotary_dim}) must be even, > 0 and <= q/k's head_dim={head_dim}"
        )
    return heads_dim


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    layout: str = "rotate_half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embeddings to q and k (Hugging Face `apply_rotary_pos_emb` semantics).

    q: [B, Hq, T, D] and k: [B, Hk, T, D] (Hk divides Hq), or [B, T, H, D] with unsqueeze_dim=2;
    any strides. cos/sin: [1 or B, T, Dr] with Dr even and <= D; only the first Dr dims of each
    head rotate. Returns new tensors in q/k's dtype and memory layout; computes in fp32 (fp64 for
    fp64 inputs). cos/sin may have another float dtype than q/k; when they require a gradient
    they get it (computed in PyTorch ops, unfused: HF's cos/sin come from a buffer and need none).

    layout="rotate_half" (default): Llama's convention, pairs (x[i], x[i + Dr/2]).
    layout="interleaved": GLM-4's convention, pairs (x[2i], x[2i+1]) rotated by cos[..., i] and
    sin[..., i] for i < Dr/2 (HF passes the same [.., Dr] cos/sin and repeat-interleaves their first
    half; the second half is not read).
    layout="interleaved_to_half": DeepSeek-V3's `apply_rotary_pos_emb_interleave`, pairs read as
    in "interleaved" and written as in "rotate_half" (out[i], out[i + Dr/2]).
    """
    heads_dim = _validate(q, k, cos, sin, unsqueeze_dim, layout)
    if compiling():
        return _rope_op(q, k, cos, sin, heads_dim, layout)
    return _RoPEFunction.apply(q, k, cos, sin, heads_dim, layout)
