"""Preference losses (DPO, CPO, SimPO, ORPO, KTO) from hidden states vs float64 references.

Three layers:
* the shared op (per-token log-probs) against log_softmax + gather of float64 logits;
* each fused loss (loss, metrics, gradients of hidden / weight / bias) against float64 formulas
  written here on materialised logits, fp32 and bf16, ragged shapes, ignored prompt/padding
  tokens and whole ignored sequences;
* those float64 formulas against TRL 1.16's own trainer code (called on stand-in trainer objects,
  no kernels), so that the kernels are tied to TRL's definitions (skipped without trl).
"""

from __future__ import annotations

import types
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fuseforge.functional import (
    fused_linear_cpo_loss,
    fused_linear_dpo_loss,
    fused_linear_kto_kl,
    fused_linear_kto_loss,
    fused_linear_orpo_loss,
    fused_linear_simpo_loss,
    fused_linear_token_logprobs,
)
from fuseforge.modules import FusedLinearDPOLoss, FusedLinearKTOLoss, FusedLinearORPOLoss
from tolerances import assert_close

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

IGNORE = -100
# Ragged on purpose: T = 11 and 2B * T tokens are no multiple of the chunk sizes; V is no power of two.
T, H, V = 11, 24, 203


@pytest.fixture(autouse=True)
def _tensors_on_test_device(device):
    with torch.device(device):
        yield


# ------------------------------------------------------------------------------------ inputs


def make_sequences(n_seq, dtype, *, bias=False, ref_hidden_size=None, empty_rows=(1,), seq_len=T):
    """hidden [n, T, H] predicting target [n, T] (ignored prompt and padding, some rows entirely),
    nll_target (prompt + response, as TRL's ORPO NLL), an LM head and optionally a reference head."""
    hidden = torch.randn(n_seq, seq_len, H).to(dtype)
    weight = (torch.randn(V, H) * 2.0 / H**0.5).to(dtype)
    b = (torch.randn(V) * 0.5).to(dtype) if bias else None
    tokens = torch.randint(0, V, (n_seq, seq_len))
    pos = torch.arange(seq_len)
    prompt = torch.randint(1, seq_len // 2, (n_seq, 1))
    length = torch.randint(seq_len * 2 // 3, seq_len + 1, (n_seq, 1))
    in_sequence = pos < length
    target = torch.where(in_sequence & (pos >= prompt), tokens, IGNORE)
    nll_target = torch.where(in_sequence, tokens, IGNORE)
    for row in empty_rows:
        target[row] = IGNORE
    out = SimpleNamespace(hidden=hidden, weight=weight, bias=b, target=target, nll_target=nll_target)
    if ref_hidden_size:
        out.ref_hidden = torch.randn(n_seq, seq_len, ref_hidden_size).to(dtype)
        out.ref_weight = (torch.randn(V, ref_hidden_size) * 2.0 / ref_hidden_size**0.5).to(dtype)
    return out


def leaves(batch, dtype=None):
    """Fresh leaves (hidden, weight, bias) requiring grad, in `dtype` (default: their own)."""
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_()
            for t in (batch.hidden, batch.weight, batch.bias)]


# ------------------------------------------------------------------------------------ float64 references


def ref_token_logps(logits, target):
    """log_softmax(logits)[target] per token (float64), 0 where target is ignored."""
    logp = torch.log_softmax(logits.double(), -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(target != IGNORE, logp, torch.zeros_like(logp))


def ref_logits(hidden, weight, bias):
    return F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())


def sums_counts(tok, target):
    return tok.sum(-1), (target != IGNORE).sum(-1).double()


def ref_dpo(tok, target, ref_sums, beta, loss_type, ls=0.0):
    sums, counts = sums_counts(tok, target)
    b = sums.shape[0] // 2
    lr = sums - ref_sums
    h = lr[:b] - lr[b:]
    if loss_type == "sigmoid":
        per = -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)
    elif loss_type == "hinge":
        per = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        avg = lr / counts.clamp(min=1)
        per = (avg[:b] - avg[b:] - 1 / (2 * beta)) ** 2
    else:
        per = (-(1 - ls) * F.logsigmoid(beta * h) + ls * F.logsigmoid(-beta * h)) / (1 - 2 * ls)
    return per.mean(), dict(chosen_logps=sums[:b], rejected_logps=sums[b:],
                            chosen_rewards=beta * lr[:b], rejected_rewards=beta * lr[b:])


def ref_nll(tok_nll, nll_target, b):
    mask = (nll_target[:b] != IGNORE).double()
    return -(tok_nll[:b] * mask).sum() / mask.sum().clamp(min=1)


