"""RMSNorm / fused add+RMSNorm kernels against a float64 reference with HF's rounding points."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fuseforge.ops.rms_norm import fused_add_rms_norm, rms_norm
from fuseforge.modules.norms import FusedAddRMSNorm, RMSNorm
from fuseforge.ops import rms_norm as rms_norm_module
from fuseforge.ops._shared import rowwise
from norm_checks import assert_matches_reference, force_split_backward, least_precise
from tolerances import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 7), (65, 127), (2, 3, 1000), (3, 4097)]
OFFSET = {"llama": 0.0, "gemma": 1.0}  # Gemma's weights are zero-initialised around offset 1


def round_through(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to dtype going forward, identity going backward (a cast's gradient)."""
    return t + (t.to(dtype).double() - t).detach()


def reference(x, weight, eps, offset, casting, residual=None):
    """Float64 RMSNorm rounding where HF rounds: the residual sum and, for llama, the
    normalized value to x's dtype; returns (y, new_residual, out_dtype) and float64 leaves."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    leaves = {"x": x64, "weight": w64}
    s = x64
    if residual is not None:
        r64 = residual.detach().double().requires_grad_()
        leaves["residual"] = r64
        s = round_through(x64 + r64, x.dtype)
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        normed = round_through(normed, x.dtype)
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
    else:
        out_dtype = x.dtype
    return normed * (offset + w64), s, out_dtype, leaves


def make_inputs(shape, dtype, device, weight_dtype=None, casting="llama"):
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(shape[-1], device=device) * 0.5 + (1.0 if casting == "llama" else 0.0))
    return x, weight.to(weight_dtype or dtype).requires_grad_()


def check_rms_norm(x, weight, casting, offset, eps=1e-6, scale=1.0):
    y = rms_norm(x, weight, eps, offset, casting)
    y_ref, _, out_dtype, leaves = reference(x, weight, eps, offset, casting)
    value_dtype = least_precise(x.dtype, weight.dtype)
    assert_matches_reference(y, y_ref, out_dtype, value_dtype, scale, what="y")
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy.double())
    assert_close(x.grad, leaves["x"].grad, value_dtype, scale, msg="dx")
    assert_close(weight.grad, leaves["weight"].grad, value_dtype, scale, msg="dweight")
    assert x.grad.dtype == x.dtype and weight.grad.dtype == weight.dtype


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_rms_norm_matches_reference(shape, dtype, casting, device):
    x, weight = make_inputs(shape, dtype, device, casting=casting)
    check_rms_norm(x, weight, casting, OFFSET[casting])


@pytest.mark.parametrize(
    "x_dtype, w_dtype, casting, offset",
    [
        (torch.bfloat16, torch.float32, "llama", 0.0),  # HF mixed precision: fp32 output
        (torch.float16, torch.float32, "llama", 0.5),
        (torch.float32, torch.bfloat16, "llama", 0.0),
        (torch.bfloat16, torch.float32, "gemma", 1.0),  # gemma output stays in x's dtype
    ],
    ids=str,
)
def test_mixed_weight_dtype(x_dtype, w_dtype, casting, offset, device):
    x, weight = make_inputs((33, 200), x_dtype, device, weight_dtype=w_dtype, casting=casting)
    check_rms_norm(x, weight, casting, offset)


@pytest.mark.parametrize("shape", [(65, 127), (2, 3, 1000)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_fused_add_matches_reference(shape, dtype, casting, device):
    x, weight = make_inputs(shape, dtype, device, casting=casting)
    residual = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    offset, eps = OFFSET[casting], 1e-5
    y, new_residual = fused_add_rms_norm(x, residual, weight, eps, offset, casting)
    y_ref, s_ref, out_dtype, leaves = reference(x, weight, eps, offset, casting, residual=residual)
    value_dtype = least_precise(x.dtype, weight.dtype)
    assert_matches_reference(y, y_ref, out_dtype, value_dtype, what="y")
    assert torch.equal(new_residual, x.detach() + residual.detach()), "new residual is x + residual in x's dtype"
    dy, ds = torch.randn_like(y), torch.randn_like(new_residual)
    torch.autograd.backward([y, new_residual], [dy, ds])
    torch.autograd.backward([y_ref, s_ref], [dy.double(), ds.double()])
    assert_close(x.grad, leaves["x"].grad, value_dtype, msg="dx")
    assert_close(residual.grad, leaves["residual"].grad, value_dtype, msg="dresidual")
    assert_close(weight.grad, leaves["weight"].grad, value_dtype, msg="dweight")
    x.grad.add_(1.0)  # x and residual may share one gradient tensor; their .grad must not alias
    assert_close(residual.grad, leaves["residual"].grad, value_dtype, msg="dresidual after editing dx")


@pytest.mark.parametrize("used", ["normed", "residual"])
def test_fused_add_with_one_output_used(used, device):
    x, weight = make_inputs((9, 48), torch.float32, device)
    residual = torch.randn_like(x, requires_grad=True)
    y, new_residual = fused_add_rms_norm(x, residual, weight)
    y_ref, s_ref, _, leaves = reference(x, weight, 1e-6, 0.0, "llama", residual=residual)
    out, out_ref = (y, y_ref) if used == "normed" else (new_residual, s_ref)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g.double())
    assert_close(x.grad, leaves["x"].grad, torch.float32)
    assert_close(residual.grad, leaves["residual"].grad, torch.float32)
    if used == "normed":
        assert_close(weight.grad, leaves["weight"].grad, torch.float32)
    else:
        assert weight.grad is None or not weight.grad.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bitwise_faithful_to_hf_modules(dtype, device):
    """Same bits as HF's own modules; the other casting mode disagrees widely (test power)."""
    n = 256
    x = torch.randn(64, n, dtype=dtype, device=device) * 3
    llama = LlamaRMSNorm(n, eps=1e-6).to(device=device, dtype=dtype)
    gemma = Gemma3RMSNorm(n, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        llama.weight.copy_(torch.randn(n) * 0.5 + 1.0)
        gemma.weight.copy_(torch.randn(n) * 0.5)
        y_llama_hf, y_gemma_hf = llama(x), gemma(x)
        y_llama = rms_norm(x, llama.weight, llama.variance_epsilon)
        y_gemma = rms_norm(x, gemma.weight, gemma.eps, offset=1.0, casting="gemma")
        y_llama_as_gemma = rms_norm(x, llama.weight, llama.variance_epsilon, casting="gemma")
    for ours, theirs in [(y_llama, y_llama_hf), (y_gemma, y_gemma_hf)]:
        assert ours.dtype == theirs.dtype
        assert (ours != theirs).float().mean() <= 0.01
        assert_close(ours, theirs, dtype)
    assert (y_llama_as_gemma != y_llama_hf).float().mean() > 0.05


def test_multi_tile_persistent_path(monkeypatch, device):
    """Several programs each looping over several row tiles, the last one short."""
    monkeypatch.setattr(rowwise, "INTERPRETER_ROW_BLOCK", 4)
    monkeypatch.setattr(rowwise, "GPU_MAX_ROW_BLOCK", 4)
    monkeypatch.setattr(rowwise, "num_programs_hint", lambda _device: 3)
    monkeypatch.setattr(rowwise, "GPU_BWD_PROGRAMS_PER_SM", (1, 1))
    plan = rowwise.plan_row_tiles(37, 100, torch.device(device), persistent=True)
    assert (plan.row_block, plan.num_programs, plan.tiles_per_program) == (4, 3, 4)
    x, weight = make_inputs((37, 100), torch.bfloat16, device)
    check_rms_norm(x, weight, "llama", 0.0)
    residual = torch.randn_like(x, requires_grad=True)
    y, s = fused_add_rms_norm(x.detach(), residual, weight.detach())
    (y.float().sum() + s.float().sum()).backward()
    assert residual.grad.shape == x.shape


@pytest.fixture
def split_backward(monkeypatch):
    """Every row width takes the split backward; the param_grads calls it made."""
    return force_split_backward(monkeypatch, rms_norm_module)


@pytest.mark.parametrize("shape", [(3, 7), (130, 127), (2, 70, 300)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_split_backward_matches_reference(split_backward, shape, dtype, casting, device):
    x, weight = make_inputs(shape, dtype, device, casting=casting)
    check_rms_norm(x, weight, casting, OFFSET[casting])
    assert len(split_backward) == 1
    assert split_backward[0]["round_normed"] == (casting == "llama" and dtype != torch.float32)


def test_split_backward_fused_add(split_backward, device):
    x, weight = make_inputs((70, 300), torch.bfloat16, device)
    residual = torch.randn_like(x, requires_grad=True)
    y, new_residual = fused_add_rms_norm(x, residual, weight)
    y_ref, s_ref, _, leaves = reference(x, weight, 1e-6, 0.0, "llama", residual=residual)
    dy, ds = torch.randn_like(y), torch.randn_like(new_residual)
    torch.autograd.backward([y, new_residual], [dy, ds])
    torch.autograd.backward([y_ref, s_ref], [dy.double(), ds.double()])
    for name, t in [("x", x), ("residual", residual), ("weight", weight)]:
        assert_close(t.grad, leaves[name].grad, torch.bfloat16, msg=f"d{name}")
    assert len(split_backward) == 1


def test_split_backward_weight_only(split_backward, device):
    x, weight = make_inputs((66, 90), torch.float32, device)
    y_ref, _, _, leaves = reference(x, weight, 1e-6, 0.0, "llama")
    rms_norm(x.detach(), weight).sum().backward()
    y_ref.sum().backward()
    assert_close(weight.grad, leaves["weight"].grad, torch.float32)
    assert len(split_backward) == 1


@pytest.mark.parametrize("layout", ["row_slice", "transposed", "broadcast_grad"])
def test_non_contiguous(layout, device):
    if layout == "transposed":
        x = torch.randn(127, 6, device=device).t().requires_grad_()
    else:
        x = torch.randn(6, 200, device=device)[:, 3:130].requires_grad_()
    weight = torch.randn(127, device=device, requires_grad=True)
    y = rms_norm(x, weight, casting="gemma", offset=1.0)
    y_ref, _, _, leaves = reference(x, weight, 1e-6, 1.0, "gemma")
    assert_close(y, y_ref, torch.float32)
    dy = torch.randn(127, device=device).expand_as(y) if layout == "broadcast_grad" else torch.randn(6, 127, device=device)
    dy_copy = dy.clone()
    y.backward(dy)
    y_ref.backward(dy.double())
    assert_close(x.grad, leaves["x"].grad, torch.float32)
    assert_close(weight.grad, leaves["weight"].grad, torch.float32)
    assert torch.equal(dy, dy_copy), "the caller's gradient must not be overwritten"


def test_frozen_weight_and_frozen_input(device):
    x, weight = make_inputs((10, 33), torch.float32, device)
    weight.requires_grad_(False)
    rms_norm(x, weight).sum().backward()
    assert weight.grad is None and x.grad is not None
    x2, weight2 = make_inputs((10, 33), torch.float32, device)
    y_ref, _, _, leaves = reference(x2, weight2, 1e-6, 0.0, "llama")
    rms_norm(x2.detach(), weight2).sum().backward()
    y_ref.sum().backward()
    assert_close(weight2.grad, leaves["weight"].grad, torch.float32)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=str)
def test_empty_input(shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    weight = torch.randn(shape[-1], device=device, requires_grad=True)
    residual = torch.randn(shape, device=device, requires_grad=True)
    y = rms_norm(x, weight)
    y2, s = fused_add_rms_norm(x, residual, weight)
    assert y.shape == y2.shape == s.shape == x.shape
    (y.sum() + y2.sum() + s.sum()).backward()
    assert x.grad.shape == x.shape and residual.grad.shape == x.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("casting, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_gradcheck_float64(casting, offset, device):
    x = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)
    residual = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-6, offset, casting), (x, weight))
    assert torch.autograd.gradcheck(
        lambda a, r, w: fused_add_rms_norm(a, r, w, 1e-6, offset, casting), (x, residual, weight)
    )


def test_bad_inputs(device, monkeypatch):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    with pytest.raises(TypeError, match="x"):
        rms_norm(x.long(), w)
    with pytest.raises(TypeError, match="x"):
        rms_norm(x.tolist(), w)
    with pytest.raises(ValueError, match="x"):
        rms_norm(torch.tensor(1.0, device=device), torch.ones(1, device=device))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(7, device=device))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(1, 8, device=device))
    for eps in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            rms_norm(x, w, eps=eps)
    with pytest.raises(ValueError, match="offset"):
        rms_norm(x, w, offset=float("inf"))
    with pytest.raises(ValueError, match="casting"):
        rms_norm(x, w, casting="none")
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(4, 9, device=device), w)
    with pytest.raises(TypeError, match="residual"):
        fused_add_rms_norm(x, x.half(), w)
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm(x, torch.empty(8, device="meta"))
    with pytest.raises(ValueError, match="65536"):
        rms_norm(torch.randn(1, 65537, device=device), torch.ones(65537, device=device))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        rms_norm(torch.randn(4, 8), torch.randn(8))


