"""fuseforge fused_linear_cross_entropy vs linear + cross-entropy in float64 (loss, all grads, options)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import fuseforge.ops.fused_linear_cross_entropy as flce_module
from ce_reference import random_targets, reference_cross_entropy, reference_lse
from fuseforge.modules.losses import FusedLinearCrossEntropyLoss
from fuseforge.loss_args import LossOptions
from fuseforge.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from fuseforge.ops._shared.vocab_major_cross_entropy import vocab_major_loss_and_lse
from tolerances import assert_close

REDUCTIONS = ["mean", "sum", "none"]


@pytest.fixture(autouse=True)
def _tensors_on_test_device(device):
    """Every tensor these tests create lives on the test device (CUDA when present, else the CPU interpreter)."""
    with torch.device(device):
        yield


def _inputs(n, h, v, dtype=torch.float32, bias=False, logit_scale=2.0):
    """hidden, weight (, bias) scaled so that logits have std ~ logit_scale, rounded to `dtype`."""
    hidden = torch.randn(n, h).to(dtype)
    weight = (torch.randn(v, h) * logit_scale / h**0.5).to(dtype)
    b = (torch.randn(v) * 0.5).to(dtype) if bias else None
    return hidden, weight, b


def _leaves(*tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in tensors]


def _grads(*tensors):
    return [None if t is None else t.grad for t in tensors]


def _compare(hidden, weight, bias, target, reduction="mean", upstream=None, dtype=torch.float32, scale=1.0, **kw):
    """Run fuseforge and the float64 reference on the same values; assert loss and grads agree."""
    chunk_size = kw.pop("chunk_size", None)
    num_items = kw.get("num_items_in_batch")
    h, w, b = _leaves(hidden, weight, bias)
    loss = fused_linear_cross_entropy(h, w, target, bias=b, reduction=reduction, chunk_size=chunk_size, **kw)
    if upstream is None:
        upstream = torch.randn(loss.shape) if reduction == "none" else torch.tensor(1.0)
    loss.backward(upstream.to(loss.dtype))

    rh, rw, rb = _leaves(hidden, weight, bias, dtype=torch.float64)
    kw.pop("num_items_in_batch", None)
    ref = reference_cross_entropy(F.linear(rh, rw, rb), target, reduction=reduction, num_items_in_batch=num_items, **kw)
    ref.backward(upstream.double())

    assert loss.dtype == torch.float32
    assert_close(loss, ref, dtype, scale)
    for name, got, want in zip(("hidden", "weight", "bias"), _grads(h, w, b), _grads(rh, rw, rb)):
        if want is None:
            continue
        assert got.dtype == dtype, name
        assert_close(got, want, dtype, scale, msg=f"grad of {name} differs")
    return loss, _grads(h, w, b)


@pytest.fixture
def chunk_ce(monkeypatch):
    """Records the token-major chunks whose gradient the cross-entropy gradient kernel wrote."""
    calls = SimpleNamespace(split_grad=[])
    original = flce_module.ce_write_grad

    def call(logits, *args, **kwargs):
        calls.split_grad.append(tuple(logits.shape))
        return original(logits, *args, **kwargs)

    monkeypatch.setattr(flce_module, "ce_write_grad", call)
    return calls


def _check_chunk_ce(chunk_ce, chunks_expected=True):
    """Token-major chunks got their gradient from the cross-entropy kernels exactly when expected."""
    assert bool(chunk_ce.split_grad) == chunks_expected


@pytest.fixture
def first_block_calls(monkeypatch):
    """Count uses of the path that stores the first min(N, H) tokens' logits in grad_weight."""
    calls = []
    original = flce_module._first_block_in_grad_weight

    def spy(*args, **kwargs):
        done = original(*args, **kwargs)
        calls.append(done)
        return done

    monkeypatch.setattr(flce_module, "_first_block_in_grad_weight", spy)
    return calls


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "n, h, v, chunk, bias, first_block",
    [
        (1, 16, 1, None, False, 0),  # a single class
        (7, 48, 33, 3, True, 7),  # every token through grad_weight's storage
        (37, 16, 1000, 5, True, 16),  # 16 tokens there, then chunks of 5 (last one ragged)
        (37, 16, 4097, 16, False, 0),  # chunks only: 16, 16, 5
        (37, 48, 1000, None, False, 0),  # one chunk
    ],
)
def test_matches_reference(n, h, v, chunk, bias, first_block, reduction, first_block_calls, chunk_ce):
    hidden, weight, b = _inputs(n, h, v, bias=bias)
    target = random_targets(n, v)
    _compare(hidden, weight, b, target, reduction, chunk_size=chunk, label_smoothing=0.1)
    # forward computes grads for mean/sum; "none" runs the loss-only forward then recomputes in backward
    assert first_block_calls == ([first_block] if first_block else [])
    _check_chunk_ce(chunk_ce, chunks_expected=first_block < n)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "options",
    [
        dict(label_smoothing=0.25),
        dict(z_loss_scale=1e-2),
        dict(softcap=3.0),
        dict(label_smoothing=0.1, z_loss_scale=1e-3, softcap=15.0, ignore_index=3),
    ],
)
def test_options(options, reduction, chunk_ce):
    hidden, weight, bias = _inputs(37, 16, 1000, bias=True, logit_scale=4.0)
    target = random_targets(37, 1000, ignore_index=options.get("ignore_index", -100))
    _compare(hidden, weight, bias, target, reduction, chunk_size=7, **options)
    _check_chunk_ce(chunk_ce)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("h", [48, 16])  # 48: every token in grad_weight's storage; 16: then chunks
