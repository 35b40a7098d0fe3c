"""Patched vs unpatched Hugging Face models: same losses, gradients, parameters and logits.

For every supported family a tiny model (from a config, seeded init) is trained for a
few AdamW steps on learnable synthetic data twice, once as transformers ships it and
once patched, from identical weights: per-step losses, first-step gradients, final
parameters and eval logits must agree to fp32 tolerance. Further tests pin the loss
path's contract: gradient accumulation with num_items_in_batch, logits_to_keep,
logits on request, tuple outputs, activation checkpointing, the cross-entropy flag.
Kernels run under the Triton interpreter on CPU, so models and step counts are small.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tolerances import assert_close, tol

transformers = pytest.importorskip("transformers")

from test_transformers_tiny_models import (  # noqa: E402
    BATCHED_EXPERTS,
    DEVICE,
    FAMILIES,
    FAMILIES_AND_VARIANTS,
    FAMILY_TABLE,
    GATED_MLPS,
    MOE_FAMILIES,
    ROPE_LAYERS,
    SHARED_NORM_CALLS,
    family_of,
    fused_decoder_layers,
    patched_copy,
    single_thread,  # noqa: F401 - autouse fixture
    skip_if_unpatched_forward_fails,
    synthetic_batches,
    tiny_model,
)

from fuseforge.transformers import get_patch_report, unpatch  # noqa: E402
from fuseforge.transformers import loss as loss_module  # noqa: E402

FP32 = torch.float32
STEPS = 10
LR = 3e-3


def _patched(model, **flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patched_copy(model, **flags)[0]


def _labelled(what: str):
    """assert_close message that keeps torch's mismatch details."""
    return lambda details: f"{what}\n{details}"


def _assert_grads_close(fused, ref, scale=1.0, what=""):
    for (name, p_fused), (_, p_ref) in zip(fused.named_parameters(), ref.named_parameters()):
        if p_ref.grad is None:
            assert p_fused.grad is None, f"{what}{name}: gradient where the original has none"
            continue
        assert p_fused.grad is not None, f"{what}{name}: no gradient"
        assert_close(p_fused.grad, p_ref.grad, FP32, scale, msg=_labelled(f"{what}grad of {name}"))