def test_fused_add_without_residual_raises(device):
    """The result is always the (normed, residual) pair; with residual=None there is no pair, and one
    tensor back would make `y, r = fused_add_rms_norm(...)` silently split it by rows (issue 16)."""
    x, w = torch.randn(4, 8, device=device), torch.ones(8, device=device)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor, got NoneType; .*rms_norm"):
        fused_add_rms_norm(x, None, w)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        FusedAddRMSNorm(8, device=device)(x, None)


def test_module_loads_hf_llama_state_dict(device):
    hf = LlamaRMSNorm(96, eps=1e-5).to(device)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96))
    ours = RMSNorm(96, eps=1e-5, device=device)
    ours.load_state_dict(hf.state_dict())
    assert list(ours.state_dict()) == list(hf.state_dict()) == ["weight"]
    assert ours.variance_epsilon == ours.eps == hf.variance_epsilon
    x = torch.randn(2, 5, 96, device=device, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_()
    y, y_hf = ours(x), hf(x_hf)
    assert_close(y, y_hf, torch.float32)
    g = torch.randn_like(y)
    y.backward(g)
    y_hf.backward(g)
    assert_close(x.grad, x_hf.grad, torch.float32)
    assert_close(ours.weight.grad, hf.weight.grad, torch.float32, scale=2.0)


def test_module_loads_hf_gemma3_state_dict(device):
    fresh = RMSNorm(64, offset=1.0, casting="gemma", init="zeros", device=device, dtype=torch.bfloat16)
    assert fresh.weight.dtype == torch.bfloat16 and not fresh.weight.any()
    hf = Gemma3RMSNorm(64).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64) * 0.3)
    fresh.load_state_dict(hf.state_dict())
    x = torch.randn(17, 64, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y, y_hf = fresh(x), hf(x)
    assert (y != y_hf).float().mean() <= 0.01
    assert_close(y, y_hf, torch.bfloat16)


def test_fused_module_and_constructor_errors(device):
    norm = FusedAddRMSNorm(40, eps=1e-5, device=device)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(2, 3, 40, device=device), torch.randn(2, 3, 40, device=device)
    y, s = norm(x, residual)
    assert_close(y, rms_norm(x + residual, norm.weight, 1e-5), torch.float32)
    assert torch.equal(s, x + residual)
    for kwargs, name in [({"casting": "bogus"}, "casting"), ({"init": "normal"}, "init"), ({"eps": 0}, "eps")]:
        with pytest.raises(ValueError, match=name):
            RMSNorm(8, **kwargs)