def test_low_precision(dtype, reduction, h, chunk_ce):
    hidden, weight, bias = _inputs(37, h, 1000, dtype=dtype, bias=True)
    target = random_targets(37, 1000)
    # scale 2: grad_weight is accumulated in `dtype`, with one rounding per chunk (up to 5 here)
    _compare(hidden, weight, bias, target, reduction, dtype=dtype, scale=2.0, chunk_size=8, label_smoothing=0.1,
             softcap=20.0)
    _check_chunk_ce(chunk_ce, chunks_expected=h < 37)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="exercises the GPU tile shapes (the interpreter tiles differ)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_sized_tiles(dtype, reduction, chunk_ce):
    """A 1024-token vocab-major first block (4 warps, many vocabulary splits), then token-major chunks."""
    hidden, weight, bias = _inputs(1500, 1024, 5003, dtype=dtype, bias=True)
    target = random_targets(1500, 5003)
    _compare(hidden, weight, bias, target, reduction, dtype=dtype, scale=2.0, chunk_size=200, label_smoothing=0.1,
             z_loss_scale=1e-3, softcap=30.0)
    _check_chunk_ce(chunk_ce)


def test_vocab_major_kernels_reject_other_layouts():
    token_major = torch.randn(4, 10).t()  # [V=10, tokens=4] with the tokens strided
    with pytest.raises(ValueError, match="contiguous tokens"):
        vocab_major_loss_and_lse(token_major, torch.zeros(4, dtype=torch.long), LossOptions(),
                                 torch.empty(4), torch.empty(4))


def test_large_logits_are_stable():
    hidden, weight, _ = _inputs(37, 16, 1000, logit_scale=100.0)
    target = random_targets(37, 1000)
    # Logits of size ~300 leave the fp32 GEMM with ~1e-4 absolute rounding, which moves the softmax
    # (and so every gradient) by as much: the achievable tolerance grows with the logits' scale.
    loss, grads = _compare(hidden, weight, None, target, "sum", chunk_size=5, scale=100.0, z_loss_scale=1e-4)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads if g is not None)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero_not_nan(reduction, chunk_ce):
    hidden, weight, bias = _inputs(7, 4, 33, bias=True)  # 4 tokens in grad_weight's storage, then chunks of 3
    h, w, b = _leaves(hidden, weight, bias)
    loss = fused_linear_cross_entropy(h, w, torch.full((7,), -100), bias=b, reduction=reduction, chunk_size=3,
                                      z_loss_scale=1e-2)
    loss.backward(torch.ones_like(loss))
    assert torch.count_nonzero(loss) == 0 and not torch.isnan(loss).any()
    assert all(torch.count_nonzero(g) == 0 for g in (h.grad, w.grad, b.grad))
    _check_chunk_ce(chunk_ce)


def test_empty_batch():
    hidden, weight, _ = _inputs(0, 16, 33)
    h, w = _leaves(hidden, weight)
    loss = fused_linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and h.grad.shape == (0, 16)
    assert w.grad.shape == (33, 16) and torch.count_nonzero(w.grad) == 0


def test_chunking_does_not_change_results():
    hidden, weight, bias = _inputs(37, 16, 1000, bias=True)
    target = random_targets(37, 1000)
    outputs = []
    for chunk in (None, 5, 16, 36):
        h, w, b = _leaves(hidden, weight, bias)
        loss = fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=chunk, z_loss_scale=1e-3)
        loss.backward()
        outputs.append([loss, h.grad, w.grad, b.grad])
    for other in outputs[1:]:
        for got, want in zip(other, outputs[0]):
            assert_close(got, want, torch.float32)