def _assert_params_close(fused, ref, lr: float):
    """Final parameters agree to fp32 tolerance, up to Adam's amplification of rounding noise.

    An element whose gradient is ~0 (pure rounding noise) can step by a fraction of lr in
    a different direction, so a handful of elements may miss the fp32 tolerance, by far less
    than lr. A wrong gradient anywhere moves many elements by ~lr per step and still fails.
    """
    bound = tol(FP32, scale=10)
    for (name, p_fused), (_, p_ref) in zip(fused.named_parameters(), ref.named_parameters()):
        diff = (p_fused.detach().double() - p_ref.detach().double()).abs()
        outside = diff > bound["atol"] + bound["rtol"] * p_ref.detach().double().abs()
        assert outside.double().mean() <= 1e-3 and diff.max() <= lr / 4, (
            f"parameter {name}: {int(outside.sum())}/{diff.numel()} elements outside fp32 tolerance, "
            f"max |diff| {diff.max():.3g} (lr {lr})"
        )


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls into each fused kernel, to prove the patched model really runs them."""
    from fuseforge.transformers import layers, rope

    calls = {}

    def spy(module, name, kernel):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            calls[kernel] = calls.get(kernel, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    spy(layers, "rms_norm", "rms_norm")
    spy(layers, "fused_add_rms_norm", "rms_norm")  # the post-attention norms of fused decoder layers
    spy(layers, "swiglu", "glu")
    spy(layers, "geglu", "glu")
    spy(layers, "clamped_swiglu", "glu")
    spy(rope, "rope", "rope")
    spy(loss_module, "fused_linear_cross_entropy", "fused_linear_cross_entropy")
    return calls


def _experts(family: str) -> dict:
    return {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}


def _has_aux_loss(family: str) -> bool:
    """Whether the family's forward adds a router aux loss to the loss (FAMILY_TABLE's word)."""
    return FAMILY_TABLE[family_of(family)].router_aux_loss


@pytest.mark.parametrize("family", FAMILIES_AND_VARIANTS)
def test_training_matches_unpatched(family, kernel_calls):
    skip_if_unpatched_forward_fails(family)
    ref = tiny_model(family, **_experts(family)).train()
    fused = _patched(ref).train()
    report = get_patch_report(fused)
    # eps=1e-6: with the default 1e-8, parameters whose gradient is ~0 (noise) take lr-sized
    # steps of random sign, so fp32 rounding differences would be amplified into lr-sized gaps.
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-6)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=LR, eps=1e-6)
    ref_losses, fused_losses = [], []
    for step, batch in enumerate(synthetic_batches(STEPS)):
        out_ref = ref(**batch)
        out_fused = fused(**batch)
        assert out_fused.logits is None  # training with labels: logits never materialised
        if _has_aux_loss(family):  # the aux loss is reported, and part of the loss (checked below)
            assert out_ref.aux_loss is not None and out_ref.aux_loss.item() > 0
            assert_close(out_fused.aux_loss, out_ref.aux_loss, FP32, msg=_labelled("router aux loss"))
        else:  # none, as in the original (DeepSeek-V3's and Llama 4's MoE forwards add none)
            assert getattr(out_ref, "aux_loss", None) is None and getattr(out_fused, "aux_loss", None) is None
        out_ref.loss.backward()
        out_fused.loss.backward()
        if step == 0:
            _assert_grads_close(fused, ref, what=f"{family} step 0: ")
            layers = ref.config.get_text_config().num_hidden_layers
            expected = {
                # one kernel call per fused norm module; a fused decoder layer calls its norm's kernel
                "rms_norm": sum(report.patched["rms_norm"].values()) - fused_decoder_layers(report)
                + SHARED_NORM_CALLS.get(family, 0),
                "rope": ROPE_LAYERS.get(family, layers),
                # MoE: one fused gate per expert that received tokens (2 of 4 per token).
                # Batched experts and dense MLPs: one per module.
                "glu": (
                    kernel_calls.get("glu")
                    if family in MOE_FAMILIES and family not in BATCHED_EXPERTS
                    else GATED_MLPS.get(family_of(family), layers)
                ),
                "fused_linear_cross_entropy": 1,
            }
            assert kernel_calls == {k: n for k, n in expected.items() if n}
            if family in MOE_FAMILIES and family not in BATCHED_EXPERTS:  # top-2: at least two experts per layer
                assert kernel_calls["glu"] >= 2 * layers
        for opt in (opt_ref, opt_fused):
            opt.step()
            opt.zero_grad(set_to_none=True)
        ref_losses.append(out_ref.loss.item())
        fused_losses.append(out_fused.loss.item())
    assert_close(torch.tensor(fused_losses), torch.tensor(ref_losses), FP32, msg=_labelled("per-step losses"))
    assert min(ref_losses[-3:]) < ref_losses[0], f"the synthetic task should be learnable: {ref_losses}"
    _assert_params_close(fused, ref, LR)

    ref.eval(), fused.eval()
    probe = synthetic_batches(1)[0]
    del probe["labels"]
    with torch.no_grad():
        logits_ref = ref(**probe).logits
        logits_fused = fused(**probe).logits
        unpatch(fused)
        logits_fused_weights_unpatched = fused(**probe).logits
    assert logits_fused is not None and logits_fused.shape == logits_ref.shape
    # The eval path itself is exact to fp32 tolerance (same weights, with and without kernels)...
    assert_close(logits_fused, logits_fused_weights_unpatched, FP32, msg=_labelled("eval logits, same weights"))
    # ...and the two trained models agree up to the parameter noise bounded above.
    # Each logit sums `hidden` parameters that may each differ by up to lr/4, so a few of them (0.1% of
    # 48k on the H200) land just past lr/4; a wrong kernel moves most of them, by far more than lr.
    diff = (logits_fused.double() - logits_ref.double()).abs()
    outside = diff > LR / 4 + 1e-5 * logits_ref.double().abs()
    assert outside.double().mean() <= 1e-2 and diff.max() <= LR, (
        f"{family} eval logits: {int(outside.sum())}/{diff.numel()} elements differ by more than lr/4, "
        f"max {diff.max():.3g}"
    )


def test_mixtral_grouped_mm_experts_match():
    """The default experts implementation runs transformers' grouped_mm with the fused gate."""
    ref = tiny_model("mixtral", experts_implementation="grouped_mm").train()
    fused = _patched(ref).train()
    assert type(fused.model.layers[0].mlp.experts).__name__ == "FusedMixtralExperts"
    batch = synthetic_batches(1)[0]
    out_ref, out_fused = ref(**batch), fused(**batch)
    assert_close(out_fused.loss, out_ref.loss, FP32)
    out_ref.loss.backward()
    out_fused.loss.backward()
    _assert_grads_close(fused, ref)


