"""fuseforge cross_entropy on logits vs a float64 torch reference (loss, grads, options, errors)."""

import pytest
import torch

from ce_reference import random_targets, reference_cross_entropy, reference_lse
from fuseforge.modules.losses import CrossEntropyLoss
from fuseforge.ops.cross_entropy import LossOptions, ce_forward_stats, ce_write_grad, cross_entropy
from tolerances import assert_close

REDUCTIONS = ["mean", "sum", "none"]


@pytest.fixture(autouse=True)
def _tensors_on_test_device(device):
    """Every tensor a test makes lives where the kernels run (CUDA, or the CPU interpreter)."""
    torch.set_default_device(device)
    yield
    torch.set_default_device(None)


def _run(logits, target, reduction="mean", upstream=None, **options):
    """Loss and logits-grad of fuseforge (on `logits`) and of the float64 reference."""
    x = logits.detach().clone().requires_grad_()
    loss = cross_entropy(x, target, reduction=reduction, **options)
    if upstream is None:
        upstream = torch.randn(loss.shape, dtype=torch.float64) if reduction == "none" else torch.tensor(0.75)
    loss.backward(upstream.to(loss.dtype))
    ref_x = logits.detach().double().requires_grad_()
    ref = reference_cross_entropy(ref_x, target.long(), reduction=reduction, **options)
    ref.backward(upstream.double())
    return loss, x.grad, ref, ref_x.grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n, v", [(1, 1), (7, 33), (37, 4097)])
