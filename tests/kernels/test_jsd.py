"""Generalized JSD (on log-probs and fused with the LM heads) against float64 PyTorch references."""

import math

import pytest
import torch
import torch.nn.functional as F

from fuseforge.functional import fused_linear_jsd, jsd
from fuseforge.modules import FusedLinearJSDLoss, JSDLoss
from fuseforge.ops.jsd import default_chunk_size
from tolerances import assert_close

# Masked lanes make NaN/inf in not-selected tl.where branches; numpy reports them from the interpreter.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

IGNORE = -100
BETAS = [0.0, 0.3, 0.5, 1.0]


# ------------------------------------------------------------------------------- references


def ref_jsd_rows(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row generalized JSD from F.kl_div (float64), written independently of the kernel's algebra."""
    s, t = s.double(), t.double()

    def kl(p_log, q_log):  # KL(P || Q) per row, from log-probs
        return F.kl_div(q_log, p_log, reduction="none", log_target=True).sum(-1)

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    log_m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)
    return beta * kl(t, log_m) + (1 - beta) * kl(s, log_m)


def reduce_rows(rows: torch.Tensor, keep: torch.Tensor, reduction: str, vocab: int) -> torch.Tensor:
    rows = torch.where(keep, rows, torch.zeros_like(rows))
    n = keep.sum().clamp(min=1)
    return {"none": rows, "sum": rows.sum(), "batchmean": rows.sum() / n, "mean": rows.sum() / (n * vocab)}[reduction]


def make_logp(shape, dtype, device):
    """Correlated student/teacher log-probs with peaky rows (some probabilities near 1)."""
    z_s = torch.randn(shape, device=device) * 2.5
    z_t = z_s + torch.randn(shape, device=device) * 1.5
    return z_s.log_softmax(-1).to(dtype), z_t.log_softmax(-1).to(dtype)


def make_target(shape, vocab, device):
    target = torch.randint(0, vocab, shape, device=device)
    flat = target.view(-1)
    flat[torch.rand(flat.shape, device=device) < 0.3] = IGNORE
    flat[0] = 0
    if flat.numel() > 1:
        flat[1] = IGNORE
    return target


def assert_grad_close(actual, expected, dtype, scale=1.0):
    """Compare gradients relative to their largest entry (they scale like 1/V and 1/N)."""
    largest = expected.abs().max().clamp(min=1e-30)
    assert torch.isfinite(actual).all()
    assert_close(actual / largest, expected / largest, dtype, scale=scale)


def jsd_reference(s, t, target, beta, reduction):
    s64 = s.detach().double().requires_grad_(True)
    keep = target != IGNORE if target is not None else torch.ones(s.shape[:-1], dtype=torch.bool, device=s.device)
    loss = reduce_rows(ref_jsd_rows(s64, t.double(), beta), keep, reduction, s.shape[-1])
    return loss, s64


# -------------------------------------------------------------------------------------- jsd