def ref_cpo(tok, tok_nll, target, nll_target, beta, loss_type, ls=0.0, alpha=1.0, gamma=0.5):
    sums, counts = sums_counts(tok, target)
    b = sums.shape[0] // 2
    logps = sums / counts.clamp(min=1) if loss_type in ("ipo", "simpo") else sums
    h = logps[:b] - logps[b:]
    if loss_type in ("sigmoid", "simpo"):
        z = beta * h - (gamma if loss_type == "simpo" else 0.0)
        per = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
    elif loss_type == "hinge":
        per = torch.relu(1 - beta * h)
    else:
        per = (h - 1 / (2 * beta)) ** 2
    nll = ref_nll(tok_nll, nll_target, b) if alpha else torch.zeros((), dtype=torch.float64)
    return per.mean() + alpha * nll, dict(chosen_logps=logps[:b], rejected_logps=logps[b:],
                                          chosen_rewards=beta * logps[:b], rejected_rewards=beta * logps[b:],
                                          nll_loss=nll)


def ref_orpo(tok, tok_nll, target, nll_target, beta):
    sums, counts = sums_counts(tok, target)
    b = sums.shape[0] // 2
    avg = sums / counts.clamp(min=1)
    c, r = avg[:b], avg[b:]
    ok = (counts[:b] > 0) & (counts[b:] > 0)  # a pair with an empty sequence has no odds term
    c, r = torch.where(ok, c, -1.0), torch.where(ok, r, -1.0)
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
    ratio = torch.where(ok, F.logsigmoid(log_odds), 0.0)
    nll = ref_nll(tok_nll, nll_target, b)
    return nll - beta * ratio.mean(), dict(
        chosen_logps=avg[:b], rejected_logps=avg[b:], chosen_rewards=beta * avg[:b], rejected_rewards=beta * avg[b:],
        nll_loss=nll, log_odds_ratio=ratio.mean(), log_odds_chosen=torch.where(ok, log_odds, 0.0).mean())


def ref_kto(tok, target, ref_sums, desirable, kl, beta, loss_type, w_d=1.0, w_u=1.0):
    sums, _ = sums_counts(tok, target)
    lr = sums - ref_sums
    kl = max(kl, 0.0)
    if loss_type == "kto":
        good, bad = 1 - torch.sigmoid(beta * (lr - kl)), 1 - torch.sigmoid(beta * (kl - lr))
    else:
        good, bad = 1 - torch.sigmoid(beta * lr), torch.sigmoid(beta * lr)
    return torch.where(desirable, w_d * good, w_u * bad).mean(), dict(logps=sums, rewards=beta * lr)


# ------------------------------------------------------------------------------------ comparisons


def assert_grad_close(actual, expected, dtype, name, scale=1.0):
    """Gradients relative to their largest entry (their size depends on beta and the batch)."""
    assert actual is not None, f"no gradient for {name}"
    assert actual.dtype == dtype, name
    assert torch.isfinite(actual).all(), name
    largest = expected.abs().max().clamp(min=1e-30)
    assert_close(actual / largest, expected / largest, dtype, scale=scale, msg=f"grad of {name} differs")


def check_against_reference(out, fused_leaves, ref_loss, ref_stats, ref_leaves, dtype, scale=1.0):
    """Loss, per-pair statistics and the gradients of hidden / weight / bias agree with the float64 reference."""
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert_close(out.loss, ref_loss, dtype, scale, msg="loss differs")
    for key, want in ref_stats.items():
        got = getattr(out, key) if hasattr(out, key) else out.extra[key]
        assert_close(got, want.detach(), dtype, scale, msg=f"{key} differs", magnitude=max(1.0, float(want.detach().abs().max())))
    out.loss.backward()
    ref_loss.backward()
    for name, got, ref in zip(("hidden", "weight", "bias"), fused_leaves, ref_leaves):
        if ref is not None:
            assert_grad_close(got.grad, ref.grad, dtype, name, scale)


DTYPES = [torch.float32, torch.bfloat16]
BF16_SCALE = {torch.float32: 1.0, torch.bfloat16: 2.0}


