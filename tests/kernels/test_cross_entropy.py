"""fuseforge cross_entropy on logits vs a float64 torch reference (loss, grads, options, errors)."""

import pytest
import torch

from ce_reference import random_targets, reference_cross_entropy, reference_lse
from fuseforge.modules.losses import CrossEntropyLoss
from fuseforge.loss_args import LossOptions
from fuseforge.ops.cross_entropy import (
    ce_forward_stats,
    ce_write_grad,
    cross_entropy,
)
from fuseforge.ops._shared.vocab_major_cross_entropy import vocab_major_loss_and_lse
from tolerances import assert_close, tol

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
    # fp32 holds lse only to ~|lse| * 2**-24, an error every loss and exp(z - lse) inherits
    # (it shows when the top two logits nearly tie): loosen by a few of those ulps.
    lse_ulp = float(reference_lse(logits.double()).abs().max()) * 2**-24
    ulps = max(1.0, 4 * lse_ulp / tol(torch.float32)["atol"])
    assert_close(loss, ref, torch.float32, scale=ulps)
    assert_close(grad, ref_grad, torch.float32, scale=ulps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tile shapes (the interpreter uses its own)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rows_of_many_tiles(dtype):
    n, v = 19, 50001  # rows of several GPU tiles (4096 wide), the last one ragged
    logits = (torch.randn(n, v) * 3).to(dtype)
    options = dict(label_smoothing=0.1, z_loss_scale=1e-3, softcap=30.0)
    loss, grad, ref, ref_grad = _run(logits, random_targets(n, v), "sum", **options)
    assert_close(loss, ref, dtype, scale=4.0)  # a sum of 19 losses
    assert_close(grad, ref_grad, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred check exists on CUDA devices")
def test_gpu_bad_target_is_nan_now_and_raises_later():
    """TARGET_CHECK="async": no sync in the call; the loss is NaN, and the ValueError comes from
    raise_pending_target_errors, or from the next loss call once the GPU is done."""
    from fuseforge.ops import targets

    logits = torch.randn(4, 10, requires_grad=True)
    bad = torch.tensor([0, 10, 1, -100])
    loss = cross_entropy(logits, bad)
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match=r"class index 10, outside \[0, 10\).*earlier cross_entropy call"):
        targets.raise_pending_target_errors(wait=True)
    cross_entropy(logits, bad)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="class index 10"):
        cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    good = cross_entropy(logits, torch.tensor([0, 1, 2, 3]))  # reported once: the next call is clean
    assert torch.isfinite(good)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_of_forward_and_backward():
    """No host sync in forward or backward (grad_output is applied on the device while capturing)."""
    n, v = 9, 3000
    logits = (torch.randn(n, v) * 3).requires_grad_()
    target = random_targets(n, v)

    def step():
        logits.grad = None
        loss = cross_entropy(logits, target, label_smoothing=0.1)
        (loss * 2.5).backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile the kernels) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    logits.grad = None
    with torch.cuda.graph(graph):
        loss = step()
    logits.data.mul_(0.5)  # new values in the captured input buffer
    graph.replay()
    torch.cuda.synchronize()
    ref_x = logits.detach().double().requires_grad_()
    ref = reference_cross_entropy(ref_x, target, label_smoothing=0.1)
    (ref * 2.5).backward()
    assert_close(loss, ref, torch.float32)
    assert_close(logits.grad, ref_x.grad, torch.float32)


@pytest.mark.parametrize("per_token_scale", [True, False])
def test_vocab_splits_and_layouts_agree(per_token_scale):
    """The split-vocabulary merge, strided (vocab-major) addressing and the gradient written in
    place (also from a padded-row view) all give the reference result."""
    n, v = 21, 3000
    opts = LossOptions(label_smoothing=0.1, z_loss_scale=1e-2, softcap=10.0)
    logits = torch.randn(n, v) * 3
    transposed = logits.t().contiguous().t()
    padded = torch.cat([logits, torch.randn(n, 5)], dim=1)[:, :v]
    target = random_targets(n, v)
    scale = torch.randn(n) if per_token_scale else torch.randn(1)
    results = []
    for x, splits in [(logits, 1), (logits, 3), (transposed, 2)]:
        loss, lse = ce_forward_stats(x, target, opts, n_splits=splits)
        grad = ce_write_grad(x, target, lse, scale, opts, out=torch.empty(n, v), n_splits=splits)
        results.append((loss, lse, grad))
    for x in (logits.clone(), padded.clone()):  # in place: every tile read before it is overwritten
        loss, lse = ce_forward_stats(x, target, opts)
        results.append((loss, lse, ce_write_grad(x, target, lse, scale, opts, out=x)))
    ref_x = logits.double().requires_grad_()
    ref = reference_cross_entropy(ref_x, target, reduction="none", label_smoothing=0.1, z_loss_scale=1e-2, softcap=10.0)
    ref.backward(scale.double().expand(n))
    for loss, lse, grad in results:
        assert_close(loss, ref, torch.float32)
        assert_close(lse, reference_lse(logits.double(), softcap=10.0), torch.float32)
        assert_close(grad, ref_x.grad, torch.float32)