@pytest.mark.parametrize("vocab", [1, 33, 1000, 4097])
@pytest.mark.parametrize("beta", BETAS)
def test_jsd_matches_reference(vocab, beta, device):
    s, t = make_logp((6, vocab), torch.float32, device)
    s.requires_grad_(True)
    target = make_target((6,), vocab, device)
    loss = jsd(s, t, target, beta=beta)
    ref, s64 = jsd_reference(s, t, target, beta, "batchmean")
    assert_close(loss, ref, torch.float32)
    loss.backward()
    ref.backward()
    assert_grad_close(s.grad, s64.grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_low_precision(dtype, beta, device):
    s, t = make_logp((5, 1000), dtype, device)
    s.requires_grad_(True)
    target = make_target((5,), 1000, device)
    loss = jsd(s, t, target, beta=beta)
    assert loss.dtype == dtype
    ref, s64 = jsd_reference(s, t, target, beta, "batchmean")
    assert_close(loss, ref, dtype)
    loss.backward()
    ref.backward()
    assert s.grad.dtype == dtype
    assert_grad_close(s.grad, s64.grad, dtype)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
def test_jsd_reductions_on_3d_input(reduction, device):
    vocab = 77
    s, t = make_logp((2, 3, vocab), torch.float32, device)
    s.requires_grad_(True)
    target = make_target((2, 3), vocab, device)
    loss = jsd(s, t, target, beta=0.3, reduction=reduction)
    ref, s64 = jsd_reference(s, t, target, 0.3, reduction)
    assert loss.shape == ref.shape
    assert_close(loss, ref, torch.float32)
    upstream = torch.randn_like(ref)
    loss.backward(upstream.float())
    ref.backward(upstream)
    assert_grad_close(s.grad, s64.grad, torch.float32)
    if reduction == "none":
        assert (loss[target == IGNORE] == 0).all()
    assert (s.grad[target == IGNORE] == 0).all()


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
def test_jsd_all_rows_ignored(reduction, device):
    s, t = make_logp((4, 50), torch.float32, device)
    s.requires_grad_(True)
    target = torch.full((4,), IGNORE, device=device)
    loss = jsd(s, t, target, reduction=reduction)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(s.grad, torch.zeros_like(s))


def test_jsd_without_target_and_custom_ignore_index(device):
    s, t = make_logp((5, 40), torch.float32, device)
    ref, _ = jsd_reference(s, t, None, 0.5, "batchmean")
    assert_close(jsd(s, t), ref, torch.float32)
    # ignore_index is a value of target, not a fixed sentinel
    target = torch.tensor([3, 7, 3, 1, 0], device=device)
    rows = ref_jsd_rows(s, t, 0.5)
    assert_close(jsd(s, t, target, ignore_index=3), rows[target != 3].mean(), torch.float32)


@pytest.mark.parametrize("ignore_index", [2**40, -(2**63), 2**63 - 1])
def test_ignore_index_beyond_int32_with_int32_target(ignore_index, device):
    """Any int64 ignore_index is compared exactly, also with int32 targets: 2**40 is no int32's value,
    so it ignores nothing (torch compares an int32 tensor with 2**40 wrapped to 0)."""
    s, t = make_logp((4, 30), torch.float32, device)
    hs, ws, ht, wt = make_heads(4, 8, 8, 30, torch.float32, device)
    target = torch.tensor([0, 1, 0, 2], dtype=torch.int32, device=device)
    assert_close(jsd(s, t, target, ignore_index=ignore_index), jsd(s, t), torch.float32)
    fused = fused_linear_jsd(hs, ws, ht, wt, target, ignore_index=ignore_index)
    assert_close(fused, fused_linear_jsd(hs, ws, ht, wt), torch.float32)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_jsd_zero_probability_entries_contribute_nothing(beta, device):
    """A teacher that masks part of the vocabulary (-inf log-probs) gives a finite loss, not NaN."""
    z_s = torch.randn(4, 60, device=device)
    z_t = torch.randn(4, 60, device=device)
    z_t[:, 50:] = float("-inf")
    s, t = z_s.log_softmax(-1).requires_grad_(True), z_t.log_softmax(-1)
    loss = jsd(s, t, beta=beta, reduction="sum")
    s64, t64 = s.detach().double().requires_grad_(True), t.double()
    p_s, p_t = s64.exp(), t64.exp()
    if beta == 0.0:
        ref = torch.where(p_t > 0, p_t * (t64 - s64), 0.0).sum()
    else:
        log_m = (beta * p_t + (1 - beta) * p_s).log()
        ref = beta * torch.where(p_t > 0, p_t * (t64 - log_m), 0.0).sum() + (1 - beta) * (p_s * (s64 - log_m)).sum()
    assert torch.isfinite(loss)
    assert_close(loss, ref, torch.float32)
    loss.backward()
    ref.backward()
    assert_grad_close(s.grad, s64.grad, torch.float32)


@pytest.mark.parametrize("reduction", ["none", "batchmean"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("side", ["student", "teacher"])
def test_jsd_nan_propagates_like_torch(side, beta, reduction, device):
    """A NaN log-prob gives a NaN loss, and NaN gradient entries exactly where float64 PyTorch has
    them (issue 16): never a NaN loss with finite gradients, nor a finite loss. (At beta = 0 the
    student gradient is -p_t: finite for a NaN student, as in torch.)"""
    s, t = make_logp((3, 20), torch.float32, device)
    (s if side == "student" else t)[1, 4] = float("nan")
    s.requires_grad_(True)
    loss = jsd(s, t, beta=beta, reduction=reduction)
    ref, s64 = jsd_reference(s, t, None, beta, reduction)
    assert torch.equal(loss.isnan(), ref.isnan()) and ref.isnan().any()
    upstream = torch.rand_like(ref) + 0.5
    loss.backward(upstream.float())
    ref.backward(upstream)
    assert torch.equal(s.grad.isnan(), s64.grad.isnan())
    finite = ~s64.grad.isnan()
    assert_close(s.grad[finite], s64.grad[finite], torch.float32)


def test_jsd_endpoints_are_the_normalised_limits(device):
    """beta=0 is lim JSD_beta/beta = KL(teacher||student); beta=1 is lim JSD_beta/(1-beta) = KL(student||teacher)."""
    z = torch.randn(4, 300, device=device)
    s = z.log_softmax(-1)
    t = (2.5 * z + 0.3 * torch.randn_like(z)).log_softmax(-1)  # sharper teacher: the two KLs differ
    eps = 1e-3
    forward_kl, reverse_kl = jsd(s, t, beta=0.0), jsd(s, t, beta=1.0)
    torch.testing.assert_close(jsd(s, t, beta=eps) / eps, forward_kl, rtol=2e-2, atol=0)
    torch.testing.assert_close(jsd(s, t, beta=1 - eps) / eps, reverse_kl, rtol=2e-2, atol=0)
    assert (forward_kl - reverse_kl).abs() > 0.05 * forward_kl


def test_jsd_teacher_gets_no_gradient_and_views_work(device):
    s_full, t_full = make_logp((6, 2 * 90), torch.float32, device)
    s_leaf = s_full.clone().requires_grad_(True)
    t_leaf = t_full.clone().requires_grad_(True)
    s, t = s_leaf[:, ::2], t_leaf[:, 1::2]  # strided last dim (copied) ...
    loss = jsd(s, t, beta=0.5)
    loss.backward()
    assert t_leaf.grad is None
    ref, s64 = jsd_reference(s, t, None, 0.5, "batchmean")
    ref.backward()
    assert_grad_close(s_leaf.grad[:, ::2], s64.grad, torch.float32)
    assert (s_leaf.grad[:, 1::2] == 0).all()
    # ... and a row-strided view is read in place
    s_rows = s_leaf.detach()[:, :90]
    t_rows = t_full[:, :90]
    assert_close(jsd(s_rows, t_rows), jsd_reference(s_rows, t_rows, None, 0.5, "batchmean")[0], torch.float32)


def test_jsd_no_grad_and_single_backward(device):
    s, t = make_logp((3, 20), torch.float32, device)
    s.requires_grad_(True)
    with torch.no_grad():
        value = jsd(s, t)
    assert not value.requires_grad
    loss = jsd(s, t)
    assert_close(loss, value, torch.float32)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_jsd_loss_module_through_log_softmax(device):
    logits = torch.randn(4, 3, 55, device=device, requires_grad=True)
    teacher = torch.randn(4, 3, 55, device=device).log_softmax(-1)
    target = make_target((4, 3), 55, device)
    module = JSDLoss(beta=0.3)
    loss = module(logits.log_softmax(-1), teacher, target)
    loss.backward()
    logits64 = logits.detach().double().requires_grad_(True)
    keep = target != IGNORE
    ref = reduce_rows(ref_jsd_rows(logits64.log_softmax(-1), teacher, 0.3), keep, "batchmean", 55)
    ref.backward()
    assert_close(loss, ref, torch.float32)
    assert_grad_close(logits.grad, logits64.grad, torch.float32)
    assert "beta=0.3" in repr(module)


def test_jsd_rejects_bad_input(device):
    s, t = make_logp((3, 10), torch.float32, device)
    with pytest.raises(ValueError, match="same shape"):
        jsd(s, t[:, :9])
    with pytest.raises(ValueError, match="student_logp must have at least 2"):
        jsd(s[0], t[0])
    with pytest.raises(ValueError, match="beta"):
        jsd(s, t, beta=1.5)
    with pytest.raises(ValueError, match="beta"):
        jsd(s, t, beta=float("nan"))
    with pytest.raises(TypeError, match="beta"):
        jsd(s, t, beta="half")
    with pytest.raises(ValueError, match="reduction"):
        jsd(s, t, reduction="avg")
    with pytest.raises(TypeError, match="student_logp must have dtype"):
        jsd(s.double(), t.double())
    with pytest.raises(TypeError, match="target must have dtype"):
        jsd(s, t, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="target must have shape"):
        jsd(s, t, torch.zeros(4, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="teacher_logp must be a torch.Tensor"):
        jsd(s, t.tolist())
    with pytest.raises(ValueError, match="empty vocabulary"):
        jsd(s[:, :0], t[:, :0])


# ------------------------------------------------------------------------- fused linear jsd


def fused_reference(hs, ws, ht, wt, target, beta, temperature):
    """Unfused float64 reference: full logits, tempered log-softmax, JSD, batchmean over kept tokens."""
    hs64 = hs.detach().double().requires_grad_(True)
    ws64 = ws.detach().double().requires_grad_(True)
    s = (hs64 @ ws64.T / temperature).log_softmax(-1)
    t = (ht.double() @ wt.double().T / temperature).log_softmax(-1)
    keep = target != IGNORE if target is not None else torch.ones(s.shape[:-1], dtype=torch.bool, device=s.device)
    return reduce_rows(ref_jsd_rows(s, t, beta), keep, "batchmean", s.shape[-1]), hs64, ws64


def make_heads(n, hs_size, ht_size, vocab, dtype, device):
    hs = torch.randn(n, hs_size, device=device).to(dtype).requires_grad_(True)
    ws = (torch.randn(vocab, hs_size, device=device) * 1.5 / hs_size**0.5).to(dtype).requires_grad_(True)
    ht = torch.randn(n, ht_size, device=device).to(dtype)
    wt = (torch.randn(vocab, ht_size, device=device) * 1.5 / ht_size**0.5).to(dtype)
    return hs, ws, ht, wt


def check_fused(hs, ws, ht, wt, target, beta, temperature, chunk_size, dtype, grad_scale=1.0):
    loss = fused_linear_jsd(hs, ws, ht, wt, target, beta=beta, temperature=temperature, chunk_size=chunk_size)
    ref, hs64, ws64 = fused_reference(hs, ws, ht, wt, target, beta, temperature)
    assert loss.dtype == hs.dtype
    assert_close(loss, ref, dtype)
    loss.backward()
    ref.backward()
    assert_grad_close(hs.grad, hs64.grad, dtype, grad_scale)
    assert_grad_close(ws.grad, ws64.grad, dtype, grad_scale)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize(
    "vocab, temperature, chunk_size",
    [(1, 1.0, None), (33, 1.0, 4), (1000, 2.0, 5), (4097, 0.7, 13)],
)
def test_fused_linear_jsd_matches_reference(beta, vocab, temperature, chunk_size, device):
    n = 13
    hs, ws, ht, wt = make_heads(n, 16, 24, vocab, torch.float32, device)
    target = make_target((n,), vocab, device)
    check_fused(hs, ws, ht, wt, target, beta, temperature, chunk_size, torch.float32)
    assert ht.grad is None and wt.grad is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_linear_jsd_low_precision(dtype, beta, device):
    hs, ws, ht, wt = make_heads(11, 32, 16, 500, dtype, device)
    target = make_target((11,), 500, device)
    # the kernel's logits and gradient buffers are rounded to `dtype` before the matmuls
    check_fused(hs, ws, ht, wt, target, beta, 1.5, 4, dtype, grad_scale=2.0)


def test_fused_linear_jsd_3d_without_target_default_chunks(device):
    hs, ws, ht, wt = make_heads(10, 8, 12, 70, torch.float32, device)
    hs3 = hs.detach().view(2, 5, 8).requires_grad_(True)
    loss = fused_linear_jsd(hs3, ws, ht.view(2, 5, 12), wt)
    ref, hs64, ws64 = fused_reference(hs, ws, ht, wt, None, 0.5, 1.0)
    assert_close(loss, ref, torch.float32)
    loss.backward()
    ref.backward()
    assert_grad_close(hs3.grad.view(10, 8), hs64.grad, torch.float32)
    assert_grad_close(ws.grad, ws64.grad, torch.float32)


@pytest.mark.parametrize("beta", BETAS)
def test_fused_linear_jsd_nan_propagates_like_torch(beta, device):
    """A NaN in one token's student hidden state: NaN loss, and NaN gradients where torch has them."""
    hs, ws, ht, wt = make_heads(6, 8, 8, 40, torch.float32, device)
    hs.detach()[2, 3] = float("nan")
    loss = fused_linear_jsd(hs, ws, ht, wt, beta=beta, chunk_size=4)
    ref, hs64, ws64 = fused_reference(hs, ws, ht, wt, None, beta, 1.0)
    assert loss.isnan() and ref.isnan()
    loss.backward()
    ref.backward()
    assert torch.equal(hs.grad.isnan(), hs64.grad.isnan()) and torch.equal(ws.grad.isnan(), ws64.grad.isnan())


def test_fused_linear_jsd_all_ignored(device):
    hs, ws, ht, wt = make_heads(7, 8, 8, 40, torch.float32, device)
    target = torch.full((7,), IGNORE, device=device)
    loss = fused_linear_jsd(hs, ws, ht, wt, target, chunk_size=3)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(hs.grad, torch.zeros_like(hs)) and torch.equal(ws.grad, torch.zeros_like(ws))


def test_fused_linear_jsd_empty_batch_and_autocast(device):
    hs, ws, ht, wt = make_heads(5, 8, 8, 40, torch.float32, device)
    empty = fused_linear_jsd(hs[:0], ws, ht[:0], wt)
    assert empty.item() == 0.0
    empty.backward()
    assert torch.equal(ws.grad, torch.zeros_like(ws))
    ws.grad = None
    # autocast must not change the dtypes the fused matmuls write into
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss = fused_linear_jsd(hs, ws, ht, wt, chunk_size=2)
    assert loss.dtype == torch.float32
    assert_close(loss, fused_reference(hs, ws, ht, wt, None, 0.5, 1.0)[0], torch.float32)


def test_fused_linear_jsd_frozen_head_and_no_grad(device):
    hs, ws, ht, wt = make_heads(9, 8, 8, 45, torch.float32, device)
    ws.requires_grad_(False)  # frozen LM head: only the hidden states get a gradient
    loss = fused_linear_jsd(hs, ws, ht, wt, beta=0.3, chunk_size=4)
    loss.backward()
    ref, hs64, _ = fused_reference(hs, ws, ht, wt, None, 0.3, 1.0)
    ref.backward()
    assert ws.grad is None
    assert_grad_close(hs.grad, hs64.grad, torch.float32)
    with torch.no_grad():
        assert_close(fused_linear_jsd(hs, ws, ht, wt, beta=0.3), ref, torch.float32)


def test_fused_linear_jsd_module_and_upstream_gradient(device):
    hs, ws, ht, wt = make_heads(6, 8, 4, 30, torch.float32, device)
    target = make_target((6,), 30, device)
    module = FusedLinearJSDLoss(beta=0.5, temperature=2.0, chunk_size=4)
    loss = module(hs, ws, ht, wt, target)
    (3.0 * loss).backward()
    ref, hs64, ws64 = fused_reference(hs, ws, ht, wt, target, 0.5, 2.0)
    (3.0 * ref).backward()
    assert_close(loss, ref, torch.float32)
    assert_grad_close(hs.grad, hs64.grad, torch.float32)
    assert_grad_close(ws.grad, ws64.grad, torch.float32)


def test_default_chunk_size():
    assert default_chunk_size(4096, 4096, 128256) == 256  # floor for matmul efficiency
    assert default_chunk_size(65536, 4096, 32000) == 8448  # logits buffer ~ the hidden states
    assert default_chunk_size(100, 4096, 128256) == 100
    assert default_chunk_size(1, 8, 10) == 1


def test_fused_linear_jsd_rejects_bad_input(device):
    hs, ws, ht, wt = make_heads(4, 8, 6, 20, torch.float32, device)
    with pytest.raises(ValueError, match="vocabulary size mismatch.*V=20.*V=21"):
        fused_linear_jsd(hs, ws, ht, torch.randn(21, 6, device=device))
    with pytest.raises(ValueError, match="student_weight must have shape"):
        fused_linear_jsd(hs, torch.randn(20, 7, device=device), ht, wt)
    with pytest.raises(ValueError, match="teacher_weight must have shape"):
        fused_linear_jsd(hs, ws, ht, torch.randn(20, 8, device=device))
    with pytest.raises(ValueError, match="same tokens"):
        fused_linear_jsd(hs, ws, ht[:3], wt)
    with pytest.raises(TypeError, match="student_weight has dtype"):
        fused_linear_jsd(hs, ws.detach().half(), ht, wt)
    with pytest.raises(TypeError, match="teacher_weight has dtype"):
        fused_linear_jsd(hs, ws, ht, wt.half())
    # The heads do not run in the autocast dtype, so autocast does not excuse a mismatch.
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16), \
            pytest.raises(TypeError, match="student_weight has dtype torch.bfloat16 .*; cast them to one dtype$"):
        fused_linear_jsd(hs, ws.detach().bfloat16(), ht, wt)
    with pytest.raises(TypeError, match=r"target must have dtype in \(int64, int32\), got int16"):
        fused_linear_jsd(hs, ws, ht, wt, torch.zeros(4, dtype=torch.int16, device=device))
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_jsd(hs, ws, ht, wt, temperature=0.0)
    with pytest.raises(ValueError, match="beta"):
        fused_linear_jsd(hs, ws, ht, wt, beta=-0.1)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_jsd(hs, ws, ht, wt, chunk_size=0)
    with pytest.raises(ValueError, match="target must have shape"):
        fused_linear_jsd(hs, ws, ht, wt, torch.zeros(5, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="student_weight must have 2 dimensions"):
        fused_linear_jsd(hs, ws[None], ht, wt)