# ------------------------------------------------------------------------------------ the shared op


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_match_log_softmax_gather(dtype):
    batch = make_sequences(3, dtype, bias=True)
    h, w, b = leaves(batch)
    temperature = 0.7
    got = fused_linear_token_logprobs(h, w, batch.target, b, temperature=temperature, chunk_size=13)
    rh, rw, rb = leaves(batch, torch.float64)
    want = ref_token_logps(ref_logits(rh, rw, rb) / temperature, batch.target)
    assert got.shape == batch.target.shape and got.dtype == torch.float32
    assert_close(got, want, dtype, BF16_SCALE[dtype], magnitude=8.0)
    assert (got[batch.target == IGNORE] == 0).all()
    upstream = torch.randn(got.shape, dtype=torch.float64)
    got.backward(upstream.float())
    want.backward(upstream)
    for name, g, r in zip(("hidden", "weight", "bias"), (h, w, b), (rh, rw, rb)):
        assert_grad_close(g.grad, r.grad, dtype, name, BF16_SCALE[dtype])
    assert h.grad[1].abs().max() == 0  # a fully ignored sequence gets no gradient


# ------------------------------------------------------------------------------------ DPO


@pytest.mark.parametrize(
    "loss_type, ls, dtype, bias, ref_as",
    [
        ("sigmoid", 0.0, torch.float32, True, "head"),
        ("sigmoid", 0.0, torch.bfloat16, False, "head"),
        ("sigmoid", 0.2, torch.float32, False, "logps"),  # cDPO
        ("ipo", 0.0, torch.float32, False, "logps"),
        ("ipo", 0.0, torch.bfloat16, True, "logps"),
        ("robust", 0.1, torch.float32, False, "head"),
        ("hinge", 0.0, torch.float32, False, "logps"),
    ],
)
def test_dpo_matches_reference(loss_type, ls, dtype, bias, ref_as):
    n_pairs, beta = 3, 0.5
    batch = make_sequences(2 * n_pairs, dtype, bias=bias, ref_hidden_size=16)
    ref_tok = ref_token_logps(ref_logits(batch.ref_hidden, batch.ref_weight, None), batch.target)
    ref_sums = ref_tok.sum(-1)
    if ref_as == "head":
        ref_kwargs = dict(ref_hidden=batch.ref_hidden.clone().requires_grad_(), ref_weight=batch.ref_weight)
    else:
        ref_kwargs = dict(ref_logps=ref_sums.float())
    h, w, b = leaves(batch)
    out = fused_linear_dpo_loss(h, w, batch.target, b, beta=beta, loss_type=loss_type, label_smoothing=ls,
                                chunk_size=29, **ref_kwargs)
    rh, rw, rb = leaves(batch, torch.float64)
    tok = ref_token_logps(ref_logits(rh, rw, rb), batch.target)
    ref_loss, stats = ref_dpo(tok, batch.target, ref_sums, beta, loss_type, ls)
    check_against_reference(out, (h, w, b), ref_loss, stats, (rh, rw, rb), dtype, BF16_SCALE[dtype])
    if ref_as == "head":
        assert ref_kwargs["ref_hidden"].grad is None  # the reference is frozen
    m = out.metrics()
    assert_close(m["rewards/margins"], (stats["chosen_rewards"] - stats["rejected_rewards"]).mean(), dtype,
                 BF16_SCALE[dtype])
    want_acc = (stats["chosen_rewards"] > stats["rejected_rewards"]).double().mean()
    assert float(m["rewards/accuracies"]) == pytest.approx(float(want_acc))


def test_dpo_module_and_gradient_accumulation():
    """Mean over pairs: two half batches, averaged, equal the full batch (loss and gradients)."""
    n_pairs, beta = 4, 0.3
    batch = make_sequences(2 * n_pairs, torch.float32, ref_hidden_size=16, empty_rows=(2,))
    ref_sums = ref_token_logps(ref_logits(batch.ref_hidden, batch.ref_weight, None), batch.target).sum(-1).float()
    module = FusedLinearDPOLoss(beta=beta, chunk_size=24)
    h, w, _ = leaves(batch)
    full = module(h, w, batch.target, ref_logps=ref_sums)
    full.loss.backward()
    h2, w2, _ = leaves(batch)
    total = 0.0
    for half in (slice(0, 2), slice(2, 4)):
        rows = torch.cat([torch.arange(n_pairs)[half], n_pairs + torch.arange(n_pairs)[half]])
        part = module(h2[rows], w2, batch.target[rows], ref_logps=ref_sums[rows])
        (part.loss / 2).backward()
        total += part.loss.detach() / 2
    assert_close(total, full.loss, torch.float32)
    assert_close(h2.grad, h.grad, torch.float32)
    assert_close(w2.grad, w.grad, torch.float32)


# ------------------------------------------------------------------------------------ CPO / SimPO / ORPO