def test_num_items_in_batch_gradient_accumulation():
    """Two micro-batches normalised by the total token count sum to the one-batch mean."""
    hidden, weight, bias = _inputs(37, 16, 1000, bias=True)
    target = random_targets(37, 1000)
    total = int((target != -100).sum())
    h, w, b = _leaves(hidden, weight, bias)
    whole = fused_linear_cross_entropy(h, w, target, bias=b, chunk_size=8)
    whole.backward()

    mh, mw, mb = _leaves(hidden, weight, bias)
    parts = []
    for rows, count in ((slice(0, 20), total), (slice(20, 37), torch.tensor(total))):
        part = fused_linear_cross_entropy(mh[rows], mw, target[rows], bias=mb, num_items_in_batch=count, chunk_size=8)
        part.backward()
        parts.append(part)
    assert_close(parts[0] + parts[1], whole, torch.float32)
    for got, want in zip((mh.grad, mw.grad, mb.grad), (h.grad, w.grad, b.grad)):
        assert_close(got, want, torch.float32)


def test_num_items_in_batch_matches_reference():
    hidden, weight, _ = _inputs(7, 16, 33)
    _compare(hidden, weight, None, random_targets(7, 33), "mean", num_items_in_batch=25, chunk_size=3)


def test_upstream_gradient_scales_saved_grads(chunk_ce):
    hidden, weight, _ = _inputs(7, 4, 33)  # 4 tokens in grad_weight's storage, then chunks of 3
    target = random_targets(7, 33)
    _compare(hidden, weight, None, target, "sum", upstream=torch.tensor(-2.5), chunk_size=3)
    _check_chunk_ce(chunk_ce)


def test_frozen_weight_or_frozen_hidden():
    hidden, weight, _ = _inputs(37, 16, 1000)
    target = random_targets(37, 1000)
    ref_h, ref_w = _leaves(hidden, weight, dtype=torch.float64)
    reference_cross_entropy(F.linear(ref_h, ref_w), target).backward()

    h = hidden.clone().requires_grad_()
    fused_linear_cross_entropy(h, weight, target, chunk_size=5).backward()
    assert_close(h.grad, ref_h.grad, torch.float32)

    w = weight.clone().requires_grad_()
    fused_linear_cross_entropy(hidden, w, target, chunk_size=5).backward()
    assert_close(w.grad, ref_w.grad, torch.float32)


def test_no_grad_forward_and_return_lse():
    hidden, weight, bias = _inputs(2 * 5, 16, 33, bias=True)
    target = random_targets(10, 33)
    with torch.no_grad():
        loss, lse = fused_linear_cross_entropy(
            hidden.view(2, 5, 16), weight.requires_grad_(), target.view(2, 5), bias=bias, reduction="none",
            softcap=5.0, return_lse=True,
        )
    logits = F.linear(hidden.double(), weight.double(), bias.double())
    assert loss.shape == lse.shape == (2, 5)
    expected = reference_cross_entropy(logits, target, reduction="none", softcap=5.0)
    assert_close(loss.reshape(-1), expected, torch.float32)
    assert_close(lse.reshape(-1), reference_lse(logits, softcap=5.0), torch.float32)


def test_autocast_runs_the_head_in_autocast_dtype(device):
    hidden, weight, _ = _inputs(7, 16, 33)
    target = random_targets(7, 33)
    h, w = _leaves(hidden, weight)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, target)
    loss.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    rh, rw = _leaves(hidden, weight, dtype=torch.bfloat16)
    rh, rw = _leaves(rh, rw, dtype=torch.float64)
    ref = reference_cross_entropy(F.linear(rh, rw), target)
    ref.backward()
    assert_close(loss, ref, torch.bfloat16)
    assert_close(h.grad, rh.grad, torch.bfloat16)
    assert_close(w.grad, rw.grad, torch.bfloat16)


