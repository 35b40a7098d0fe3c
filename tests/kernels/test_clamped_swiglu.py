"""clamped_swiglu (GPT-OSS's experts gate) against float64 PyTorch and transformers' own gate."""

import pytest
import torch
from tolerances import assert_close

import fuseforge.ops.glu as glu_module
from fuseforge.functional import clamped_swiglu

ALPHA = 1.702  # GPT-OSS's swiglu_alpha
DTYPES = [torch.float32, torch.bfloat16, torch.float64]

# The interpreter computes exp(-x) in numpy, which warns when it overflows to inf (the intended result).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


def split(gate_up: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "interleaved":
        return gate_up[..., 0::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def reference(gate_up: torch.Tensor, alpha: float, limit: float, layout: str) -> torch.Tensor:
    """transformers' GptOssExperts._apply_gate, with the layout as a parameter."""
    gate, up = split(gate_up, layout)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def make_gate_up(shape, dtype, device, limit, layout="interleaved"):
    """Values spread far beyond +-limit (so the clamp cuts many), plus some exactly at the bounds."""
    x = torch.randn(shape, device=device) * 2 * limit
    gate, up = split(x, layout)
    at_bound = torch.rand(gate.shape, device=device) < 0.1
    gate[at_bound] = limit  # the clamp's gradient passes at the bound itself
    up[torch.rand(up.shape, device=device) < 0.05] = limit
    up[torch.rand(up.shape, device=device) < 0.05] = -limit
    return x.to(dtype).requires_grad_()


def check(gate_up, alpha, limit, layout="interleaved"):
    dtype = gate_up.dtype
    before = gate_up.detach().clone()
    out = clamped_swiglu(gate_up, alpha, limit, layout=layout)
    # The limit as torch's clamp takes it (rounded to the input's dtype); fp64 inputs see fp32-rounded
    # scalars (module docstring); alpha is otherwise exact in the reference.
    ref_alpha = _rounded(alpha, torch.float32) if dtype == torch.float64 else alpha
    ref_limit = _rounded(limit, torch.float32 if dtype == torch.float64 else dtype)
    x64 = gate_up.detach().double().requires_grad_()
    expected = reference(x64, ref_alpha, ref_limit, layout)
    assert out.dtype == dtype and out.shape == (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    assert_close(out, expected, dtype, msg=f"{layout} output")
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, gate_up, grad_out)
    (grad_ref,) = torch.autograd.grad(expected, x64, grad_out.double())
    assert grad.shape == gate_up.shape and grad.dtype == dtype
    assert_close(grad, grad_ref, dtype, msg=f"{layout} grad")
    # Beyond the clamp the gradient is exactly zero; at the bound it is not.
    gate, up = split(gate_up.detach().double(), layout)
    d_gate, d_up = split(grad.double(), layout)
    assert (gate > ref_limit).any() and (d_gate[gate > ref_limit] == 0).all()
    assert (up.abs() > ref_limit).any() and (d_up[up.abs() > ref_limit] == 0).all()
    at_bound = (gate == ref_limit) & (d_gate.abs() > 0)
    assert at_bound.any(), "gradient must pass where gate == limit (torch.clamp's inclusive bound)"
    assert torch.equal(gate_up.detach(), before)  # the input is never written


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("shape", [(3, 5, 2 * 67), (129, 2 * 33), (2 * 257,)], ids=["3d", "2d", "1d"])
def test_matches_float64_reference(device, dtype, layout, shape):
    gate_up = make_gate_up(shape, dtype, device, limit=7.0, layout=layout)
    check(gate_up, ALPHA, 7.0, layout)


@pytest.mark.parametrize("limit", [0.5, 3.25])
def test_other_limits_and_alpha(device, limit):
    gate_up = make_gate_up((17, 2 * 45), torch.float32, device, limit=limit)
    check(gate_up, 0.75, limit)


def test_limit_not_representable_in_bf16_is_taken_as_torch_takes_it(device):
    """limit 0.2 is 0.2001953125 in bf16: a gate equal to that keeps its gradient in torch, and here."""
    gate_up = make_gate_up((33, 2 * 24), torch.bfloat16, device, limit=0.2)
    check(gate_up, ALPHA, 0.2)
    x = gate_up.detach().clone().requires_grad_()
    reference(x, ALPHA, 0.2, "interleaved").sum().backward()  # torch's own bf16 chain
    out = clamped_swiglu(gate_up, ALPHA, 0.2)
    (grad,) = torch.autograd.grad(out.sum(), gate_up)
    # The clamp cuts exactly the same gradients: those beyond the bf16 limit, not those at it. (Elsewhere a
    # bf16 gradient may round to 0 in one chain and not the other, so only the clamp's positions are compared.)
    limit = _rounded(0.2, torch.bfloat16)
    gate, up = split(gate_up.detach(), "interleaved")
    cut, at_limit = torch.zeros_like(gate_up, dtype=torch.bool), torch.zeros_like(gate_up, dtype=torch.bool)
    cut[..., 0::2], cut[..., 1::2] = gate > limit, up.abs() > limit
    at_limit[..., 0::2], at_limit[..., 1::2] = gate == limit, up.abs() == limit
    assert cut.any() and at_limit.any()
    assert (grad[cut] == 0).all() and (x.grad[cut] == 0).all()
    assert (grad[at_limit] != 0).all() and (x.grad[at_limit] != 0).all()


def test_no_clamp_with_infinite_limit(device):
    gate_up = (torch.randn(9, 2 * 40, device=device) * 20).requires_grad_()
    out = clamped_swiglu(gate_up, ALPHA, float("inf"))
    gate, up = split(gate_up.detach().double(), "interleaved")
    assert_close(out, (up + 1) * gate * torch.sigmoid(gate * ALPHA), torch.float32)


@pytest.mark.parametrize("tile", [64, 256])
def test_launch_tiling_does_not_change_results(device, monkeypatch, tile):
    """Small tiles give a 2D grid with masked tails in both rows and columns."""
    monkeypatch.setattr(glu_module, "_INTERPRETER_TILE", tile)
    monkeypatch.setattr(glu_module, "_GPU_TILE", tile)
    check(make_gate_up((7, 3, 2 * 150), torch.float32, device, limit=7.0), ALPHA, 7.0)


def test_strided_inputs(device):
    """A row-strided slice (read in place) and a transposed tensor (copied) give the same results."""
    wide = make_gate_up((6, 2 * 45 + 10), torch.float32, device, limit=7.0).detach()
    check(wide[:, : 2 * 45].requires_grad_(), ALPHA, 7.0)
    check(make_gate_up((2 * 45, 6), torch.float32, device, limit=7.0).detach().t().requires_grad_(), ALPHA, 7.0)


def test_nan_propagates_and_gets_a_zero_gradient_like_torch(device):
    gate_up = torch.randn(4, 2 * 8, device=device)
    gate_up[0, 0] = float("nan")  # a gate
    gate_up[1, 3] = float("nan")  # an up
    gate_up.requires_grad_()
    out = clamped_swiglu(gate_up, ALPHA, 7.0)
    x = gate_up.detach().clone().requires_grad_()
    expected = reference(x, ALPHA, 7.0, "interleaved")
    torch.testing.assert_close(out, expected, equal_nan=True)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, gate_up, grad_out)
    (grad_ref,) = torch.autograd.grad(expected, x, grad_out)
    torch.testing.assert_close(grad, grad_ref, equal_nan=True)
    assert grad[0, 0] == 0 and grad[1, 3] == 0


def test_empty_input(device):
    gate_up = torch.randn(0, 2 * 8, device=device, requires_grad=True)
    out = clamped_swiglu(gate_up, ALPHA, 7.0)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert gate_up.grad.shape == (0, 16)


def test_matches_transformers_gpt_oss_experts_gate(device):
    """The gate transformers' GPT-OSS experts apply (their own code), outputs and gradients."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=24, num_local_experts=2)
    experts = GptOssExperts(config).to(device)
    gate_up = make_gate_up((11, 2 * 24), torch.float32, device, limit=experts.limit)
    x = gate_up.detach().clone().requires_grad_()
    expected = experts._apply_gate(x)
    out = clamped_swiglu(gate_up, experts.alpha, experts.limit)
    assert_close(out, expected, torch.float32)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out)
    assert_close(gate_up.grad, x.grad, torch.float32)


def test_bad_inputs(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match="even"):
        clamped_swiglu(torch.randn(3, 7, device=device), ALPHA, 7.0)
    with pytest.raises(ValueError, match="layout"):
        clamped_swiglu(x, ALPHA, 7.0, layout="halves")
    with pytest.raises(ValueError, match="limit"):
        clamped_swiglu(x, ALPHA, -1.0)
    with pytest.raises(ValueError, match="alpha"):
        clamped_swiglu(x, float("nan"), 7.0)
    with pytest.raises(TypeError, match="alpha"):
        clamped_swiglu(x, torch.tensor(1.0), 7.0)
    with pytest.raises(TypeError):
        clamped_swiglu(x.long(), ALPHA, 7.0)
