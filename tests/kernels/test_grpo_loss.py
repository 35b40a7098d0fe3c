"""GRPO-family policy loss from hidden states vs float64 references, and those references vs TRL 1.16.

* the one-pass op (gradients computed in forward for a sum of per-token terms) against autograd
  through float64 logits, including the first-block layout and an upstream gradient != 1;
* fused_linear_grpo_loss (loss, TRL metrics, gradients of hidden / weight / bias) for every loss
  type, token and sequence importance sampling, delta, KL with and without bias correction,
  per-token advantages, temperature, fp32 and bf16, ragged shapes and a fully ignored sequence;
* gradient accumulation where the normalisation allows it (grpo, dr_grpo, dapo with a global
  token count; bnpo normalises by each micro-batch's own token count, so it does not split);
* the float64 reference against TRL 1.16's GRPOTrainer._compute_loss itself (stand-in trainer,
  no kernels; skipped without trl).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fuseforge.functional import fused_linear_grpo_loss, fused_linear_token_objective
from fuseforge.modules import FusedLinearGRPOLoss
from tolerances import assert_close

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

IGNORE = -100
# B * T = 44 tokens: with H = 32 and chunk 16 the first 32 go through grad_weight's storage, then 12.
B, T, H, V = 4, 11, 32, 157
CHUNK = 16


@pytest.fixture(autouse=True)
def _tensors_on_test_device(device):
    with torch.device(device):
        yield


# ------------------------------------------------------------------------------------ inputs and references


def make_rollouts(dtype, *, bias=False, ref_hidden_size=None, n_seq=B):
    """Completions of ragged length (padding ignored; sequence 1 entirely), an LM head, a reference head."""
    hidden = torch.randn(n_seq, T, H).to(dtype)
    weight = (torch.randn(V, H) * 2.0 / H**0.5).to(dtype)
    b = (torch.randn(V) * 0.5).to(dtype) if bias else None
    length = torch.randint(3, T + 1, (n_seq, 1))
    target = torch.where(torch.arange(T) < length, torch.randint(0, V, (n_seq, T)), IGNORE)
    target[1] = IGNORE
    out = SimpleNamespace(hidden=hidden, weight=weight, bias=b, target=target)
    if ref_hidden_size:
        out.ref_hidden = torch.randn(n_seq, T, ref_hidden_size).to(dtype)
        out.ref_weight = (torch.randn(V, ref_hidden_size) * 2.0 / ref_hidden_size**0.5).to(dtype)
    return out


def leaves(batch, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_()
            for t in (batch.hidden, batch.weight, batch.bias)]


def ref_token_logps(hidden, weight, bias, target, temperature=1.0):
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double()) / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(target != IGNORE, logp, torch.zeros_like(logp))


def ref_grpo(tok, target, adv, old, ref, *, loss_type="dapo", beta=0.0, eps_low=0.2, eps_high=0.2, delta=None,
             level="token", bias_correction=True, max_len=None, num_items=None):
    """TRL 1.16's GRPO loss and metrics, in float64, from per-token log-probs."""
    mask = (target != IGNORE).double()
    old = tok.detach() if old is None else old
    a = adv[:, None] if adv.dim() == 1 else adv
    log_w = tok - old
    if level == "sequence":
        log_w = (log_w * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_w)
    kl = None
    if beta:
        kl = torch.exp(ref - tok) - (ref - tok) - 1
        if bias_correction:
            kl = kl * ratio
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    per_token = -torch.min(ratio * a, clipped * a)
    if beta:
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * (max_len or tok.shape[1]))
    else:
        loss = (per_token * mask).sum() / (num_items if num_items is not None else mask.sum().clamp(min=1))

    def masked_mean(x):
        x = x.double()
        return x.sum() / x.shape[0] if x.shape[1] == 1 else (x * mask).sum() / mask.sum().clamp(min=1)

    low = (ratio < 1 - eps_low) & (a < 0)
    high = (ratio > 1 + eps_high) & (a > 0)
    metrics = {"clip_ratio/low_mean": masked_mean(low), "clip_ratio/high_mean": masked_mean(high),
               "clip_ratio/region_mean": masked_mean(low | high)}
    if beta:
        metrics["kl"] = masked_mean(kl.detach())
    return loss, metrics


def log_ratios_off_the_clip_edges(shape):
    """log(pi / pi_old) on both sides of the clip range [log 0.8, log 1.2] (or 1.28) and of delta = 1.5,
    but never within 0.05 of those edges: there a bf16 rounding of the log-prob would decide whether
    a token is clipped, i.e. whether its gradient is 0."""
    bands = torch.tensor([[-0.6, -0.3], [-0.15, 0.12], [0.3, 0.35], [0.46, 0.6]])
    pick = bands[torch.randint(0, len(bands), shape)]
    return pick[..., 0] + (pick[..., 1] - pick[..., 0]) * torch.rand(shape)