# Gemma 4's MoE layers (a dense MLP plus tanh-GeGLU experts behind an unscaled-norm router) and GPT-OSS's
# biased, transposed experts under the non-eager implementations, which call only the fused gate.
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.mark.parametrize(
    "family,overrides,implementation,label",
    [
        ("gpt_oss", {}, "grouped_mm", "(experts, clamped swiglu)"),
        ("gemma4", GEMMA4_MOE, "eager", "(experts, geglu tanh)"),
        ("gemma4", GEMMA4_MOE, "grouped_mm", "(experts, geglu tanh)"),
    ],
    ids=["gpt_oss-grouped_mm", "gemma4_moe-eager", "gemma4_moe-grouped_mm"],
)
def test_moe_experts_match(family, overrides, implementation, label, kernel_calls):
    ref = tiny_model(family, experts_implementation=implementation, **overrides).train()
    fused = _patched(ref).train()
    report = get_patch_report(fused)
    assert not report.skipped
    experts = [name for name in report.patched["swiglu"] if "experts" in name]
    assert experts and all(label in name for name in experts)
    batch = synthetic_batches(1)[0]
    out_ref, out_fused = ref(**batch), fused(**batch)
    # eager: one gate call per expert hit (top-2: at least two per layer); grouped_mm: one per layer. Gemma 4's
    # MoE layers also run their dense MLP.
    layers = ref.config.num_hidden_layers
    dense = layers if family == "gemma4" else 0
    assert kernel_calls["glu"] >= (2 if implementation == "eager" else 1) * layers + dense
    assert_close(out_fused.loss, out_ref.loss, FP32)
    out_ref.loss.backward()
    out_fused.loss.backward()
    _assert_grads_close(fused, ref)


