"""The fused ops inside torch.compile: `fuseforge::*` custom ops (ops/_shared/compiled.py).

opcheck tests each custom op's schema, fake (meta) implementation, autograd registration and
AOT tracing against its real implementation; the compiled-versus-eager tests check that a
compiled function (one graph, fullgraph=True) gives bit-identical outputs and gradients to the
eager autograd.Function path, which the per-op test files compare with float64 references.
"""

from __future__ import annotations

import pytest
import torch

import fuseforge.functional as ff
from fuseforge.ops.clamped_swiglu import _clamped_swiglu_backward_op, _clamped_swiglu_op
from fuseforge.ops.cross_entropy import _cross_entropy_backward_op, _cross_entropy_op
from fuseforge.ops.fused_linear_cross_entropy import _flce_backward_op, _flce_op, _flce_scale_grads_op
from fuseforge.ops.glu import GELU_ERF, GELU_TANH, SILU, _glu_backward_op, _glu_op
from fuseforge.ops.layer_norm import _layer_norm_backward_op, _layer_norm_op
from fuseforge.ops.rms_norm import _rms_norm_backward_op, _rms_norm_op
from fuseforge.ops.rope import _rope_backward_op, _rope_op

pytestmark = pytest.mark.compiles  # torch.compile: run last in the test process (tests/conftest.py)

IGNORE = -100


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch: a recompile limit hit would silently run the eager path."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def leaf(*shape, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).requires_grad_()


def targets(n, n_classes, device):
    """Class indices with every third one ignored (and the first, so a ragged chunk starts ignored)."""
    t = torch.randint(0, n_classes, (n,), device=device)
    t[::3] = IGNORE
    return t


def row_sliced(rows, cols, device):
    """A [rows, cols] leaf's view with row stride cols + 5: what a slice of a wider tensor looks like."""
    base = leaf(rows, cols + 5, device=device)
    return base[:, :cols]


# --- opcheck ------------------------------------------------------------------------------------


def _opcheck_cases(device):
    x = row_sliced(7, 40, device).view(7, 40)
    w, b = leaf(40, device=device), leaf(40, device=device)
    r = leaf(7, 40, device=device)
    y, _, rstd = _rms_norm_op(x.detach(), None, w.detach(), 1e-6, 0.0, "llama")
    _, mean, ln_rstd = _layer_norm_op(x.detach(), w.detach(), b.detach(), 1e-5)
    dy = torch.randn(7, 40, device=device)
    q = leaf(2, 5, 4, 16, device=device).transpose(1, 2)  # HF's view(...).transpose(1, 2) layout
    k = leaf(2, 2, 5, 16, device=device)
    cos, sin = torch.randn(1, 5, 12, device=device), torch.randn(1, 5, 12, device=device)  # partial rotary
    gate_up = leaf(3, 5, 2 * 24, device=device, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)  # row-strided views of one projection
    logits = leaf(11, 37, device=device)
    t = targets(11, 37, device)
    loss, lse, inv = _cross_entropy_op(logits.detach(), t, IGNORE, 0.1, 1e-3, 3.0, "mean")
    h, wv, bv = leaf(11, 16, device=device), leaf(37, 16, device=device), leaf(37, device=device)
    _, _, gh, gw, gb = _flce_op(h.detach(), wv.detach(), bv.detach(), t, None, IGNORE, 0.0, 0.0, None, "sum", 4,
                                True, True, True)
    return {
        "rms_norm": (_rms_norm_op, (x, None, w, 1e-6, 0.0, "llama")),
        "rms_norm_fused_add": (_rms_norm_op, (x, r, w, 1e-5, 1.0, "gemma")),
        "rms_norm_backward": (_rms_norm_backward_op, (x.detach(), w.detach(), rstd, dy, None, True, True, 0.0, "llama")),
        "rms_norm_backward_residual": (_rms_norm_backward_op, (x.detach(), w.detach(), rstd, dy, dy.flip(0), True, False,
                                                               0.0, "llama")),
        "layer_norm": (_layer_norm_op, (x, w, b, 1e-5)),
        "layer_norm_no_weight": (_layer_norm_op, (x, None, b, 1e-5)),
        "layer_norm_backward": (_layer_norm_backward_op, (x.detach(), w.detach(), b.detach(), mean, ln_rstd, dy,
                                                          True, True, True)),
        **{f"rope_{layout}": (_rope_op, (q, k, cos, sin, 1, layout))
           for layout in ("rotate_half", "interleaved", "interleaved_to_half")},
        "rope_heads_dim_2": (_rope_op, (q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2, "rotate_half")),
        "rope_backward": (_rope_backward_op, (torch.randn_like(q), torch.randn_like(k), cos, sin, 1, "interleaved")),
        **{f"glu_{name}": (_glu_op, (gate, up, act))
           for name, act in (("silu", SILU), ("gelu_tanh", GELU_TANH), ("gelu_erf", GELU_ERF))},
        "glu_backward": (_glu_backward_op, (torch.randn(3, 5, 24, device=device), gate.detach(), up.detach(), SILU)),
        "clamped_swiglu_interleaved": (_clamped_swiglu_op, (gate_up, 1.702, 2.0, True)),
        "clamped_swiglu_concatenated": (_clamped_swiglu_op, (gate_up, 1.702, 2.0, False)),
        "clamped_swiglu_backward": (_clamped_swiglu_backward_op, (torch.randn(3, 5, 24, device=device),
                                                                  gate_up.detach(), 1.702, 2.0, True)),
        **{f"cross_entropy_{red}": (_cross_entropy_op, (logits, t, IGNORE, 0.1, 1e-3, 3.0, red))
           for red in ("mean", "sum", "none")},
        "cross_entropy_backward": (_cross_entropy_backward_op, (logits.detach(), t, lse, inv, torch.rand((), device=device),
                                                                IGNORE, 0.1, 1e-3, 3.0, "mean")),
        "flce_mean": (_flce_op, (h, wv, bv, t, None, IGNORE, 0.0, 0.0, 2.5, "mean", 4, True, True, True)),
        "flce_sum_items": (_flce_op, (h, wv, None, t, torch.full((1,), 0.2, device=device), IGNORE, 0.1, 1e-3, None,
                                      "mean", 5, True, True, False)),
        "flce_none": (_flce_op, (h, wv, bv, t, torch.ones(1, device=device), IGNORE, 0.0, 0.0, None, "none", 4,
                                 True, False, True)),
        "flce_scale_grads": (_flce_scale_grads_op, (gh, gw, gb, torch.rand((), device=device) + 0.5)),
        "flce_backward_none": (_flce_backward_op, (h.detach(), wv.detach(), bv.detach(), t, torch.randn(11, device=device),
                                                   IGNORE, 0.0, 0.0, 2.5, 4, True, True, True)),
    }


