"""kl_div against torch.nn.functional.kl_div in float64: values, input and target gradients, every reduction."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from fuseforge.functional import kl_div
from fuseforge.modules import KLDivLoss
from tolerances import assert_close, tol

# y / y and log(0) in masked lanes make NaN/inf that numpy reports from the interpreter.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

REDUCTIONS = ["none", "sum", "mean", "batchmean"]


def torch_kl_div(x, y, reduction, log_target):
    with warnings.catch_warnings():  # torch warns that "mean" is not the KL divergence
        warnings.simplefilter("ignore", UserWarning)
        return F.kl_div(x, y, reduction=reduction, log_target=log_target)


def make_inputs(shape, dtype, device, log_target):
    """Log-prob input and a strictly positive target (probabilities or their logs) over the last dimension."""
    x = torch.randn(shape, device=device).mul(2).log_softmax(-1) if len(shape) else torch.randn((), device=device)
    y = torch.randn(shape, device=device).mul(2).log_softmax(-1) if len(shape) else torch.rand((), device=device).log()
    y = y.clamp(min=-9.0)  # strictly positive even in fp16 (zero targets are tested on their own)
    if not log_target:
        y = y.exp()
    return x.to(dtype).requires_grad_(True), y.to(dtype).requires_grad_(True)


def check_against_torch(x, y, reduction, log_target, dtype, equal_nan=False, upstream_scale=1.0):
    """Forward, and gradients w.r.t. both input and target under a random upstream gradient.

    fp16 gradients of a "mean" loss are ~1/numel and fall into subnormals; `upstream_scale`
    plays the role of a loss scaler there.
    """
    out = kl_div(x, y, reduction=reduction, log_target=log_target)
    x64 = x.detach().double().requires_grad_(x.requires_grad)
    y64 = y.detach().double().requires_grad_(y.requires_grad)
    ref = torch_kl_div(x64, y64, reduction, log_target)
    assert out.shape == ref.shape
    assert out.dtype == torch.result_type(x, y)
    torch.testing.assert_close(out.double(), ref, equal_nan=equal_nan, **tol(dtype))
    upstream = (torch.rand_like(ref) + 0.5) * upstream_scale
    leaves = [t for t in (x, y) if t.requires_grad]
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, [t for t in (x64, y64) if t.requires_grad], upstream)
    for g, r, leaf in zip(grads, ref_grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
        largest = r[torch.isfinite(r)].abs().max().clamp(min=1e-30) if r.numel() else 1.0
        if leaf is y and r.numel():
            largest = torch.maximum(largest, target_gradient_terms(x64, y64, reduction, log_target, upstream))
        torch.testing.assert_close(g.double() / largest, r / largest, equal_nan=equal_nan, **tol(dtype))


REDUCE = {"none": lambda t: t, "sum": torch.sum, "mean": torch.mean,
          "batchmean": lambda t: t.sum() / (t.shape[0] if t.dim() else 1)}


def target_gradient_terms(x64, y64, reduction, log_target, upstream):
    """The largest sum of |terms| of d loss / d target. That gradient is a difference, exp(y) (y - x) + exp(y) with
    log targets and (log y - x) + 1 without, which cancels where y - x (log y - x) nears -1: there the fp32 kernel's
    error is the rounding of the terms, not of their small difference (a scalar test drew y - x = -1.0026)."""
    z = torch.zeros(torch.broadcast_shapes(x64.shape, y64.shape), dtype=torch.float64, device=x64.device,
                    requires_grad=True)
    factor = torch.autograd.grad(REDUCE[reduction](z), z, upstream)[0].abs()  # upstream x the reduction's scale
    y, x = y64.detach(), x64.detach()
    terms = y.exp() * ((y - x).abs() + 1) if log_target else (y.log() - x).abs() + 1
    bound = (factor * terms).sum_to_size(y.shape)  # a broadcast target sums its terms over the copies
    return bound[torch.isfinite(bound)].max()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("shape", [(5, 33), (3, 1000), (2, 3, 17), (4097,), (1, 1), ()], ids=str)
def test_kl_div_matches_torch(shape, reduction, log_target, device):
    x, y = make_inputs(shape, torch.float32, device, log_target)
    check_against_torch(x, y, reduction, log_target, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_low_precision(dtype, reduction, log_target, device):
    x, y = make_inputs((4, 300), dtype, device, log_target)
    check_against_torch(x, y, reduction, log_target, dtype, upstream_scale=x.numel() if reduction == "mean" else 1.0)


def test_kl_div_zero_targets_follow_torch(device):
    """0 * log 0 = 0 in the loss; torch's target gradient there is NaN (0/0 in xlogy's derivative): ours too."""
    x, y = make_inputs((4, 50), torch.float32, device, log_target=False)
    y = y.detach().clone()
    y[:, :10] = 0.0
    y.requires_grad_(True)
    out = kl_div(x, y, reduction="none")
    assert torch.isfinite(out).all() and (out[:, :10] == 0).all()
    check_against_torch(x, y, "sum", False, torch.float32, equal_nan=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kl_div_broadcasting(reduction, device):
    x, _ = make_inputs((6, 40), torch.float32, device, False)
    _, prior = make_inputs((40,), torch.float32, device, False)
    check_against_torch(x, prior, reduction, False, torch.float32)  # target [V] against input [N, V]
    _, y = make_inputs((6, 40), torch.float32, device, True)
    row = x[:1].detach().clone().requires_grad_(True)
    check_against_torch(row, y, reduction, True, torch.float32)  # batchmean divides by input.size(0) == 1


def test_kl_div_mixed_dtypes_and_views(device):
    x, y = make_inputs((8, 64), torch.float32, device, False)
    x16 = x.detach().bfloat16().requires_grad_(True)
    check_against_torch(x16, y, "batchmean", False, torch.bfloat16)  # result dtype float32, like torch
    xt = x.detach().t()  # non-contiguous
    yt = y.detach().t()
    ref = torch_kl_div(xt.double(), yt.double(), "none", False)
    assert_close(kl_div(xt, yt, reduction="none"), ref, torch.float32)


def test_kl_div_input_only_gradient(device):
    x, y = make_inputs((3, 70), torch.float32, device, True)
    y = y.detach()
    out = kl_div(x, y, log_target=True)
    out.backward()
    expected = -y.double().exp() / 3
    assert_close(x.grad, expected, torch.float32)


def test_kl_div_empty_input_follows_torch(device):
    x = torch.zeros(0, 5, device=device, requires_grad=True)
    y = torch.zeros(0, 5, device=device)
    assert kl_div(x, y, reduction="sum").item() == 0.0
    assert torch.isnan(kl_div(x, y, reduction="mean"))
    assert torch.isnan(kl_div(x, y, reduction="batchmean"))
    kl_div(x, y, reduction="sum").backward()
    assert x.grad.shape == (0, 5)


def test_kl_div_loss_module(device):
    x, y = make_inputs((4, 25), torch.float32, device, False)
    module = KLDivLoss()
    assert module.reduction == "batchmean"
    out = module(x, y)
    assert_close(out, torch.nn.KLDivLoss(reduction="batchmean")(x.double(), y.double()), torch.float32)
    logged = KLDivLoss(reduction="sum", log_target=True)
    ref = torch.nn.KLDivLoss(reduction="sum", log_target=True)(x.double(), y.log().double())
    assert_close(logged(x, y.log()), ref, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        KLDivLoss(reduction="elementwise_mean")


def test_kl_div_rejects_bad_input(device):
    x, y = make_inputs((4, 10), torch.float32, device, False)
    with pytest.raises(ValueError, match="do not broadcast"):
        kl_div(x, y[:, :9])
    with pytest.raises(ValueError, match="reduction"):
        kl_div(x, y, reduction="avg")
    with pytest.raises(TypeError, match="input must have dtype"):
        kl_div(x.double(), y)
    with pytest.raises(TypeError, match="target must have dtype"):
        kl_div(x, torch.ones(4, 10, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="log_target must be a bool"):
        kl_div(x, y, log_target="yes")
    with pytest.raises(TypeError, match="target must be a torch.Tensor"):
        kl_div(x, 0.5)
