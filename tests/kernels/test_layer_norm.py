"""LayerNorm kernel and module against float64 torch layer_norm and torch.nn.LayerNorm."""

import pytest
import torch
import torch.nn.functional as F

from fuseforge.modules.norms import LayerNorm
from fuseforge.ops import layer_norm as layer_norm_module
from fuseforge.ops._shared import rowwise
from fuseforge.ops.layer_norm import layer_norm
from norm_checks import assert_matches_reference, force_split_backward, least_precise
from tolerances import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 7), (65, 127), (2, 3, 1000), (3, 4097)]


def make_affine(n, dtype, device, with_weight=True, with_bias=True):
    weight = (torch.randn(n, device=device) * 0.5 + 1.0).to(dtype).requires_grad_() if with_weight else None
    bias = torch.randn(n, device=device).to(dtype).requires_grad_() if with_bias else None
    return weight, bias


def check_layer_norm(x, weight, bias, eps=1e-5, scale=1.0, dy=None):
    """Forward and all gradients against float64 F.layer_norm on the same (rounded) inputs."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    y_ref = F.layer_norm(leaves[0], (x.shape[-1],), leaves[1], leaves[2], eps)
    y = layer_norm(x, weight, bias, eps)
    dtypes = [t.dtype for t in (x, weight, bias) if t is not None]
    value_dtype = least_precise(*dtypes)
    assert_matches_reference(y, y_ref, x.dtype, value_dtype, scale, what="y")
    dy = torch.randn_like(y) if dy is None else dy
    y.backward(dy)
    y_ref.backward(dy.double())
    magnitudes = {"dx": dx_magnitude(leaves[0], leaves[1], dy, eps)}
    for name, t, ref in zip(("dx", "dweight", "dbias"), (x, weight, bias), leaves):
        if t is not None:
            assert t.grad.dtype == t.dtype, name
            assert_close(t.grad, ref.grad, value_dtype, scale, msg=name, magnitude=magnitudes.get(name, 1.0))


def dx_magnitude(x, weight, dy, eps) -> float:
    """Scale of the terms dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) subtracts, g = dy * w:
    rstd * |g|, at least 1. A row of near-constant x has rstd up to 1 / sqrt(eps) (316 at 1e-5), and
    its dx cancels to ~0 (exactly 0 with one column) up to a few fp32 roundings of that scale."""
    x64 = x.detach().double()
    rstd = (x64.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    g = dy.double() * (weight.detach().double() if weight is not None else 1.0)
    return max(1.0, float((rstd * g.abs()).max()))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_matches_reference(shape, dtype, device):
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype).requires_grad_()  # non-zero mean
    weight, bias = make_affine(shape[-1], dtype, device)
    check_layer_norm(x, weight, bias)


def test_one_column_dx_with_the_gpus_fma_rounding(monkeypatch, device):
    """The H200 failure of [float32-(1, 1)] (issue 16), reproduced on any device.

    With one column x - mean = 0, so dx = rstd * (g - mean(g)) is exactly 0 (g = dy * w). Compiled
    for the GPU, g - mean(g) can keep one rounding of g: Triton contracts it into
    fma(dy, w, -mean(g)) by default, leaving the rounding error of dy * w (up to half an ulp of g;
    an approximate division by n_cols would leave about as much). Times rstd = 1 / sqrt(eps) = 316
    that is 7.5e-5 here. The kernel is right to fp32 precision of the terms it subtracts
    (rstd * |g| = 1375), so dx's atol must be relative to that scale, not to 1. Emulated: the
    backward's dx gets exactly the fma residual.
    """
    real_backward = layer_norm_module._LayerNormFunction.backward
    residuals = []

    def backward_as_on_the_gpu(ctx, dy):
        dx, *rest = real_backward(ctx, dy)
        _, weight, _, _, rstd = ctx.saved_tensors
        fma_residual = dy.double() * weight.double() - (dy * weight).double()  # fma(dy, w, -fp32(dy * w))
        residuals.append((rstd.double()[:, None] * fma_residual).float())
        return (dx + residuals[-1], *rest)

    monkeypatch.setattr(layer_norm_module._LayerNormFunction, "backward", staticmethod(backward_as_on_the_gpu))
    x = torch.tensor([[0.3]], device=device, requires_grad=True)
    weight = torch.tensor([1.5], device=device, requires_grad=True)
    bias = torch.tensor([0.2], device=device, requires_grad=True)
    check_layer_norm(x, weight, bias, dy=torch.tensor([[2.9]], device=device))
    assert residuals[0].abs().item() > 5e-5  # what an absolute 1e-5 on dx rejected


@pytest.mark.parametrize("with_weight, with_bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_optional_affine(with_weight, with_bias, dtype, device):
    x = torch.randn(33, 300, device=device).to(dtype).requires_grad_()
    weight, bias = make_affine(300, dtype, device, with_weight, with_bias)
    check_layer_norm(x, weight, bias, eps=1e-6)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_affine_with_half_input(x_dtype, device):
    x = torch.randn(20, 250, device=device).to(x_dtype).requires_grad_()
    weight, bias = make_affine(250, torch.float32, device)
    check_layer_norm(x, weight, bias)


def test_multi_tile_persistent_path(monkeypatch, device):
    monkeypatch.setattr(rowwise, "INTERPRETER_ROW_BLOCK", 4)
    monkeypatch.setattr(rowwise, "GPU_MAX_ROW_BLOCK", 4)
    monkeypatch.setattr(rowwise, "num_programs_hint", lambda _device: 3)
    monkeypatch.setattr(rowwise, "GPU_BWD_PROGRAMS_PER_SM", (1, 1))
    x = torch.randn(37, 100, device=device, requires_grad=True)
    weight, bias = make_affine(100, torch.float32, device)
    check_layer_norm(x, weight, bias)


@pytest.fixture
def split_backward(monkeypatch):
    """Every row width takes the split backward; the param_grads calls it made."""
    return force_split_backward(monkeypatch, layer_norm_module)


@pytest.mark.parametrize("shape", [(3, 7), (130, 127), (2, 70, 300)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_backward_matches_reference(split_backward, shape, dtype, device):
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    weight, bias = make_affine(shape[-1], dtype, device)
    check_layer_norm(x, weight, bias)
    assert len(split_backward) == 1


@pytest.mark.parametrize("with_weight, with_bias", [(True, False), (False, True), (False, False)])
def test_split_backward_optional_affine(split_backward, with_weight, with_bias, device):
    x = torch.randn(70, 200, device=device).to(torch.bfloat16).requires_grad_()
    weight, bias = make_affine(200, torch.float32, device, with_weight, with_bias)  # fp32 params, bf16 x
    check_layer_norm(x, weight, bias)
    assert len(split_backward) == int(with_weight or with_bias)


def test_split_backward_params_only(split_backward, device):
    """A frozen input: only the column kernel runs."""
    x = torch.randn(66, 90, device=device) + 0.5
    weight, bias = make_affine(90, torch.float32, device)
    w64, b64 = (t.detach().double().requires_grad_() for t in (weight, bias))
    dy = torch.randn(66, 90, device=device)
    layer_norm(x, weight, bias).backward(dy)
    F.layer_norm(x.double(), (90,), w64, b64, 1e-5).backward(dy.double())
    assert_close(weight.grad, w64.grad, torch.float32, msg="dweight")
    assert_close(bias.grad, b64.grad, torch.float32, msg="dbias")
    assert len(split_backward) == 1


@pytest.mark.parametrize("layout", ["row_slice", "transposed", "broadcast_grad"])
def test_non_contiguous(layout, device):
    if layout == "transposed":
        x = torch.randn(127, 6, device=device).t().requires_grad_()
    else:
        x = torch.randn(6, 200, device=device)[:, 3:130].requires_grad_()
    weight, bias = make_affine(127, torch.float32, device)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    y_ref = F.layer_norm(leaves[0], (127,), leaves[1], leaves[2], 1e-5)
    y = layer_norm(x, weight, bias)
    assert_close(y, y_ref, torch.float32)
    dy = torch.randn(127, device=device).expand_as(y) if layout == "broadcast_grad" else torch.randn(6, 127, device=device)
    dy_copy = dy.clone()
    y.backward(dy)
    y_ref.backward(dy.double())
    for t, ref in zip((x, weight, bias), leaves):
        assert_close(t.grad, ref.grad, torch.float32)
    assert torch.equal(dy, dy_copy), "the caller's gradient must not be overwritten"


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=str)
def test_empty_input(shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    weight, bias = make_affine(shape[-1], torch.float32, device)
    y = layer_norm(x, weight, bias)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


def test_gradcheck_float64(device):
    x = torch.randn(3, 6, dtype=torch.float64, device=device, requires_grad=True)
    weight, bias = make_affine(6, torch.float64, device)
    assert torch.autograd.gradcheck(lambda a, w, b: layer_norm(a, w, b, 1e-5), (x, weight, bias))
    assert torch.autograd.gradcheck(lambda a: layer_norm(a, None, None, 1e-5), (x,))


def test_bad_inputs(device, monkeypatch):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    with pytest.raises(TypeError, match="x"):
        layer_norm(x.int(), w)
    with pytest.raises(ValueError, match="x"):
        layer_norm(torch.tensor(1.0, device=device), None)
    with pytest.raises(ValueError, match="weight"):
        layer_norm(x, torch.randn(9, device=device))
    with pytest.raises(ValueError, match="bias"):
        layer_norm(x, w, torch.randn(2, 8, device=device))
    with pytest.raises(TypeError, match="bias"):
        layer_norm(x, w, torch.ones(8, dtype=torch.long, device=device))
    for eps in (0.0, -1.0):
        with pytest.raises(ValueError, match="eps"):
            layer_norm(x, w, eps=eps)
    with pytest.raises(ValueError, match="bias is on meta"):
        layer_norm(x, w, torch.empty(8, device="meta"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        layer_norm(torch.randn(4, 8), None)


@pytest.mark.parametrize(
    "normalized_shape, kwargs",
    [(96, {}), ((4, 24), {"eps": 1e-6}), (96, {"bias": False}), (96, {"elementwise_affine": False})],
    ids=str,
)
def test_module_is_drop_in_for_torch_layer_norm(normalized_shape, kwargs, device):
    ref = torch.nn.LayerNorm(normalized_shape, device=device, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    ours = LayerNorm(normalized_shape, device=device, **kwargs)
    assert isinstance(ours, torch.nn.LayerNorm)
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict())
    trailing = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    x = torch.randn(2, 5, *trailing, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), ref(x_ref)
    assert_close(y, y_ref, torch.float32)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert_close(x.grad, x_ref.grad, torch.float32)
    for p, p_ref in zip(ours.parameters(), ref.parameters()):
        assert_close(p.grad, p_ref.grad, torch.float32, scale=2.0)
    with pytest.raises(ValueError, match="trailing dimensions"):
        ours(torch.randn(3, 7, device=device))


def test_module_bf16_matches_torch_bits(device):
    ref = torch.nn.LayerNorm(256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = LayerNorm(256, device=device, dtype=torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y, y_ref = ours(x), ref(x)
    assert (y != y_ref).float().mean() <= 0.01
    assert_close(y, y_ref, torch.bfloat16)