@pytest.mark.parametrize(
    "loss_type, ls, alpha, dtype, with_nll_target",
    [
        ("sigmoid", 0.1, 1.0, torch.float32, False),
        ("sigmoid", 0.0, 1.0, torch.bfloat16, True),
        ("hinge", 0.0, 0.5, torch.float32, False),
        ("ipo", 0.0, 1.0, torch.float32, True),
        ("simpo", 0.0, 0.0, torch.float32, False),
        ("simpo", 0.1, 0.0, torch.bfloat16, False),
    ],
)
def test_cpo_and_simpo_match_reference(loss_type, ls, alpha, dtype, with_nll_target):
    n_pairs, beta, gamma = 3, 0.7, 0.4
    batch = make_sequences(2 * n_pairs, dtype, bias=dtype == torch.float32)
    nll_target = batch.nll_target if with_nll_target else None
    h, w, b = leaves(batch)
    if loss_type == "simpo":
        out = fused_linear_simpo_loss(h, w, batch.target, b, beta=beta, gamma=gamma, label_smoothing=ls, chunk_size=32)
    else:
        out = fused_linear_cpo_loss(h, w, batch.target, b, beta=beta, loss_type=loss_type, label_smoothing=ls,
                                    cpo_alpha=alpha, nll_target=nll_target, chunk_size=32)
    rh, rw, rb = leaves(batch, torch.float64)
    logits = ref_logits(rh, rw, rb)
    nll_t = batch.target if nll_target is None else nll_target
    ref_loss, stats = ref_cpo(ref_token_logps(logits, batch.target), ref_token_logps(logits, nll_t), batch.target,
                              nll_t, beta, loss_type, ls, alpha, gamma)
    check_against_reference(out, (h, w, b), ref_loss, stats, (rh, rw, rb), dtype, BF16_SCALE[dtype])


@pytest.mark.parametrize("dtype, with_nll_target, empty_rows", [
    (torch.float32, True, (1,)),  # pair 1's chosen sequence is empty: no odds term for it
    (torch.bfloat16, False, (4,)),  # pair 1's rejected sequence is empty
    (torch.float32, False, ()),
])
def test_orpo_matches_reference(dtype, with_nll_target, empty_rows):
    n_pairs, beta = 3, 0.25
    batch = make_sequences(2 * n_pairs, dtype, bias=True, empty_rows=empty_rows)
    nll_target = batch.nll_target if with_nll_target else None
    h, w, b = leaves(batch)
    out = FusedLinearORPOLoss(beta=beta, chunk_size=32)(h, w, batch.target, b, nll_target=nll_target)
    rh, rw, rb = leaves(batch, torch.float64)
    logits = ref_logits(rh, rw, rb)
    nll_t = batch.target if nll_target is None else nll_target
    ref_loss, stats = ref_orpo(ref_token_logps(logits, batch.target), ref_token_logps(logits, nll_t), batch.target,
                               nll_t, beta)
    check_against_reference(out, (h, w, b), ref_loss, stats, (rh, rw, rb), dtype, BF16_SCALE[dtype])


# ------------------------------------------------------------------------------------ KTO


@pytest.mark.parametrize("loss_type, dtype, ref_as", [
    ("kto", torch.float32, "head"),
    ("kto", torch.bfloat16, "logps"),
    ("apo_zero_unpaired", torch.float32, "logps"),
])
def test_kto_matches_reference(loss_type, dtype, ref_as):
    n_seq, beta = 5, 0.4
    batch = make_sequences(n_seq, dtype, bias=dtype == torch.float32, ref_hidden_size=16)
    kl_batch = make_sequences(n_seq, dtype, ref_hidden_size=16, empty_rows=())  # mismatched completions
    kl_batch.weight, kl_batch.bias = batch.weight, batch.bias
    desirable = torch.tensor([True, False, True, True, False])
    ref_sums = ref_token_logps(ref_logits(batch.ref_hidden, batch.ref_weight, None), batch.target).sum(-1)
    kl_ref = ref_token_logps(ref_logits(kl_batch.ref_hidden, kl_batch.ref_weight, None), kl_batch.target).sum(-1)
    kl_pol = ref_token_logps(ref_logits(kl_batch.hidden, batch.weight, batch.bias), kl_batch.target).sum(-1)
    want_kl = (kl_pol - kl_ref).mean()
    if ref_as == "head":
        ref_kwargs = dict(ref_hidden=batch.ref_hidden, ref_weight=batch.ref_weight)
        kl = fused_linear_kto_kl(kl_batch.hidden, batch.weight, kl_batch.target, batch.bias,
                                 ref_kl_hidden=kl_batch.ref_hidden, ref_weight=kl_batch.ref_weight, chunk_size=32)
    else:
        ref_kwargs = dict(ref_logps=ref_sums.float())
        kl = fused_linear_kto_kl(kl_batch.hidden, batch.weight, kl_batch.target, batch.bias,
                                 ref_kl_logps=kl_ref.float(), chunk_size=32)
    assert not kl.requires_grad
    assert_close(kl, want_kl, dtype, BF16_SCALE[dtype], magnitude=float(kl_pol.abs().max()))
    kl_used = 1.5 if loss_type == "kto" else None  # a positive KL exercises the clamp-free branch
    h, w, b = leaves(batch)
    out = FusedLinearKTOLoss(beta=beta, desirable_weight=1.3, undesirable_weight=0.8, loss_type=loss_type,
                             chunk_size=32)(h, w, batch.target, desirable, b, kl=kl_used, **ref_kwargs)
    rh, rw, rb = leaves(batch, torch.float64)
    ref_loss, stats = ref_kto(ref_token_logps(ref_logits(rh, rw, rb), batch.target), batch.target, ref_sums,
                              desirable, kl_used or 0.0, beta, loss_type, 1.3, 0.8)
    check_against_reference(out, (h, w, b), ref_loss, stats, (rh, rw, rb), dtype, BF16_SCALE[dtype])
    m = out.metrics()
    assert_close(m["rewards/chosen"], stats["rewards"][desirable].mean(), dtype, BF16_SCALE[dtype])