def test_module_matches_functional():
    hidden, weight, bias = _inputs(7, 16, 33, bias=True)
    target = random_targets(7, 33)
    module = FusedLinearCrossEntropyLoss(reduction="sum", label_smoothing=0.1, return_lse=True, chunk_size=3)
    assert "chunk_size=3" in repr(module)
    loss, lse = module(hidden, weight, target, bias)
    expected = fused_linear_cross_entropy(hidden, weight, target, bias=bias, reduction="sum", label_smoothing=0.1,
                                          return_lse=True)
    torch.testing.assert_close((loss, lse), expected)
    with pytest.raises(ValueError, match="chunk_size"):
        FusedLinearCrossEntropyLoss(chunk_size=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        FusedLinearCrossEntropyLoss(label_smoothing=-0.1)


def _call(hidden=None, weight=None, target=None, **kw):
    hidden = torch.randn(4, 8) if hidden is None else hidden
    weight = torch.randn(10, 8) if weight is None else weight
    target = torch.randint(0, 10, (4,)) if target is None else target
    return fused_linear_cross_entropy(hidden, weight, target, **kw)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(weight=torch.randn(10, 8, dtype=torch.bfloat16)), TypeError, "dtype"),
        (dict(weight=torch.randn(10, 9)), ValueError, "features"),
        (dict(weight=torch.randn(10, 8, 1)), ValueError, "weight"),
        (dict(bias=torch.randn(11)), ValueError, "vocabulary sizes differ"),
        (dict(bias=torch.randn(10, 1)), ValueError, "bias"),
        (dict(target=torch.tensor([0, 10, 1, 2])), ValueError, "class index 10"),
        (dict(target=torch.rand(4)), TypeError, "integer class indices"),
        (dict(target=torch.zeros(4, 1, dtype=torch.long)), ValueError, "target must have shape"),
        (dict(hidden=torch.randint(0, 5, (4, 8))), TypeError, "hidden"),
        (dict(hidden=torch.randn(())), ValueError, "hidden"),
        (dict(reduction="sum", num_items_in_batch=10), ValueError, "num_items_in_batch"),
        (dict(num_items_in_batch=0), ValueError, "num_items_in_batch"),
        (dict(num_items_in_batch=torch.ones(2)), ValueError, "num_items_in_batch"),
        (dict(num_items_in_batch="4"), TypeError, "num_items_in_batch"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=2.5), TypeError, "chunk_size"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(weight=torch.randn(10, 8, device="meta")), ValueError, "device"),
        (dict(hidden=torch.randn(4, 8, device="meta"), weight=torch.randn(10, 8, device="meta"),
              target=torch.zeros(4, dtype=torch.long, device="meta")), ValueError, "CUDA"),
    ],
)
def test_bad_inputs(kwargs, error, match, device, sync_target_check):
    # The cases were built at collection time on the CPU: move them to the test device (meta stays meta).
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
              for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        _call(**kwargs)


def test_gradients_are_handed_over_without_copies(monkeypatch):
    """The saved grad buffers become .grad as they are (a clone would cost another V x H)."""
    buffers = []
    original = flce_module._Gradients.finish

    def record(self, bias):
        original(self, bias)
        buffers.append((self.hidden.data_ptr(), self.weight.data_ptr()))

    monkeypatch.setattr(flce_module._Gradients, "finish", record)
    hidden, weight, _ = _inputs(7, 16, 33)
    h, w = _leaves(hidden, weight)
    fused_linear_cross_entropy(h, w, random_targets(7, 33), chunk_size=3).backward()
    assert buffers == [(h.grad.data_ptr(), w.grad.data_ptr())]


def test_retained_graph_backward_twice():
    hidden, weight, _ = _inputs(7, 16, 33)
    h, w = _leaves(hidden, weight)
    loss = fused_linear_cross_entropy(h, w, random_targets(7, 33))
    loss.backward(retain_graph=True)
    first = (h.grad.clone(), w.grad.clone())
    for k in (2, 3):
        loss.backward(retain_graph=True)
        assert_close(h.grad, k * first[0], torch.float32)
        assert_close(w.grad, k * first[1], torch.float32)


def test_default_chunk_follows_memory_budget():
    """64 MiB of bf16 logits at a 128k vocabulary, at least 256 tokens, and as much as the hidden
    states themselves for big batches (fewer read-modify-writes of grad_weight)."""
    from fuseforge.ops.fused_linear_cross_entropy import default_chunk_tokens

    mib = 2**20
    assert default_chunk_tokens(128256, 2, 8192 * 4096 * 2) == 256  # 64 MiB / 250.5 KiB per token
    assert default_chunk_tokens(32000, 2) == 1040  # 64 MiB / 62.5 KiB, rounded down to a multiple of 16
    assert default_chunk_tokens(256000, 2) == 256  # the 256-token floor: 125 MiB
    big = default_chunk_tokens(128256, 2, 65536 * 4096 * 2)  # 512 MiB of hidden states
    assert big == 2080 and big * 128256 * 2 <= 512 * mib