def assert_grad_close(actual, expected, dtype, name, scale=1.0):
    assert actual is not None and actual.dtype == dtype, name
    assert torch.isfinite(actual).all(), name
    largest = expected.abs().max().clamp(min=1e-30)
    assert_close(actual / largest, expected / largest, dtype, scale=scale, msg=f"grad of {name} differs")


DTYPE_SCALE = {torch.float32: 1.0, torch.bfloat16: 2.0}


# ------------------------------------------------------------------------------------ the one-pass op


@pytest.mark.parametrize("n_seq, chunk, bias", [(4, CHUNK, True), (2, 8, False)])  # first block + chunks; block only
def test_token_objective_gradients_computed_in_forward(n_seq, chunk, bias):
    batch = make_rollouts(torch.float32, bias=bias, n_seq=n_seq)
    coef = torch.randn(batch.target.shape)
    flat_coef = coef.reshape(-1)

    def token_loss(lp, rows):  # any elementwise function of each token's own log-prob
        return flat_coef[rows] * lp + 0.1 * lp**2

    h, w, b = leaves(batch)
    total, logps = fused_linear_token_objective(h, w, batch.target, token_loss, b, chunk_size=chunk)
    (0.5 * total).backward()  # an upstream gradient != 1 scales the gradients saved in forward
    rh, rw, rb = leaves(batch, torch.float64)
    tok = ref_token_logps(rh, rw, rb, batch.target)
    mask = batch.target != IGNORE
    want = torch.where(mask, coef * tok + 0.1 * tok**2, 0.0).sum()
    (0.5 * want).backward()
    assert_close(total, want, torch.float32, magnitude=float(want.detach().abs()) + 1)
    assert_close(logps, tok.detach(), torch.float32, magnitude=8.0)
    assert not logps.requires_grad
    for name, g, r in zip(("hidden", "weight", "bias"), (h, w, b), (rh, rw, rb)):
        if r is not None:
            assert_grad_close(g.grad, r.grad, torch.float32, name)


# ------------------------------------------------------------------------------------ the GRPO loss


CASES = [
    # loss_type, dtype, beta, ref given as, old given, level, options
    ("grpo", torch.float32, 0.04, "head", True, "token", dict(bias=True)),
    ("dapo", torch.bfloat16, 0.0, None, True, "token", dict()),
    ("bnpo", torch.float32, 0.1, "logps", False, "token", dict(per_token_adv=True)),
    ("dr_grpo", torch.float32, 0.04, "head", True, "token",
     dict(max_len=16, delta=1.5, bias_correction=False, eps_high=0.28)),
    ("dapo", torch.float32, 0.04, "head", True, "sequence", dict(bias=True)),
    ("grpo", torch.bfloat16, 0.04, "logps", True, "token", dict(temperature=0.8)),
    ("dapo", torch.float32, 0.04, "logps", True, "token", dict(num_items=60, module=True)),
]