def test_kto_kl_is_clamped_at_zero():
    batch = make_sequences(2, torch.float32, ref_hidden_size=16)
    ref_sums = torch.randn(2) - 20
    kw = dict(ref_logps=ref_sums, chunk_size=32)
    d = torch.tensor([True, False])
    neg = fused_linear_kto_loss(batch.hidden, batch.weight, batch.target, d, kl=torch.tensor(-3.0), **kw)
    zero = fused_linear_kto_loss(batch.hidden, batch.weight, batch.target, d, kl=0.0, **kw)
    assert neg.kl == 0 and torch.equal(neg.loss, zero.loss)


def test_no_grad_forward_builds_no_graph():
    batch = make_sequences(4, torch.float32, ref_hidden_size=16)
    h, w, _ = leaves(batch)
    with torch.no_grad():
        out = fused_linear_dpo_loss(h, w, batch.target, ref_logps=torch.zeros(4), chunk_size=64)
    assert not out.loss.requires_grad and torch.isfinite(out.loss)


# ------------------------------------------------------------------------------------ bad input


def _pair_inputs():
    hidden = torch.randn(4, 5, 8)
    return dict(hidden=hidden, weight=torch.randn(33, 8), target=torch.randint(0, 33, (4, 5)))


def _bad_cases():
    base = _pair_inputs()
    odd = dict(base, hidden=base["hidden"][:3], target=base["target"][:3])
    return [
        ("dpo", dict(odd, ref_logps=torch.zeros(3)), "batch must be even"),
        ("dpo", dict(base), "needs a reference model"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), ref_hidden=base["hidden"], ref_weight=base["weight"]), "not both"),
        ("dpo", dict(base, ref_logps=torch.zeros(3)), r"ref_logps must have shape \(4,\)"),
        ("dpo", dict(base, ref_hidden=base["hidden"][:, :4], ref_weight=base["weight"]), "same sequences"),
        ("dpo", dict(base, ref_hidden=base["hidden"]), "go together"),
        ("dpo", dict(base, ref_hidden=torch.randn(4, 5, 6), ref_weight=torch.randn(34, 6)), "vocabulary"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), beta=0.0), "beta must be a finite number > 0"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), beta=-1.0), "beta"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), loss_type="sigmoid_norm"), "unknown loss_type"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), loss_type="robust", label_smoothing=0.5), r"\[0, 0.5\)"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), loss_type="ipo", label_smoothing=0.1), "label_smoothing"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), weight=torch.randn(33, 8, dtype=torch.bfloat16)), "dtype"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), target=base["target"][:, :4]), "target must have shape"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), weight=torch.randn(33, 7)), "features"),
        ("dpo", dict(base, ref_logps=torch.zeros(4), hidden=base["hidden"][0]), "3 dimensions"),
        ("dpo", dict(base, ref_logps=torch.zeros(4, device="meta")), "ref_logps is on meta"),
        ("cpo", dict(odd), "batch must be even"),
        ("cpo", dict(base, loss_type="kto"), "unknown loss_type"),
        ("cpo", dict(base, nll_target=base["target"][:2]), "nll_target must have"),
        ("cpo", dict(base, nll_target=(base["target"] + 1) % 33), "disagree"),
        ("orpo", dict(base, beta=float("nan")), "beta"),
        ("simpo", dict(base, gamma=-0.5), "simpo_gamma"),
        ("kto", dict(base, desirable=torch.ones(3, dtype=torch.bool), ref_logps=torch.zeros(4), kl=0.0),
         "desirable must be a bool tensor"),
        ("kto", dict(base, desirable=torch.ones(4), ref_logps=torch.zeros(4), kl=0.0), "desirable must be a bool"),
        ("kto", dict(base, desirable=torch.ones(4, dtype=torch.bool), ref_logps=torch.zeros(4)), "needs the KL"),
        ("kto", dict(base, desirable=torch.ones(4, dtype=torch.bool), kl=0.0), "needs a reference"),
        ("kto", dict(base, desirable=torch.ones(4, dtype=torch.bool), ref_logps=torch.zeros(4), kl=torch.zeros(2)),
         "kl must be"),
    ]