OPCHECK_CASES = tuple(_opcheck_cases("cuda" if torch.cuda.is_available() else "cpu"))  # names only


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case, device):
    op, args = _opcheck_cases(device)[case]
    torch.library.opcheck(op, args)


# --- compiled (one graph) against eager ---------------------------------------------------------


def _differentiable_leaves(args):
    leaves = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            leaves.append(a if a.is_leaf else a._base)
    return leaves


def assert_compiled_matches_eager(fn, *args, backend="aot_eager"):
    """fn compiled as one graph gives bit-identical outputs and gradients (for a fresh random upstream
    gradient) to fn run eagerly, and the compiled call really went through the compiled graph."""
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    expected, actual = fn(*args), compiled(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    leaves = _differentiable_leaves(args)
    outs = [(e, a) for e, a in zip(expected, actual, strict=True) if e.requires_grad]
    assert outs and all(type(a.grad_fn).__name__ == "CompiledFunctionBackward" for _, a in outs)
    for e, a in zip(expected, actual):
        assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride()
        assert torch.equal(a, e), (a - e).abs().max()
    upstream = [torch.randn_like(e) for e, _ in outs]
    grads_e = torch.autograd.grad([e for e, _ in outs], leaves, upstream, allow_unused=True)
    grads_a = torch.autograd.grad([a for _, a in outs], leaves, upstream, allow_unused=True)
    for ge, ga in zip(grads_e, grads_a, strict=True):
        assert (ge is None) == (ga is None)
        if ge is not None:
            assert torch.isfinite(ge).all() and ge.abs().sum() > 0  # not a vacuous comparison
            assert torch.equal(ga, ge), (ga - ge).abs().max()


@pytest.mark.parametrize("casting, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm_compiled(casting, offset, device):
    x = row_sliced(9, 40, device)
    w = leaf(40, device=device)
    assert_compiled_matches_eager(lambda x, w: ff.rms_norm(x, w, 1e-6, offset=offset, casting=casting), x, w)


def test_fused_add_rms_norm_compiled(device):
    x, r, w = leaf(2, 5, 40, device=device), leaf(2, 5, 40, device=device), leaf(40, device=device)
    assert_compiled_matches_eager(lambda x, r, w: ff.fused_add_rms_norm(x, r, w, 1e-6), x, r, w)


@pytest.mark.parametrize("affine", ["both", "bias_only"])
def test_layer_norm_compiled(affine, device):
    x = leaf(3, 7, 33, device=device)
    w = leaf(33, device=device) if affine == "both" else None
    b = leaf(33, device=device)
    assert_compiled_matches_eager(lambda x, w, b: ff.layer_norm(x, w, b, 1e-5), x, w, b)


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved", "interleaved_to_half"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_rope_compiled(layout, unsqueeze_dim, device):
    """Every layout the patching uses, on HF's transposed q view, GQA and partial rotary."""
    base_q = leaf(2, 5, 4, 16, device=device)
    k = leaf(2, 2, 5, 16, device=device) if unsqueeze_dim == 1 else leaf(2, 5, 2, 16, device=device)
    q = base_q.transpose(1, 2) if unsqueeze_dim == 1 else base_q
    cos, sin = torch.randn(2, 5, 12, device=device), torch.randn(2, 5, 12, device=device)
    assert_compiled_matches_eager(
        lambda q, k: ff.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, layout=layout), q, k
    )


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh", "geglu_none"])
def test_glu_compiled(activation, device):
    gate_up = leaf(3, 5, 48, device=device, scale=2.0)

    def fn(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        if activation == "swiglu":
            return ff.swiglu(gate, up)
        return ff.geglu(gate, up, approximate=activation.split("_")[1])

    assert_compiled_matches_eager(fn, gate_up)


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_clamped_swiglu_compiled(layout, device):
    gate_up = leaf(3, 5, 48, device=device, scale=3.0)  # |x| > limit often: both sides of the clamps
    assert_compiled_matches_eager(lambda x: ff.clamped_swiglu(x, 1.702, 2.0, layout=layout), gate_up)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_compiled(reduction, device):
    logits = leaf(3, 4, 37, device=device, scale=3.0)
    t = targets(12, 37, device).view(3, 4)
    assert_compiled_matches_eager(
        lambda logits, t: ff.cross_entropy(logits, t, reduction=reduction, label_smoothing=0.1, z_loss_scale=1e-3,
                                           softcap=3.0, return_lse=True),
        logits, t,
    )


@pytest.mark.parametrize(
    "reduction, num_items, softcap, bias",
    [
        ("mean", None, None, True),
        ("mean", "int", 2.5, False),  # the Trainer's count as a Python int, Gemma's softcap
        ("mean", "tensor", None, True),  # ... and as a tensor
        ("sum", None, 2.5, True),
        ("none", None, None, True),
    ],
)
def test_fused_linear_cross_entropy_compiled(reduction, num_items, softcap, bias, device):
    """The patched loss head's paths; 13 tokens in chunks of 4 leave a ragged last chunk."""
    h, w = leaf(13, 16, device=device), leaf(37, 16, device=device, scale=0.5)
    b = leaf(37, device=device) if bias else None
    t = targets(13, 37, device)
    count = {None: None, "int": 7, "tensor": torch.tensor(7, device=device)}[num_items]
    assert_compiled_matches_eager(
        lambda h, w, b, t: ff.fused_linear_cross_entropy(
            h, w, t, bias=b, reduction=reduction, softcap=softcap, num_items_in_batch=count, chunk_size=4,
            return_lse=True,
        ),
        h, w, b, t,
    )


def test_fused_linear_cross_entropy_compiled_with_frozen_weight(device):
    """Only the gradients autograd asks for are computed (a frozen head, as in LoRA)."""
    h, w = leaf(2, 6, 16, device=device), torch.randn(37, 16, device=device)
    t = targets(12, 37, device).view(2, 6)
    assert_compiled_matches_eager(lambda h, t: ff.fused_linear_cross_entropy(h, w, t, chunk_size=4), h, t)


@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_bad_class_index_raises_when_compiled(op, device, monkeypatch):
    """The range check runs inside the custom op (eagerly): still a ValueError naming the index."""
    from fuseforge.ops import targets as target_checks

    monkeypatch.setattr(target_checks, "TARGET_CHECK", "sync")  # on a GPU, raise in the call (targets.py)
    h, w = leaf(6, 16, device=device), leaf(37, 16, device=device)
    t = targets(6, 37, device)
    t[4] = 37 + 5
    if op == "cross_entropy":
        fn = torch.compile(lambda h, t: ff.cross_entropy(h @ w.t(), t), backend="aot_eager", fullgraph=True)
    else:
        fn = torch.compile(lambda h, t: ff.fused_linear_cross_entropy(h, w, t), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"class index 42, outside \[0, 37\)"):
        fn(h, t)


def test_eager_calls_skip_the_dispatcher(device):
    """Outside torch.compile the public ops keep calling their autograd.Functions directly."""
    x, w = leaf(3, 8, device=device), leaf(8, device=device)
    assert type(ff.rms_norm(x, w).grad_fn).__name__ == "_RMSNormFunctionBackward"
    gate, up = leaf(3, 8, device=device), leaf(3, 8, device=device)
    assert type(ff.swiglu(gate, up).grad_fn).__name__ == "_GLUFunctionBackward"


def test_inductor(device):
    """The inductor backend: fused ops as opaque calls between generated kernels."""
    x, w = leaf(2, 5, 32, device=device), leaf(32, device=device)
    h, wv = leaf(10, 32, device=device), leaf(37, 32, device=device)
    t = targets(10, 37, device)

    def fn(x, w, h, wv, t):
        y = ff.swiglu(ff.rms_norm(x, w) * 2.0, x)
        return y, ff.fused_linear_cross_entropy(h + y.reshape(10, 32), wv, t, chunk_size=4)

    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    expected, actual = fn(x, w, h, wv, t), compiled(x, w, h, wv, t)
    leaves = (x, w, h, wv)
    upstream = torch.randn_like(expected[0])
    grads_e = torch.autograd.grad((expected[0] * upstream).sum() + expected[1], leaves)
    grads_a = torch.autograd.grad((actual[0] * upstream).sum() + actual[1], leaves)
    # Inductor may fuse the surrounding elementwise ops with other roundings: fp32 tolerance, not bits.
    for e, a in zip((*expected, *grads_e), (*actual, *grads_a)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