@pytest.mark.parametrize(
    "family,function",
    [
        ("deepseek_v3", "apply_rotary_pos_emb_interleave"),
        ("deepseek_v3_rotate_half", "apply_rotary_pos_emb"),
        ("llama4", "apply_rotary_emb"),
    ],
)
def test_fused_rope_returns_what_the_transformers_function_returns(family, function, monkeypatch):
    """Inside patched attention, each fused RoPE call returns what transformers' own function returns.

    The model-level tests cannot tell DeepSeek-V3's pairs-to-halves layout from plain interleaved pairs
    (q and k share any permutation of their rotary dims, so their dot products agree), but the KV cache
    stores the rotated keys: the function itself must match. Llama 4's complex freqs_cis is rebuilt from
    the cos/sin the kernel received, which also checks that adapter.
    """
    from fuseforge.transformers import rope as rope_patch

    ref = tiny_model(family).train()
    module = sys.modules[type(ref.model.layers[0].self_attn).__module__]
    original = getattr(module, function)
    fused = _patched(ref).train()
    assert getattr(module, function).__wrapped__ is original
    kernel, calls = rope_patch.rope, []

    def recording(q, k, cos, sin, **kwargs):
        calls.append(((q, k, cos, sin), kwargs))
        return kernel(q, k, cos, sin, **kwargs)

    monkeypatch.setattr(rope_patch, "rope", recording)
    batch = synthetic_batches(1)[0]
    try:
        fused(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        unpatch(fused)
    assert len(calls) == ROPE_LAYERS.get(family, fused.config.num_hidden_layers)
    for (q, k, cos, sin), kwargs in calls:
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        ours = kernel(q, k, cos, sin, **kwargs)
        if function == "apply_rotary_emb":  # freqs_cis = cos + i sin, one entry per pair
            half = cos.shape[-1] // 2
            theirs = original(q, k, torch.complex(cos[..., :half], sin[..., :half]))
        else:
            theirs = original(q, k, cos, sin, unsqueeze_dim=kwargs["unsqueeze_dim"])
        grads = torch.randn_like(ours[0]), torch.randn_like(ours[1])
        grads_ours = torch.autograd.grad(ours, (q, k), grads)
        grads_theirs = torch.autograd.grad(theirs, (q, k), grads)
        for a, b, what in zip((*ours, *grads_ours), (*theirs, *grads_theirs), ("q", "k", "grad q", "grad k")):
            assert_close(a, b, FP32, msg=_labelled(f"{function}: {what}"))
    assert getattr(module, function) is original  # the last patched user is gone


@pytest.mark.parametrize("family", ["llama", *FAMILIES[FAMILIES.index("qwen3_moe") :]])
def test_gradient_accumulation_with_num_items_matches_one_big_batch(family):
    ref = tiny_model(family, **_experts(family)).train()
    fused = _patched(ref).train()
    big = synthetic_batches(1, batch_size=4)[0]
    big["input_ids"][1, -5:] = 0  # a second padded row with a different amount of padding
    big["attention_mask"][1, -5:] = 0
    big["labels"][1, -5:] = -100
    num_items = (big["labels"][:, 1:] != -100).sum()  # what the Trainer passes: shifted, non-ignored
    total = torch.zeros((), device=DEVICE)
    for row in range(4):
        micro = {k: v[row : row + 1] for k, v in big.items()}
        loss = fused(**micro, num_items_in_batch=num_items).loss
        loss.backward()
        total += loss.detach()
    if family in MOE_FAMILIES:
        # The router aux loss is per forward (not a per-token sum), so the reference is the
        # unpatched model on the same micro-batches, each with its aux loss.
        expected = torch.zeros((), device=DEVICE)
        for row in range(4):
            out_ref = ref(**{k: v[row : row + 1] for k, v in big.items()}, num_items_in_batch=num_items)
            assert (out_ref.get("aux_loss") is not None) == _has_aux_loss(family)  # Llama 4 VL: no such field
            out_ref.loss.backward()
            expected += out_ref.loss.detach()
    else:
        out_ref = ref(**big)
        out_ref.loss.backward()
        expected = out_ref.loss.detach()
    assert_close(total, expected, FP32)
    _assert_grads_close(fused, ref, what="accumulated: ")


def test_logits_to_keep_and_logits_on_request():
    ref = tiny_model("llama").train()
    fused = _patched(ref).train()
    batch = synthetic_batches(1)[0]
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]

    # Labels for the kept positions only, as transformers requires.
    keep = 7
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels[:, -keep:], logits_to_keep=keep)
    out_fused = fused(input_ids=ids, attention_mask=mask, labels=labels[:, -keep:], logits_to_keep=keep)
    assert out_fused.logits is None
    assert_close(out_fused.loss, out_ref.loss, FP32)
    with pytest.raises(ValueError, match="logits_to_keep"):
        fused(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=keep)

    # skip_logits=False: logits come back with the (fused) loss; return_dict=False: a tuple.
    out_fused = fused(input_ids=ids, attention_mask=mask, labels=labels, skip_logits=False)
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert_close(out_fused.loss, out_ref.loss, FP32)
    assert_close(out_fused.logits, out_ref.logits, FP32)
    loss_fused, *rest = fused(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert_close(loss_fused, out_ref.loss, FP32)
    assert all(not (torch.is_tensor(r) and r.shape[-1:] == (ref.config.vocab_size,)) for r in rest)

    # shift_labels (as context-parallel training passes them) instead of labels.
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    out_fused = fused(input_ids=ids, attention_mask=mask, shift_labels=shifted)
    assert_close(out_fused.loss, out_ref.loss, FP32)

    # Eval mode (generation, metrics): logits computed normally, only the last one when asked.
    ref.eval(), fused.eval()
    with torch.no_grad():
        out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels)
        out_fused = fused(input_ids=ids, attention_mask=mask, labels=labels)
        assert_close(out_fused.logits, out_ref.logits, FP32)
        assert_close(out_fused.loss, out_ref.loss, FP32)
        last_ref = ref(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
        last_fused = fused(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    assert last_fused.shape == (2, 1, ref.config.vocab_size)
    assert_close(last_fused, last_ref, FP32)


def test_activation_checkpointing_recomputes_with_fused_kernels():
    ref = tiny_model("qwen2").train()
    fused = _patched(ref).train()
    non_reentrant = {"use_reentrant": False}
    if hasattr(fused, "activation_checkpointing_enable"):  # the newer name (transformers >= 5.2x)
        fused.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
    else:
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
    attention_calls = []
    for layer in fused.model.layers:
        layer.self_attn.register_forward_hook(lambda *_: attention_calls.append(1))
    batch = synthetic_batches(1)[0]
    out_ref, out_fused = ref(**batch), fused(**batch)
    out_ref.loss.backward()
    out_fused.loss.backward()  # non-reentrant checkpointing checks the recomputation saved the same tensors
    assert len(attention_calls) == 2 * len(fused.model.layers)  # forward + recomputation
    assert_close(out_fused.loss, out_ref.loss, FP32)
    _assert_grads_close(fused, ref, what="checkpointed: ")


def test_cross_entropy_flag_replaces_the_logits_loss(monkeypatch):
    calls = []
    original = loss_module.cross_entropy
    monkeypatch.setattr(loss_module, "cross_entropy", lambda *a, **k: calls.append(1) or original(*a, **k))
    ref = tiny_model("gemma2").train()  # softcapped logits: the loss sees them after the cap
    fused = _patched(ref, fused_linear_cross_entropy=False, cross_entropy=True).train()
    batch = synthetic_batches(1)[0]
    num_items = (batch["labels"][:, 1:] != -100).sum() + 3  # any count: sum / num_items
    out_ref = ref(**batch, num_items_in_batch=num_items)
    out_fused = fused(**batch, num_items_in_batch=num_items)
    assert calls and out_fused.logits is not None
    assert_close(out_fused.loss, out_ref.loss, FP32)
    out_ref.loss.backward()
    out_fused.loss.backward()
    _assert_grads_close(fused, ref)


def _load_example(name: str):
    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"fuseforge_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_trainer_example_matches_the_unpatched_trainer(tmp_path):
    """examples/hf_trainer.py: Trainer with gradient accumulation, patched vs not, same run."""
    example = _load_example("hf_trainer")
    runs = {}
    for kernels in (False, True):
        model = example.build_model(None, bf16=False)  # seeded: identical initial weights
        if kernels:
            assert example.apply_kernels(model).patched["fused_linear_cross_entropy"]
        trainer = example.train(model, steps=3, seq_len=16, output_dir=str(tmp_path / str(kernels)))
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        runs[kernels] = (losses, model, trainer.evaluate()["eval_loss"])
    (ref_losses, ref, ref_eval), (losses, fused, fused_eval) = runs[False], runs[True]
    assert len(losses) == 3
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), FP32, msg=_labelled("Trainer losses"))
    _assert_params_close(fused, ref, lr=3e-3)
    torch.testing.assert_close(fused_eval, ref_eval, atol=1e-3, rtol=1e-5)