@pytest.mark.parametrize("target_is_row_max", [False, True], ids=["target_anywhere", "target_is_row_max"])
def test_target_logit_in_last_split_and_partial_tile(target_is_row_max):
    """The statistics kernels load the target's logit directly (no scan): targets in the last
    vocabulary split's last, partial tile (interpreter tiles: 1024 token-major, 512 vocab-major)
    and on both sides of a split boundary, at the row max or not, with softcap, give the
    reference on every kernel."""
    n, v = 12, 3000  # splits of 1024 classes: the last holds [2048, 3000), its last 512-tile 440
    logits = torch.randn(n, v) * 3
    target = torch.randint(2560, v, (n,))
    # The last class, the first of the last split (owned by it alone), of the last vocab-major
    # tile, the last of the split before, an ignored token.
    target[:5] = torch.tensor([v - 1, 2048, 2560, 2047, -100])
    if target_is_row_max:
        rows = torch.arange(n)
        logits[rows, target.clamp(min=0)] = logits.max(dim=1).values + torch.rand(n) + 0.1
    opts = LossOptions(label_smoothing=0.1, z_loss_scale=1e-3, softcap=4.0)
    scale = torch.randn(1)
    transposed = logits.t().contiguous()
    split_runs = [(logits, 1), (logits, 3), (transposed.t(), 3)]
    results = [ce_forward_stats(x, target, opts, n_splits=splits) for x, splits in split_runs]
    vocab_major = (torch.empty(n), torch.empty(n))
    vocab_major_loss_and_lse(transposed, target, opts, *vocab_major)
    results.append(vocab_major)
    loss, lse = ce_forward_stats(logits, target, opts)
    results.append((loss, lse))
    grad = ce_write_grad(logits, target, lse, scale, opts, out=torch.empty(n, v))
    ref_x = logits.double().requires_grad_()
    ref = reference_cross_entropy(ref_x, target, reduction="none", label_smoothing=0.1, z_loss_scale=1e-3, softcap=4.0)
    ref.backward(scale.double().expand(n))
    for loss, lse in results:
        assert_close(loss, ref, torch.float32)
        assert_close(lse, reference_lse(logits.double(), softcap=4.0), torch.float32)
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


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_grad_reuses_buffer_and_flags_stale_users(reduction):
    x = torch.randn(7, 33, requires_grad=True)
    logits = x * 2
    target = random_targets(7, 33)
    squares = logits**2  # saves `logits` for its own backward
    ref = reference_cross_entropy(logits.double(), target, reduction=reduction, label_smoothing=0.1)
    upstream = torch.rand(ref.shape, dtype=torch.float64) + 0.5
    expected = torch.autograd.grad(ref, logits, upstream)[0]
    loss = cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1, inplace_grad=True)
    (loss * upstream.float()).sum().backward(retain_graph=True)  # grad_output != 1
    assert_close(logits.detach(), expected, torch.float32)  # the buffer now holds the gradient
    assert_close(x.grad, 2 * expected, torch.float32)
    with pytest.raises(RuntimeError, match="inplace"):
        squares.sum().backward()


def test_inplace_grad_on_leaf_falls_back_to_fresh_buffer():
    logits = torch.randn(7, 33, requires_grad=True)
    target = random_targets(7, 33)
    before = logits.detach().clone()
    (cross_entropy(logits, target, inplace_grad=True) * 2.5).backward()
    assert torch.equal(logits.detach(), before)
    assert logits.grad.data_ptr() != logits.data_ptr()
    ref_x = before.double().requires_grad_()
    (reference_cross_entropy(ref_x, target) * 2.5).backward()
    assert_close(logits.grad, ref_x.grad, torch.float32)