_FNS = dict(dpo=fused_linear_dpo_loss, cpo=fused_linear_cpo_loss, orpo=fused_linear_orpo_loss,
            simpo=fused_linear_simpo_loss, kto=fused_linear_kto_loss)


@pytest.mark.parametrize("loss, kwargs, match", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_raises_value_error_before_any_kernel(loss, kwargs, match, monkeypatch, device):
    import fuseforge.ops.preference as pref

    def no_kernels(*a, **k):
        raise AssertionError("a kernel ran before the input was rejected")

    monkeypatch.setattr(pref, "fused_linear_token_logprobs", no_kernels)
    monkeypatch.setattr(pref, "reference_token_logprobs", no_kernels)
    # Built at collection time on the CPU: move to the test device (meta stays meta).
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
              for k, v in kwargs.items()}
    args = [kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("target")]
    if loss == "kto":
        args.append(kwargs.pop("desirable", torch.ones(4, dtype=torch.bool)))
    with pytest.raises(ValueError, match=match):
        _FNS[loss](*args, **kwargs)


def test_module_options_are_checked_at_construction():
    with pytest.raises(ValueError, match="beta"):
        FusedLinearDPOLoss(beta=0)
    with pytest.raises(ValueError, match="unknown loss_type"):
        FusedLinearKTOLoss(loss_type="bco")
    with pytest.raises(ValueError, match="chunk_size"):
        FusedLinearORPOLoss(chunk_size=0)


# ------------------------------------------------------------------------------------ the references vs TRL 1.16


class FakeAccelerator:
    """What TRL's loss code asks of accelerate on one process."""

    num_processes = 1

    def __init__(self, device):
        self.device = torch.device(device)

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_batch(tok, target):
    """TRL's padded layout: sequences of T + 1 tokens whose positions 1.. are predicted; log_probs [n, T]."""
    n, t = target.shape
    completion_mask = torch.cat([torch.zeros(n, 1, dtype=torch.long), (target != IGNORE).long()], 1)
    inputs = dict(input_ids=torch.cat([torch.zeros(n, 1, dtype=torch.long), target.clamp(min=0)], 1),
                  attention_mask=torch.ones(n, t + 1, dtype=torch.long), completion_mask=completion_mask)
    outputs = SimpleNamespace(log_probs=tok, entropy=torch.zeros(n, t, dtype=tok.dtype),
                              mean_logits=torch.zeros(n, t, dtype=tok.dtype), is_top1=torch.zeros(n, t, dtype=torch.bool))
    return inputs, (lambda **kwargs: outputs)


def _fake_trainer(device, **attrs):
    return SimpleNamespace(model=SimpleNamespace(training=True), accelerator=FakeAccelerator(device),
                           aux_loss_enabled=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
                           _tp_size=1, **attrs)


def _random_logits(n, t, v, device):
    return (torch.randn(n, t, v, dtype=torch.float64, device=device) * 2).requires_grad_()


def _trl_sequences(n, device, empty_rows=(1,)):
    batch = make_sequences(n, torch.float32, empty_rows=empty_rows, seq_len=9)
    return batch.target, batch.nll_target


def _compare_with_trl(ours, theirs, grad_of, metrics_ours, metrics_trl, dtype=torch.float64):
    assert_close(ours, theirs, dtype)
    g_ours, = torch.autograd.grad(ours, grad_of, retain_graph=True)
    g_trl, = torch.autograd.grad(theirs, grad_of, retain_graph=True)
    assert_close(g_ours, g_trl, dtype)
    for key, value in metrics_ours.items():
        assert_close(torch.tensor(float(value.detach() if torch.is_tensor(value) else value)), torch.tensor(float(metrics_trl[key][-1])), dtype, msg=key,
                     magnitude=max(1.0, abs(float(value.detach() if torch.is_tensor(value) else value))))