def test_matches_torch(n, v, reduction, device):
    logits = torch.randn(n, v, device=device) * 3
    target = random_targets(n, v).to(device)
    loss, grad, ref, ref_grad = _run(logits, target, reduction, label_smoothing=0.1)
    assert loss.dtype == logits.dtype
    assert_close(loss, ref, torch.float32)
    assert_close(grad, ref_grad, torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "options",
    [
        dict(label_smoothing=0.3),
        dict(z_loss_scale=1e-2),
        dict(softcap=4.0),
        dict(label_smoothing=0.1, z_loss_scale=1e-3, softcap=30.0, ignore_index=5),
    ],
)
def test_options(options, reduction):
    n, v = 37, 1000
    target = random_targets(n, v, ignore_index=options.get("ignore_index", -100))
    loss, grad, ref, ref_grad = _run(torch.randn(n, v) * 4, target, reduction, **options)
    assert_close(loss, ref, torch.float32)
    assert_close(grad, ref_grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision(dtype, reduction):
    n, v = 37, 1000
    logits = (torch.randn(n, v) * 3).to(dtype)  # the reference sees the same rounded values
    options = dict(label_smoothing=0.1, z_loss_scale=1e-3, softcap=20.0)
    loss, grad, ref, ref_grad = _run(logits, random_targets(n, v), reduction, **options)
    assert loss.dtype == dtype and grad.dtype == dtype
    assert_close(loss, ref, dtype)
    assert_close(grad, ref_grad, dtype)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero_not_nan(reduction):
    logits = torch.randn(7, 33)
    target = torch.full((7,), -100)
    loss, grad, _, _ = _run(logits, target, reduction, label_smoothing=0.2, z_loss_scale=1e-2)
    assert torch.count_nonzero(loss) == 0 and not torch.isnan(loss).any()
    assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("scale", [100.0, 1e4])
def test_large_logits_are_stable(scale):
    n, v = 7, 4097
    logits = torch.randn(n, v) * scale
    loss, grad, ref, ref_grad = _run(logits, random_targets(n, v), "none", z_loss_scale=1e-4)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert_close(loss, ref, torch.float32)
    assert_close(grad, ref_grad, torch.float32)


def test_vocab_splits_and_transposed_layout_agree():
    """The split-vocabulary merge and strided (vocab-major) addressing give the one-split result."""
    n, v = 21, 3000
    opts = LossOptions(label_smoothing=0.1, z_loss_scale=1e-2, softcap=10.0)
    logits = torch.randn(n, v) * 3
    transposed = logits.t().contiguous().t()
    target = random_targets(n, v)
    scale = torch.randn(n)
    results = []
    for x, splits in [(logits, 1), (logits, 3), (transposed, 2)]:
        loss, lse = ce_forward_stats(x, target, opts, n_splits=splits)
        grad = ce_write_grad(x, target, lse, scale, opts, out=torch.empty(n, v), n_splits=splits)
        results.append((loss, lse, grad))
    ref_x = logits.double().requires_grad_()
    ref = reference_cross_entropy(ref_x, target, reduction="none", label_smoothing=0.1, z_loss_scale=1e-2, softcap=10.0)
    ref.backward(scale.double())
    for loss, lse, grad in results:
        assert_close(loss, ref, torch.float32)
        assert_close(lse, reference_lse(logits.double(), softcap=10.0), torch.float32)
        assert_close(grad, ref_x.grad, torch.float32)


def test_leading_dims_and_return_lse():
    logits = torch.randn(2, 5, 33) * 2
    target = random_targets(10, 33).view(2, 5)
    loss, lse = cross_entropy(logits, target, reduction="none", softcap=5.0, return_lse=True)
    assert loss.shape == (2, 5) and lse.shape == (2, 5) and lse.dtype == torch.float32
    flat = logits.reshape(10, 33).double()
    assert_close(loss.reshape(-1), reference_cross_entropy(flat, target.reshape(-1), reduction="none", softcap=5.0),
                 torch.float32)
    assert_close(lse.reshape(-1), reference_lse(flat, softcap=5.0), torch.float32)
    assert not lse.requires_grad


def test_default_never_touches_logits():
    x = torch.randn(7, 33, requires_grad=True)
    logits = x * 2
    before = logits.detach().clone()
    cross_entropy(logits, random_targets(7, 33)).backward()
    assert torch.equal(logits.detach(), before)


def test_inplace_grad_reuses_buffer_and_flags_stale_users():
    x = torch.randn(7, 33, requires_grad=True)
    logits = x * 2
    target = random_targets(7, 33)
    squares = logits**2  # saves `logits` for its own backward
    expected = torch.autograd.grad(reference_cross_entropy(logits.double(), target), logits)[0]
    loss = cross_entropy(logits, target, inplace_grad=True)
    loss.backward(retain_graph=True)
    assert_close(logits.detach(), expected, torch.float32)  # the buffer now holds dloss/dlogits
    assert_close(x.grad, 2 * expected, torch.float32)
    with pytest.raises(RuntimeError, match="inplace"):
        squares.sum().backward()


def test_inplace_grad_on_leaf_falls_back_to_fresh_buffer():
    logits = torch.randn(7, 33, requires_grad=True)
    before = logits.detach().clone()
    cross_entropy(logits, random_targets(7, 33), inplace_grad=True).backward()
    assert torch.equal(logits.detach(), before)
    assert logits.grad.data_ptr() != logits.data_ptr()


def test_no_grad_forward():
    logits = torch.randn(7, 33, requires_grad=True)
    target = random_targets(7, 33)
    with torch.no_grad():
        loss = cross_entropy(logits, target)
    assert_close(loss, reference_cross_entropy(logits.double(), target), torch.float32)


def test_module_matches_functional():
    logits = torch.randn(7, 33)
    target = random_targets(7, 33)
    module = CrossEntropyLoss(reduction="sum", label_smoothing=0.1, softcap=10.0)
    assert "softcap=10.0" in repr(module)
    expected = cross_entropy(logits, target, reduction="sum", label_smoothing=0.1, softcap=10.0)
    torch.testing.assert_close(module(logits, target), expected)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        (dict(z_loss_scale=-1.0), ValueError, "z_loss_scale"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        cross_entropy(torch.randn(3, 5), torch.zeros(3, dtype=torch.long), **kwargs)
    with pytest.raises(error, match=match):
        CrossEntropyLoss(**kwargs)


@pytest.mark.parametrize(
    "logits, target, error, match",
    [
        (torch.randn(3, 5), torch.tensor([0, 5, 1]), ValueError, "class index 5"),
        (torch.randn(3, 5), torch.tensor([0, -1, 1]), ValueError, "class index -1"),
        (torch.randn(3, 5), torch.rand(3), TypeError, "integer class indices"),
        (torch.randn(3, 5), torch.zeros(4, dtype=torch.long), ValueError, "target must have shape"),
        (torch.randn(3, 5, dtype=torch.float64), torch.zeros(3, dtype=torch.long), TypeError, "logits"),
        (torch.randint(0, 3, (3, 5)), torch.zeros(3, dtype=torch.long), TypeError, "logits"),
        (torch.randn(3, 0), torch.zeros(3, dtype=torch.long), ValueError, "at least one class"),
        (torch.randn(3, 5, device="meta"), torch.zeros(3, dtype=torch.long), ValueError, "device|meta"),
        (torch.randn(3, 5, device="meta"), torch.zeros(3, dtype=torch.long, device="meta"), ValueError, "CUDA"),
    ],
)
def test_bad_inputs(logits, target, error, match, device):
    if logits.device.type != "meta":
        logits, target = logits.to(device), target.to(device)
    with pytest.raises(error, match=match):
        cross_entropy(logits, target)


def test_ignore_index_inside_vocab_is_not_an_error():
    target = torch.tensor([0, 2, 2, 4], dtype=torch.int32)  # any integer dtype is accepted
    loss, grad, ref, ref_grad = _run(torch.randn(4, 5), target, "mean", ignore_index=2)
    assert_close(loss, ref, torch.float32)
    assert torch.count_nonzero(grad[1:3]) == 0


def test_strided_and_one_dimensional_logits():
    storage = torch.randn(33, 7) * 3  # logits = storage.t(): a [7, 33] view with token stride 1
    target = random_targets(7, 33)
    loss, grad, ref, ref_grad = _run(storage.t(), target, "none")
    assert_close(loss, ref, torch.float32)
    assert_close(grad, ref_grad, torch.float32)
    single = cross_entropy(storage[:, 0], target[1], reduction="none")  # [V] logits, 0-d target
    assert single.shape == ()
    assert_close(single, reference_cross_entropy(storage[:, :1].t().double(), target[1:2], reduction="none")[0],
                 torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_unit_upstream_and_second_backward(reduction, device):
    """The gradient for grad_output = 1, and again (scaled) from a retained graph."""
    logits = torch.randn(9, 300, device=device) * 3
    target = random_targets(9, 300).to(device)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction=reduction)
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    loss.backward(torch.tensor(2.0, device=device))
    ref_x = logits.double().requires_grad_()
    reference_cross_entropy(ref_x, target.long(), reduction=reduction).backward()
    assert_close(first, ref_x.grad, torch.float32)
    assert_close(x.grad, 2 * ref_x.grad, torch.float32)
