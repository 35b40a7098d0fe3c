"""Gated-linear-unit activations: swiglu = silu(gate) * up, geglu = gelu(gate) * up.

One elementwise kernel per direction, computing in fp32 (fp64 for fp64 inputs).
Forward keeps only gate and up; backward recomputes the activation from them,
so no activation is ever stored.

Memory: backward writes d_gate/d_up into the saved gate/up buffers when that is
provably safe, so it allocates nothing; otherwise it allocates. A buffer is reused only if
it is private to this op: a private copy made here, or an activation that
* was made by an op whose backward never reads its output (`_PRIVATE_PRODUCERS`: the
  matmuls of a linear layer and a bias/LoRA add; e.g. gate_proj(x) in an MLP), so that no
  upstream backward needs it and it is no leaf (a parameter or other caller-owned tensor);
* is that op's whole output, dense: contiguous, covering its whole storage (a 3-D linear with
  bias returns a full-size view of its addmm output, which passes). Slices and views of leaves,
  `expand`ed tensors (one cell per many elements) and anything else share memory with
  tensors someone else may read, so they get fresh buffers;
* does not share storage with the other input.
Their autograd version counters are bumped afterwards, so another op that saved the same
tensor (e.g. `gate * gate`) fails loudly ("modified by an inplace operation") rather than
reading gradients. What this cannot see is the caller reading such an activation after
backward: pass `inplace_backward=False` to keep gate/up intact (e.g. to inspect them after
backward, or to call backward twice with retain_graph=True).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from fuseforge.ops._shared.compiled import compiling
from fuseforge.ops._shared.utils import (
    FLOAT_DTYPES,
    check_device_supported,
    check_same_device,
    check_same_dtype,
    check_tensor,
    is_interpreter,
    upcast,
)

SILU, GELU_TANH, GELU_ERF = 0, 1, 2
GELU_APPROXIMATIONS = {"tanh": GELU_TANH, "none": GELU_ERF}

# Elements per program: large tiles keep many 16-byte loads in flight per thread.
_GPU_TILE = 4096
# Elements per thread per tensor (8 bf16 = one 16-byte load): sets num_warps = tile / (32 * this).
_GPU_ELEMENTS_PER_THREAD = 16
_INTERPRETER_TILE = 65536

# Globals read inside @triton.jit must be constexpr.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)); sigmoid-based forms never divide inf by inf for large |g|."""
    if ACTIVATION == 0:  # silu
        s = tl.sigmoid(g)
        act = g * s
        dact = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == 1:  # gelu, tanh approximation: 0.5 g (1 + tanh(z)) = g * sigmoid(2 z)
        z = _SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g)
        s = tl.sigmoid(2.0 * z)
        act = g * s
        dz = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * g * g)
        dact = s + 2.0 * g * dz * s * (1.0 - s)
    else:  # exact gelu: g * Phi(g)
        cdf = 0.5 * (1.0 + tl.erf(g * _INV_SQRT_2))
        act = g * cdf
        dact = cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)
    return act, dact