@pytest.mark.parametrize("loss_type, ls", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.2)])
def test_dpo_reference_is_trls_dpo_trainer(loss_type, ls, device):
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    target, _ = _trl_sequences(6, device)
    logits = _random_logits(6, target.shape[1], V, device)
    tok = ref_token_logps(logits, target)
    ref_sums = torch.randn(6, dtype=torch.float64) - 30
    ours, stats = ref_dpo(tok, target, ref_sums, 0.3, loss_type, ls)
    inputs, model = _trl_batch(tok, target)
    inputs.update(ref_chosen_logps=ref_sums[:3], ref_rejected_logps=ref_sums[3:])
    fake = _fake_trainer(device, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                         loss_types=[loss_type], loss_weights=[1.0], beta=0.3, label_smoothing=ls, use_weighting=False)
    theirs = trl_dpo.DPOTrainer._compute_loss(fake, model, inputs, return_outputs=False)
    metrics = {"rewards/chosen": stats["chosen_rewards"].mean(), "rewards/rejected": stats["rejected_rewards"].mean(),
               "logps/chosen": stats["chosen_logps"].mean(), "logps/rejected": stats["rejected_logps"].mean(),
               "rewards/margins": (stats["chosen_rewards"] - stats["rejected_rewards"]).mean()}
    _compare_with_trl(ours, theirs, logits, metrics, fake._metrics["train"])


def _cpo_like_trainer(module, cls, device, logits, target, nll_target, **attrs):
    """A stand-in CPO/ORPO trainer whose model returns `logits` for TRL's padded, shifted batch."""
    n, t = target.shape
    b = n // 2
    input_ids = torch.cat([torch.zeros(n, 1, dtype=torch.long), nll_target.clamp(min=0)], 1)
    attention = torch.cat([torch.ones(n, 1, dtype=torch.long), (nll_target != IGNORE).long()], 1)
    labels = torch.cat([torch.full((n, 1), IGNORE), target], 1)
    batch = {}
    for side, rows in (("chosen", slice(0, b)), ("rejected", slice(b, n))):
        batch.update({f"{side}_input_ids": input_ids[rows], f"{side}_attention_mask": attention[rows],
                      f"{side}_labels": labels[rows]})
    full_logits = torch.cat([logits, torch.zeros(n, 1, logits.shape[-1], dtype=logits.dtype)], 1)
    model = lambda *args, **kwargs: SimpleNamespace(logits=full_logits)  # noqa: E731
    fake = SimpleNamespace(accelerator=FakeAccelerator(device), is_encoder_decoder=False, pad_token_id=0, padding_value=0,
                           aux_loss_enabled=False, concatenated_inputs=cls.concatenated_inputs,
                           get_batch_logps=cls.get_batch_logps, **attrs)
    for name in ("concatenated_forward", "cpo_loss", "odds_ratio_loss"):
        if hasattr(cls, name):
            setattr(fake, name, types.MethodType(getattr(cls, name), fake))
    return cls.get_batch_loss_metrics(fake, model, batch)


@pytest.mark.parametrize("loss_type, ls, alpha", [
    ("sigmoid", 0.15, 1.0), ("hinge", 0.0, 0.5), ("ipo", 0.0, 1.0), ("simpo", 0.1, 0.0), ("simpo", 0.0, 1.0),
])
def test_cpo_and_simpo_references_are_trls_cpo_trainer(loss_type, ls, alpha, device):
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    target, _ = _trl_sequences(6, device, empty_rows=())  # TRL averages 0 / 0 for an empty sequence
    logits = _random_logits(6, target.shape[1], V, device)
    tok = ref_token_logps(logits, target)
    ours, stats = ref_cpo(tok, tok, target, target, 0.6, loss_type, ls, alpha, 0.4)
    theirs, metrics = _cpo_like_trainer(cpo, cpo.CPOTrainer, device, logits, target, target, beta=0.6,
                                        loss_type=loss_type, label_smoothing=ls, cpo_alpha=alpha, simpo_gamma=0.4,
                                        alpha=0.0)
    metrics = {k: [v] for k, v in metrics.items()}
    ours_metrics = {"rewards/chosen": stats["chosen_rewards"].mean(), "logps/rejected": stats["rejected_logps"].mean(),
                    "nll_loss": stats["nll_loss"]}
    _compare_with_trl(ours, theirs, logits, ours_metrics, metrics)