def test_sft_example_explains_a_missing_trl():
    if importlib.util.find_spec("trl") is not None and importlib.util.find_spec("datasets") is not None:
        pytest.skip("TRL is installed: the guard does not fire")
    with pytest.raises(SystemExit, match="pip install trl datasets"):
        _load_example("sft_trainer")


# Not the MoE families: a token whose top-k router logits tie within bf16 rounding lands on other experts in
# either model by chance, and moves loss and gradients by far more than rounding.
@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4"])
def test_bf16_model_is_as_accurate_as_the_original(family):
    """How models are really trained: bf16 weights and activations through every kernel.

    bf16 rounds every intermediate, so patched and original differ by rounding; both are
    compared with an fp32 copy of the same weights, and the patched model must be no less
    accurate than transformers' own bf16 path (up to a small slack).
    """
    ref = tiny_model(family).to(torch.bfloat16).train()
    fused = _patched(ref).train()
    exact = tiny_model(family).train()  # fp32 model holding the same (bf16-representable) weights
    exact.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    batch = synthetic_batches(1)[0]
    outputs = [model(**batch) for model in (fused, ref, exact)]
    for out in outputs:
        out.loss.backward()
    loss_fused, loss_ref, loss_exact = (out.loss.double().item() for out in outputs)
    assert outputs[0].loss.dtype == torch.float32  # the fused loss is computed and returned in fp32
    assert abs(loss_fused - loss_exact) <= 2 * abs(loss_ref - loss_exact) + 1e-3
    named = zip(fused.named_parameters(), ref.parameters(), exact.parameters())
    for (name, p_fused), p_ref, p_exact in named:
        assert p_fused.grad.dtype == torch.bfloat16, name
        truth = p_exact.grad.double()
        error = (p_fused.grad.double() - truth).norm() / truth.norm()
        error_ref = (p_ref.grad.double() - truth).norm() / truth.norm()
        assert error <= 2 * error_ref + 5e-3, f"{name}: relative gradient error {error:.3g} vs HF bf16 {error_ref:.3g}"