@triton.jit
def _tile(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's [BLOCK_R, BLOCK_C] tile of a 1-D grid laid row-block-major over the tiles."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK_C)
    rows = (pid // col_blocks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows[:, None], cols[None, :], mask


@triton.jit
def _glu_forward_kernel(
    gate_ptr, up_ptr, out_ptr,
    stride_gate, stride_up, stride_out,
    n_rows, n_cols,
    ACTIVATION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP64: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = upcast(tl.load(gate_ptr + rows * stride_gate + cols, mask=mask, other=0.0), FP64)
    u = upcast(tl.load(up_ptr + rows * stride_up + cols, mask=mask, other=0.0), FP64)
    act, _ = _activation(g, ACTIVATION)
    out = act * u
    tl.store(out_ptr + rows * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr,
    stride_grad_out, stride_gate, stride_up, stride_grad_gate, stride_grad_up,
    n_rows, n_cols,
    ACTIVATION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP64: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    dout = upcast(tl.load(grad_out_ptr + rows * stride_grad_out + cols, mask=mask, other=0.0), FP64)
    g = upcast(tl.load(gate_ptr + rows * stride_gate + cols, mask=mask, other=0.0), FP64)
    u = upcast(tl.load(up_ptr + rows * stride_up + cols, mask=mask, other=0.0), FP64)
    act, dact = _activation(g, ACTIVATION)
    # Both loads above precede these stores, so the grads may overwrite gate/up element by element.
    d_gate = dout * u * dact
    d_up = dout * act
    tl.store(grad_gate_ptr + rows * stride_grad_gate + cols, d_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + rows * stride_grad_up + cols, d_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """View `t` as [rows, cols] with unit column stride (no copy if possible); say whether it copied.

    Row-strided views (e.g. gate/up chunked out of one fused projection) are read in place.
    """
    rows, cols = math.prod(t.shape[:-1]), t.shape[-1]
    if t.stride(-1) == 1:
        try:
            return t.view(rows, cols), False
        except RuntimeError:
            pass
    return t.reshape(rows, cols).contiguous(), True


def _launch_config(n_rows: int, n_cols: int) -> dict:
    """Grid and meta-parameters (cached: planning costs host time comparable to the launch itself)."""
    return _cached_launch_config(n_rows, n_cols, _INTERPRETER_TILE if is_interpreter() else _GPU_TILE)


@functools.lru_cache(maxsize=4096)
def _cached_launch_config(n_rows: int, n_cols: int, tile: int) -> dict:
    block_c = min(triton.next_power_of_2(n_cols), tile)
    block_r = min(max(1, tile // block_c), triton.next_power_of_2(n_rows))
    grid = (triton.cdiv(n_rows, block_r) * triton.cdiv(n_cols, block_c),)
    num_warps = min(16, max(1, block_r * block_c // (32 * _GPU_ELEMENTS_PER_THREAD)))
    return dict(grid=grid, meta=dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps))


def _flat_if_dense(*rows: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) to launch over: one long row when every operand is dense, so that no
    tile is cut short at a row end; the real [rows, cols] shape otherwise."""
    n_rows, n_cols = rows[0].shape
    if all(r.stride(0) == n_cols or n_rows == 1 for r in rows):
        return 1, n_rows * n_cols
    return n_rows, n_cols


def _launch_shape(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], int, int, tuple[int, ...]]:
    """(the tensors to launch on, rows, cols, their row strides).

    Dense tensors (the usual case: a linear layer's output and fresh buffers) go as they are, as one
    long row: no views to make, no tile cut short at a row end. Otherwise [rows, cols] views (unit column
    stride: a written buffer is always dense or one of those views, so `_as_rows` never copies it).
    """
    if all(t.is_contiguous() for t in tensors):
        n_cols = tensors[0].numel()
        return tensors, 1, n_cols, (n_cols,) * len(tensors)
    rows = tuple(_as_rows(t)[0] for t in tensors)
    n_rows, n_cols = _flat_if_dense(*rows)
    return rows, n_rows, n_cols, tuple(r.stride(0) for r in rows)


def _glu_forward(gate, up, activation):
    """The forward launch (eager and compiled paths): (out, the gate and up it read, whether each was copied).

    gate/up are read in place when dense or row-strided (e.g. chunked out of one fused projection);
    only a strided last dim is copied.
    """
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    gate_read, up_read, gate_copied, up_copied = gate, up, False, False
    if not (gate.is_contiguous() and up.is_contiguous()):
        gate_read, gate_copied = _as_rows(gate)
        up_read, up_copied = _as_rows(up)
    if out.numel():
        tensors, n_rows, n_cols, strides = _launch_shape(gate_read, up_read, out)
        cfg = _launch_config(n_rows, n_cols)
        _glu_forward_kernel[cfg["grid"]](
            *tensors, *strides, n_rows, n_cols,
            ACTIVATION=activation, FP64=gate.dtype == torch.float64, **cfg["meta"],
        )
    return out, gate_read, up_read, gate_copied, up_copied


def _glu_backward(grad_out, gate, up, grad_gate, grad_up, activation) -> None:
    """The backward launch: d_gate and d_up into grad_gate/grad_up (gate's shape; they may be gate/up)."""
    if grad_out.numel():
        tensors, n_rows, n_cols, strides = _launch_shape(grad_out, gate, up, grad_gate, grad_up)
        cfg = _launch_config(n_rows, n_cols)
        _glu_backward_kernel[cfg["grid"]](
            *tensors, *strides, n_rows, n_cols,
            ACTIVATION=activation, FP64=gate.dtype == torch.float64, **cfg["meta"],
        )


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, inplace_backward, gate_reusable, up_reusable):
        out, gate_read, up_read, gate_copied, up_copied = _glu_forward(gate, up, activation)
        ctx.save_for_backward(gate_read, up_read)
        ctx.activation = activation
        ctx.shape = gate.shape
        # A private copy made here is never seen by anyone else, so it is always safe to reuse.
        ctx.reuse_gate = gate_reusable or (inplace_backward and gate_copied)
        ctx.reuse_up = up_reusable or (inplace_backward and up_copied)
        ctx.buffers_consumed = False
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.buffers_consumed:
            raise RuntimeError(
                "swiglu/geglu backward ran twice, but the first run wrote the gradients into gate/up's "
                "buffers; pass inplace_backward=False to backward through it more than once"
            )
        gate, up = ctx.saved_tensors
        grad_gate = gate if ctx.reuse_gate else torch.empty_like(gate, memory_format=torch.contiguous_format)
        grad_up = up if ctx.reuse_up else torch.empty_like(up, memory_format=torch.contiguous_format)
        _glu_backward(grad_out, gate, up, grad_gate, grad_up, ctx.activation)
        for reused, buffer in ((ctx.reuse_gate, gate), (ctx.reuse_up, up)):
            if reused:
                torch.autograd.graph.increment_version(buffer)
        ctx.buffers_consumed = ctx.reuse_gate or ctx.reuse_up
        if grad_gate.shape != ctx.shape:  # [rows, cols] copies or views of a strided gate/up
            grad_gate, grad_up = grad_gate.view(ctx.shape), grad_up.view(ctx.shape)
        return grad_gate, grad_up, None, None, None, None


# --- torch.compile: the same launches as custom ops (ops/_shared/compiled.py says why) ---------------


@torch.library.custom_op("fuseforge::glu", mutates_args=())
def _glu_op(gate: torch.Tensor, up: torch.Tensor, activation: int) -> torch.Tensor:
    return _glu_forward(gate, up, activation)[0]


@_glu_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fuseforge::glu_backward", mutates_args=())
def _glu_backward_op(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) in fresh contiguous buffers of gate's shape (no in-place reuse when compiled)."""
    grad_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    grad_up = torch.empty_like(up, memory_format=torch.contiguous_format)
    _glu_backward(grad_out, gate, up, grad_gate, grad_up, activation)
    return grad_gate, grad_up


@_glu_backward_op.register_fake
def _(grad_out, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _glu_setup(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _glu_op_backward(ctx, grad_out):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = _glu_backward_op(grad_out, gate, up, ctx.activation)
    return grad_gate, grad_up, None


_glu_op.register_autograd(_glu_op_backward, setup_context=_glu_setup)


# grad_fn names of ops whose backward reads their inputs but never their output, and whose
# output is a fresh tensor: `_unsafe_view` is what matmul folds a 3-D product with (it is only
# ever applied to a tensor nothing else holds). An op not listed may save its output (sigmoid,
# exp, a custom Function...), so its output is never overwritten.
_PRIVATE_PRODUCERS = frozenset(
    {"MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "UnsafeViewBackward0", "AddBackward0"}
)


def _is_private_activation(t: torch.Tensor) -> bool:
    """True when backward may overwrite `t` with its gradient (the rule in the module docstring)."""
    owner = t if t._base is None else t._base
    return (
        type(owner.grad_fn).__name__ in _PRIVATE_PRODUCERS
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: int, inplace_backward: bool) -> torch.Tensor:
    check_tensor("gate", gate, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("up", up, min_ndim=1, dtypes=FLOAT_DTYPES)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    check_same_dtype(gate=gate, up=up)
    check_same_device(gate=gate, up=up)
    check_device_supported("gate", gate)
    if compiling():
        return _glu_op(gate, up, activation)
    inplace_backward = bool(inplace_backward)
    gate_reusable = inplace_backward and _is_private_activation(gate)
    up_reusable = inplace_backward and _is_private_activation(up)
    if (gate_reusable or up_reusable) and gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr():
        gate_reusable = up_reusable = False  # one storage: writing one gradient would clobber the other input
    return _GLUFunction.apply(gate, up, activation, inplace_backward, gate_reusable, up_reusable)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = True) -> torch.Tensor:
    """silu(gate) * up (LLaMA/Mistral/Qwen MLP), fused; output in the inputs' dtype.

    gate and up: same shape [..., intermediate], dtype and device. Backward writes their
    gradients into their own memory only when it is private to this op (the whole, dense output
    of a linear layer or a bias add, as gate_proj(x) in an MLP); slices, views of leaves,
    expanded tensors and outputs another backward reads get fresh buffers (module docstring).
    inplace_backward=False always allocates, for callers that read gate/up after backward.
    """
    return _glu(gate, up, SILU, inplace_backward)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, inplace_backward: bool = True
) -> torch.Tensor:
    """gelu(gate, approximate) * up (Gemma MLP), fused; torch.nn.functional.gelu semantics.

    approximate: "tanh" (gelu_pytorch_tanh, Gemma's default) or "none" (exact erf GELU).
    Memory and inplace_backward: as for swiglu.
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {tuple(GELU_APPROXIMATIONS)}, got {approximate!r}")
    return _glu(gate, up, GELU_APPROXIMATIONS[approximate], inplace_backward)