@pytest.mark.parametrize("loss_type, dtype, beta, ref_as, old_given, level, opts", CASES)
def test_grpo_matches_reference(loss_type, dtype, beta, ref_as, old_given, level, opts):
    temperature = opts.get("temperature", 1.0)
    batch = make_rollouts(dtype, bias=opts.get("bias", False), ref_hidden_size=16)
    mask = batch.target != IGNORE
    rh, rw, rb = leaves(batch, torch.float64)
    tok = ref_token_logps(rh, rw, rb, batch.target, temperature)
    adv = torch.randn(B, T) if opts.get("per_token_adv") else torch.randn(B)
    # Behaviour log-probs near the current ones, so that ratios fall on both sides of the clip range;
    # padding holds garbage that would overflow exp() if it were used.
    log_ratio = log_ratios_off_the_clip_edges((B, T))
    if opts.get("delta"):  # some tokens with ratio > delta and a negative advantage: there delta bites
        log_ratio[:, 0] = 0.55
        adv = adv.abs() * torch.tensor([-1.0, 1.0, -1.0, 1.0])
    old = (tok.detach() - log_ratio).masked_fill(~mask, -1e4) if old_given else None
    ref_tok = ref_token_logps(batch.ref_hidden, batch.ref_weight, None, batch.target, temperature)
    ref_kwargs = {}
    if ref_as == "head":
        ref_kwargs = dict(ref_hidden=batch.ref_hidden, ref_weight=batch.ref_weight)
    elif ref_as == "logps":
        ref_kwargs = dict(ref_logps=ref_tok.masked_fill(~mask, 1e4).float())
    kwargs = dict(loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=opts.get("eps_high"),
                  delta=opts.get("delta"), importance_sampling_level=level,
                  use_bias_correction_kl=opts.get("bias_correction", True), max_completion_length=opts.get("max_len"),
                  temperature=temperature)
    h, w, b = leaves(batch)
    old_in = None if old is None else old.float()
    if opts.get("module"):
        out = FusedLinearGRPOLoss(**kwargs, chunk_size=CHUNK)(h, w, batch.target, adv, b, old_logps=old_in,
                                                              num_items_in_batch=opts.get("num_items"), **ref_kwargs)
    else:
        out = fused_linear_grpo_loss(h, w, batch.target, adv, b, old_logps=old_in, chunk_size=CHUNK,
                                     num_items_in_batch=opts.get("num_items"), **kwargs, **ref_kwargs)
    want, metrics = ref_grpo(
        tok, batch.target, adv.double(), None if old is None else old.masked_fill(~mask, 0.0).double(), ref_tok,
        loss_type=loss_type,
        beta=beta, eps_low=0.2, eps_high=opts.get("eps_high") or 0.2, delta=opts.get("delta"), level=level,
        bias_correction=opts.get("bias_correction", True), max_len=opts.get("max_len"), num_items=opts.get("num_items"),
    )
    scale = DTYPE_SCALE[dtype]
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert_close(out.loss, want, dtype, scale)
    assert_close(out.per_token_logps, tok.detach(), dtype, scale, magnitude=8.0)
    got = out.metrics()
    assert set(got) == set(metrics)
    if beta:
        assert_close(got["kl"], metrics["kl"], dtype, scale)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert_close(got[key], metrics[key], torch.float32, msg=key)  # no ratio sits at a clip edge
    if old_given and level == "token":
        assert float(got["clip_ratio/region_mean"]) > 0  # the case exercises clipping
    out.loss.backward()
    want.backward()
    # The k3 KL's gradient carries exp(ref - logp): where a random reference sits far above the policy
    # (e^6 here and there), it multiplies the log-probs' own fp32 rounding; the tolerance follows it.
    kl_amplification = max(1.0, beta * float(torch.exp(ref_tok - tok.detach())[mask].max())) if beta else 1.0
    for name, g, r in zip(("hidden", "weight", "bias"), (h, w, b), (rh, rw, rb)):
        if r is not None:
            assert_grad_close(g.grad, r.grad, dtype, name, scale * kl_amplification)
    assert h.grad[1].abs().max() == 0  # the fully ignored completion


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_over_two_micro_batches(loss_type):
    """grpo / dr_grpo: the mean of the micro-batch losses is the full-batch loss; dapo: with
    num_items_in_batch = the full batch's token count, their sum is. (bnpo does not split.)"""
    batch = make_rollouts(torch.float32, ref_hidden_size=16)
    adv = torch.randn(B)
    old = ref_token_logps(batch.hidden, batch.weight, None, batch.target).float() + 0.2 * torch.randn(B, T)
    ref = torch.randn(B, T) - 5.0
    kwargs = dict(loss_type=loss_type, beta=0.04, max_completion_length=T + 3, chunk_size=CHUNK)
    n_tokens = int((batch.target != IGNORE).sum())
    if loss_type == "dapo":
        kwargs["num_items_in_batch"] = torch.tensor(n_tokens)
    h, w, _ = leaves(batch)
    full = fused_linear_grpo_loss(h, w, batch.target, adv, old_logps=old, ref_logps=ref, **kwargs)
    full.loss.backward()
    h2, w2, _ = leaves(batch)
    factor = 1.0 if loss_type == "dapo" else 0.5
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        part = fused_linear_grpo_loss(h2[rows], w2, batch.target[rows], adv[rows], old_logps=old[rows],
                                      ref_logps=ref[rows], **kwargs)
        (factor * part.loss).backward()
        total = total + factor * part.loss.detach()
    assert_close(total, full.loss, torch.float32)
    assert_close(h2.grad, h.grad, torch.float32)
    assert_close(w2.grad, w.grad, torch.float32)


def test_no_grad_and_frozen_head():
    batch = make_rollouts(torch.float32)
    h, w, _ = leaves(batch)
    with torch.no_grad():
        out = fused_linear_grpo_loss(h, w, batch.target, torch.randn(B), chunk_size=CHUNK)
    assert not out.loss.requires_grad
    w_frozen = batch.weight.clone()  # only the hidden states train
    out = fused_linear_grpo_loss(h, w_frozen, batch.target, torch.randn(B), chunk_size=CHUNK)
    out.loss.backward()
    assert h.grad is not None and w_frozen.grad is None


# ------------------------------------------------------------------------------------ bad input