def test_orpo_reference_is_trls_orpo_trainer(device):
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    target, nll_target = _trl_sequences(6, device, empty_rows=())
    logits = _random_logits(6, target.shape[1], V, device)
    ours, stats = ref_orpo(ref_token_logps(logits, target), ref_token_logps(logits, nll_target), target,
                           nll_target, 0.2)
    theirs, metrics = _cpo_like_trainer(orpo, orpo.ORPOTrainer, device, logits, target, nll_target, beta=0.2)
    metrics = {k: [v] for k, v in metrics.items()}
    ours_metrics = {"nll_loss": stats["nll_loss"], "log_odds_ratio": stats["log_odds_ratio"],
                    "log_odds_chosen": stats["log_odds_chosen"], "rewards/chosen": stats["chosen_rewards"].mean()}
    # TRL computes the odds ratio in fp32 (.float()), hence the fp32 tolerance.
    _compare_with_trl(ours, theirs, logits, ours_metrics, metrics, dtype=torch.float32)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_reference_is_trls_kto_trainer(loss_type, device):
    kto = pytest.importorskip("trl.trainer.kto_trainer")
    target, _ = _trl_sequences(6, device)
    logits = _random_logits(6, target.shape[1], V, device)
    tok = ref_token_logps(logits, target)
    ref_sums = torch.randn(6, dtype=torch.float64) - 30
    desirable = torch.tensor([True, False, False, True, True, False])
    kl_logps, ref_kl_logps = torch.randn(6, dtype=torch.float64) - 25, torch.randn(6, dtype=torch.float64) - 25
    kl = float((kl_logps - ref_kl_logps).mean()) if loss_type == "kto" else 0.0
    ours, stats = ref_kto(tok, target, ref_sums, desirable, kl, 0.3, loss_type, 1.2, 0.9)
    inputs, model = _trl_batch(tok, target)
    inputs.update(label=desirable, ref_logps=ref_sums, ref_KL_logps=ref_kl_logps)
    fake = _fake_trainer(device, precompute_ref_logps=True, calculate_KL=loss_type == "kto", loss_type=loss_type,
                         beta=0.3, desirable_weight=1.2, undesirable_weight=0.9)
    fake._compute_kl_logps = lambda model, batch: kl_logps if loss_type == "kto" else None
    theirs = kto.KTOTrainer._compute_loss(fake, model, inputs, return_outputs=False)
    metrics = {"rewards/chosen": stats["rewards"][desirable].mean(), "logps/rejected": stats["logps"][~desirable].mean()}
    if loss_type == "kto":
        metrics["kl"] = max(kl, 0.0)
    _compare_with_trl(ours, theirs, logits, metrics, fake._metrics["train"])


# ------------------------------------------------------------------------------------ chunking paths

# Each loss on one batch; `cs` is chunk_size. Pairs span 2T = 22 tokens, KTO sequences T = 11: 8 caps the
# logits below one group (token log-probs, backward recomputes), 11 makes KTO's first block live in
# grad_weight's storage, 64 and None run several groups per chunk.
CHUNKED_LOSSES = {
    "dpo": lambda h, w, b, x, cs: fused_linear_dpo_loss(h, w, x.target, b, ref_logps=x.ref_sums, beta=0.5,
                                                        loss_type="ipo", chunk_size=cs),
    "cpo": lambda h, w, b, x, cs: fused_linear_cpo_loss(h, w, x.target, b, beta=0.7, cpo_alpha=1.0,
                                                        nll_target=x.nll_target, chunk_size=cs),
    "orpo": lambda h, w, b, x, cs: fused_linear_orpo_loss(h, w, x.target, b, beta=0.3, nll_target=x.nll_target,
                                                          chunk_size=cs),
    "kto": lambda h, w, b, x, cs: fused_linear_kto_loss(h, w, x.target, x.desirable, b, ref_logps=x.ref_sums[:5],
                                                        kl=0.7, beta=0.4, chunk_size=cs),
}


@pytest.mark.parametrize("chunk_size", [None, 11, 64])
@pytest.mark.parametrize("name", CHUNKED_LOSSES)
def test_one_sweep_path_equals_the_recompute_path(name, chunk_size):
    """Whole groups per chunk (gradients in the forward sweep) and chunks below a group (backward recomputes
    the logits) are two ways to compute one loss: same value, gradients and statistics."""
    batch = make_sequences(6, torch.float32, bias=True, empty_rows=(1, 4))
    if name == "kto":
        batch = make_sequences(5, torch.float32, bias=True)
    batch.ref_sums = torch.randn(6) - 15.0
    batch.desirable = torch.tensor([True, False, True, True, False])
    results = []
    for cs in (8, chunk_size):
        h, w, b = leaves(batch)
        out = CHUNKED_LOSSES[name](h, w, b, batch, cs)
        out.loss.backward()
        stats = [v for v in vars(out).values() if isinstance(v, torch.Tensor)]
        results.append((out.loss, h.grad, w.grad, b.grad, *stats))
    for got, want in zip(results[1], results[0]):
        assert_close(got, want, torch.float32)