@pytest.mark.parametrize("layout", ["expanded_rows", "expanded_vocab"])
def test_inplace_grad_on_overlapping_logits_falls_back_to_fresh_buffer(layout):
    """Expanded logits hold one cell for many elements: the gradient cannot live in them (issue 16)."""
    base = torch.randn(1, 33, requires_grad=True) if layout == "expanded_rows" else torch.randn(7, 1, requires_grad=True)
    shared = base * 2.0  # a non-leaf, so inplace_grad is not refused for being a leaf
    logits = shared.expand(7, 33)
    target = random_targets(7, 33)
    before = shared.detach().clone()
    (cross_entropy(logits, target, inplace_grad=True) * 2.5).backward()
    ref_base = base.detach().double().requires_grad_()
    (reference_cross_entropy((ref_base * 2.0).expand(7, 33), target) * 2.5).backward()
    assert torch.equal(shared.detach(), before)
    assert_close(base.grad, ref_base.grad, torch.float32)


@pytest.mark.parametrize("inplace_grad", [False, True])
def test_strided_token_major_logits(inplace_grad):
    """Rows padded in memory (a slice of a wider buffer), of a leaf or of a non-leaf written in place."""
    n, v = 13, 1500
    leaf = (torch.randn(n, v + 7) * 3).requires_grad_()
    wide = leaf * 1.0 if inplace_grad else leaf
    logits = wide[:, 3 : v + 3]
    assert logits.stride() == (v + 7, 1)
    target = random_targets(n, v)
    ref_x = logits.detach().double().requires_grad_()
    ref = reference_cross_entropy(ref_x, target, z_loss_scale=1e-3)
    (ref * 2.5).backward()
    loss = cross_entropy(logits, target, z_loss_scale=1e-3, inplace_grad=inplace_grad)
    (loss * 2.5).backward()
    assert_close(loss, ref, torch.float32)
    assert_close(leaf.grad[:, 3 : v + 3], ref_x.grad, torch.float32)
    assert torch.count_nonzero(leaf.grad[:, :3]) == 0 and torch.count_nonzero(leaf.grad[:, v + 3 :]) == 0
    if inplace_grad:
        assert_close(wide[:, 3 : v + 3].detach(), ref_x.grad, torch.float32)  # the buffer holds the gradient


@pytest.mark.parametrize(
    "case, reduction",
    [("grad", "mean"), ("grad", "none"), ("no_grad_mode", "mean"), ("no_requires_grad", "mean"), ("vocab_major", "mean")],
)
def test_every_call_kind_matches_reference(case, reduction):
    """Gradient wanted or not, per-token or scalar loss, token- or vocab-major logits."""
    n, v = 9, 300
    values = torch.randn(n, v) * 3
    target = random_targets(n, v)
    leaf = values.t().contiguous() if case == "vocab_major" else values.clone()
    leaf.requires_grad_(case != "no_requires_grad")
    logits = leaf.t() if case == "vocab_major" else leaf
    with torch.set_grad_enabled(case != "no_grad_mode"):
        loss = cross_entropy(logits, target, reduction=reduction, softcap=8.0)
    ref_x = values.double().requires_grad_()
    ref = reference_cross_entropy(ref_x, target, reduction=reduction, softcap=8.0)
    assert_close(loss, ref, torch.float32)
    if loss.requires_grad:
        loss.backward(torch.ones_like(loss))
        ref.backward(torch.ones_like(ref))
        grad = leaf.grad.t() if case == "vocab_major" else leaf.grad
        assert_close(grad, ref_x.grad, torch.float32)


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
        (dict(ignore_index=2**70), ValueError, r"ignore_index must be an int in the int64 range .*got 1180591620717411303424"),
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
def test_bad_inputs(logits, target, error, match, device, sync_target_check):
    if logits.device.type != "meta":
        logits, target = logits.to(device), target.to(device)
    with pytest.raises(error, match=match):
        cross_entropy(logits, target)


def test_ignore_index_inside_vocab_is_not_an_error():
    target = torch.tensor([0, 2, 2, 4], dtype=torch.int32)  # any integer dtype is accepted
    loss, grad, ref, ref_grad = _run(torch.randn(4, 5), target, "mean", ignore_index=2)
    assert_close(loss, ref, torch.float32)
    assert torch.count_nonzero(grad[1:3]) == 0


@pytest.mark.parametrize("ignore_index", [2**63 - 1, -(2**63)])
def test_ignore_index_at_the_int64_limits(ignore_index):
    """Every int64 is a valid ignore_index (one step further is a ValueError, tests/kernels/test_bad_inputs.py)."""
    target = torch.tensor([0, ignore_index, 3, ignore_index])
    loss, grad, ref, _ = _run(torch.randn(4, 5), target, "mean", ignore_index=ignore_index)
    assert_close(loss, ref, torch.float32)
    assert torch.count_nonzero(grad[1]) == 0 and torch.count_nonzero(grad[3]) == 0


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