def _bad_cases():
    hidden, weight = torch.randn(2, 5, 8), torch.randn(33, 8)
    target, adv = torch.randint(0, 33, (2, 5)), torch.randn(2)
    base = dict(hidden=hidden, weight=weight, target=target, advantages=adv)
    return [
        (dict(base, loss_type="cispo"), "unknown loss_type"),
        (dict(base, importance_sampling_level="batch"), "unknown importance_sampling_level"),
        (dict(base, beta=-0.1), "beta must be a finite number >= 0"),
        (dict(base, beta=0.04), "needs a reference model"),
        (dict(base, beta=0.04, ref_logps=torch.zeros(2)), r"ref_logps must have shape \(2, 5\)"),
        (dict(base, beta=0.04, ref_hidden=torch.randn(2, 4, 8), ref_weight=weight), "same sequences"),
        (dict(base, advantages=torch.randn(3)), "advantages must have shape"),
        (dict(base, old_logps=torch.zeros(2, 4)), "old_logps must have shape"),
        (dict(base, epsilon_low=1.0), "epsilon_low must be < 1"),
        (dict(base, delta=1.1), "delta must exceed"),
        (dict(base, temperature=0.0), "temperature"),
        (dict(base, loss_type="bnpo", num_items_in_batch=10), "only applies to loss_type='dapo'"),
        (dict(base, num_items_in_batch=0), "num_items_in_batch must be > 0"),
        (dict(base, max_completion_length=0), "max_completion_length must be >= 1"),
        (dict(base, weight=torch.randn(33, 8, dtype=torch.bfloat16)), "dtype"),
        (dict(base, target=target[:, :4]), "target must have shape"),
        (dict(base, hidden=hidden.reshape(10, 8), target=target.reshape(10)), "3 dimensions"),
        (dict(base, advantages=torch.randn(2, device="meta")), "advantages is on meta"),
    ]


@pytest.mark.parametrize("kwargs, match", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_raises_value_error_before_any_kernel(kwargs, match, monkeypatch, device):
    import fuseforge.ops.grpo as grpo

    def no_kernels(*a, **k):
        raise AssertionError("a kernel ran before the input was rejected")

    for name in ("fused_linear_token_objective", "fused_linear_token_logprobs", "reference_token_logprobs"):
        monkeypatch.setattr(grpo, name, no_kernels)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
              for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        fused_linear_grpo_loss(**kwargs)


# ------------------------------------------------------------------------------------ the reference vs TRL 1.16


class FakeAccelerator:
    num_processes = 1

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("variant", [
    dict(beta=0.0),
    dict(beta=0.04, level="token", per_token_adv=True),
    dict(beta=0.04, level="sequence", delta=1.6, eps_high=0.28),
    dict(beta=0.1, bias_correction=False, old=False),
])
def test_reference_is_trls_grpo_compute_loss(loss_type, variant, device):
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    target = make_rollouts(torch.float32).target
    mask = target != IGNORE
    logits = (torch.randn(B, T, V, dtype=torch.float64) * 2).requires_grad_()
    logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    tok = torch.where(mask, logp, 0.0)
    adv = torch.randn(B, T, dtype=torch.float64) if variant.get("per_token_adv") else torch.randn(B, dtype=torch.float64)
    old = (tok.detach() + 0.3 * torch.randn(B, T, dtype=torch.float64)) if variant.get("old", True) else None
    ref = tok.detach() + 0.5 * torch.randn(B, T, dtype=torch.float64)
    beta, level = variant["beta"], variant.get("level", "token")
    eps_high = variant.get("eps_high", 0.2)
    max_len = 13
    ours, ours_metrics = ref_grpo(tok, target, adv, old, ref, loss_type=loss_type, beta=beta, eps_high=eps_high,
                                  delta=variant.get("delta"), level=level,
                                  bias_correction=variant.get("bias_correction", True), max_len=max_len)

    inputs = dict(prompt_ids=torch.zeros(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                  completion_ids=target.clamp(min=0), completion_mask=mask.long(), advantages=adv,
                  ref_per_token_logps=ref, num_items_in_batch=mask.sum())
    if old is not None:
        inputs["old_per_token_logps"] = old
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (tok, torch.zeros_like(tok), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=variant.get("bias_correction", True), delta=variant.get("delta"),
                             steps_per_generation=1),
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=eps_high, use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=max_len,
        accelerator=FakeAccelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    theirs = grpo_trainer.GRPOTrainer._compute_loss(fake, None, inputs)
    assert_close(ours, theirs, torch.float64)
    g_ours, = torch.autograd.grad(ours, logits, retain_graph=True)
    g_theirs, = torch.autograd.grad(theirs, logits)
    assert_close(g_ours, g_theirs, torch.float64)
    for key, value in ours_metrics.items():  # TRL's clip indicators are averaged as float32
        assert_close(value, torch.tensor(fake._metrics["train"][key][-1], dtype=torch.float64), torch.float32, msg=key)
