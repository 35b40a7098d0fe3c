"""The patching machinery: in-place swaps, exact unpatch, idempotence, class-level and Auto
patching, RoPE scoping, unknown model types, flag validation, the fused loss's chunk size
(loss_chunk_size), save/load round trips."""

from __future__ import annotations

import copy
import gc
import importlib
import inspect
import warnings

import pytest
import torch
from tolerances import assert_close

transformers = pytest.importorskip("transformers")

from test_transformers_tiny_models import (  # noqa: E402
    COMMON,
    DEVICE,
    FAMILIES,
    MOE_FAMILIES,
    single_thread,  # noqa: F401 - autouse fixture
    synthetic_batches,
    tiny_config,
    tiny_model,
)

import fuseforge.transformers as ff  # noqa: E402
from fuseforge.transformers import loss as loss_patch  # noqa: E402
from fuseforge.transformers import rope as rope_patch  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

FP32 = torch.float32
ORIGINAL_LLAMA_ROPE = modeling_llama.apply_rotary_pos_emb


@pytest.fixture(autouse=True)
def _collect_dead_patched_models():
    """Patched models from earlier tests in this process can sit in reference cycles until the
    cyclic GC runs; collect them so that each test sees only its own models' RoPE patch."""
    gc.collect()
    yield


def _quiet_apply(model, **flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ff.apply_kernels(model, **flags)


def _outputs(model, batch):
    """Training loss, its gradients, and eval logits: everything a patch could change."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    # Parameters off the loss's path (an image-text model's vision tower on text-only batches) have none.
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, logits


def _count_calls(monkeypatch, module, name) -> list:
    """One entry per call of `module.name` (the patched code looks it up in its module at call time)."""
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.fixture
def rope_calls(monkeypatch):
    """Counts fused RoPE kernel calls."""
    return _count_calls(monkeypatch, rope_patch, "rope")


@pytest.mark.parametrize("family", ["llama", *FAMILIES[FAMILIES.index("qwen3_moe") :], "phi4"])
def test_patch_keeps_weights_and_unpatch_restores_bit_exact_behaviour(family):
    experts = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    ref = tiny_model(family, **experts)
    model = copy.deepcopy(ref)
    modeling = importlib.import_module(type(ref).__module__)
    # Its RoPE globals: apply_rotary_pos_emb, DeepSeek-V3's apply_rotary_pos_emb_interleave, Llama 4's apply_rotary_emb.
    original_ropes = {name: getattr(modeling, name) for name in rope_patch.GLOBAL_NAMES if hasattr(modeling, name)}
    assert original_ropes
    params_before = {n: p for n, p in model.named_parameters()}
    # Tied to the embedding in some families (not a named parameter then); Llama 4's image-text model keeps
    # it in its language model.
    head_weight = model.get_output_embeddings().weight
    expected = _outputs(ref, batch := synthetic_batches(1)[0])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported family patches without a warning
        report = ff.apply_kernels(model)
    assert ff.is_patched(model) and ff.get_patch_report(model) is report
    assert {n: p for n, p in model.named_parameters()} == params_before  # the same Parameter objects
    assert model.get_output_embeddings().weight is head_weight
    for name, original in original_ropes.items():
        assert (getattr(modeling, name) is not original) == ("rope" in report.patched), name
    patched_loss, _, patched_logits = _outputs(model, batch)
    assert_close(patched_loss, expected[0], FP32)
    assert_close(patched_logits, expected[2], FP32)

    assert ff.unpatch(model) is True
    assert ff.unpatch(model) is False  # nothing left to undo
    for (name, module), (_, original) in zip(model.named_modules(), ref.named_modules()):
        assert type(module) is type(original), name
        assert "forward" not in module.__dict__ and "_loss_function" not in module.__dict__, name
        assert not [a for a in module.__dict__ if a.startswith("_fuseforge")], name
    assert all(getattr(modeling, name) is original for name, original in original_ropes.items())
    loss, grads, logits = _outputs(model, batch)
    assert torch.equal(loss, expected[0]) and torch.equal(logits, expected[2])
    assert grads.keys() == expected[1].keys() and all(torch.equal(grads[n], expected[1][n]) for n in grads)


def test_patching_twice_is_harmless_and_new_flags_repatch():
    model = tiny_model("llama")
    first = ff.apply_kernels(model)
    assert ff.apply_kernels(model) is first  # same flags: no-op
    norm = model.model.norm
    assert [c.__name__ for c in type(norm).__mro__].count("FusedLlamaRMSNorm") == 1
    assert type(norm).__mro__[1].__name__ == "LlamaRMSNormMixin" and type(norm)._fuseforge_original is modeling_llama.LlamaRMSNorm
    assert type(norm).__mro__.index(modeling_llama.LlamaRMSNorm) == 3  # after the mixin and its FusedRMSNormMixin base

    second = ff.apply_kernels(model, rope=False, swiglu=False)
    assert second is not first and "rope" not in second.patched and "swiglu" not in second.patched
    assert type(model.model.layers[0].self_attn) is modeling_llama.LlamaAttention
    assert type(model.model.layers[0].mlp) is modeling_llama.LlamaMLP
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_LLAMA_ROPE  # the last RoPE user is gone
    ff.unpatch(model)

    nothing = ff.apply_kernels(model, **{flag: False for flag in ff.DEFAULT_FLAGS})
    assert nothing.patched == {} and all(type(m).__name__.startswith("Fused") is False for m in model.modules())
    ff.unpatch(model)


def test_rope_dispatch_is_scoped_to_patched_models(rope_calls):
    plain = tiny_model("llama").eval()
    batch = synthetic_batches(1)[0]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        before = plain(input_ids=ids, attention_mask=mask).logits
    first, second = tiny_model("llama").eval(), tiny_model("llama").eval()
    ff.apply_kernels(first)
    ff.apply_kernels(second)
    try:
        with torch.no_grad():
            after = plain(input_ids=ids, attention_mask=mask).logits  # same family, not patched
            assert rope_calls == []
            first(input_ids=ids, attention_mask=mask)
        assert torch.equal(after, before)
        assert len(rope_calls) == first.config.num_hidden_layers
        ff.unpatch(first)
        assert modeling_llama.apply_rotary_pos_emb is not ORIGINAL_LLAMA_ROPE  # `second` still uses it
    finally:
        ff.unpatch(first)
        ff.unpatch(second)
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_LLAMA_ROPE


def _half_width_inputs(dtype):
    """GPT-OSS: q/k [B, H, T, D] and cos/sin [B, T, D/2] (each frequency once), YaRN-scaled."""
    q, k = torch.randn(2, 4, 5, 16, dtype=dtype), torch.randn(2, 2, 5, 16, dtype=dtype)
    angles = torch.randn(2, 5, 8) * 3
    return (q, k), (angles.cos() * 1.2, angles.sin() * 1.2), {}


def _single_inputs(dtype):
    """Gemma 4: one [B, T, H, D] tensor, unsqueeze_dim=2, proportional cos/sin (zero frequencies past Dr/2)."""
    freqs = torch.cat((torch.rand(2, 5, 4) * 10, torch.zeros(2, 5, 12)), dim=-1)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (torch.randn(2, 5, 4, 32, dtype=dtype),), (angles.cos(), angles.sin()), {"unsqueeze_dim": 2}


@pytest.mark.parametrize("family,inputs", [("gpt_oss", _half_width_inputs), ("gemma4", _single_inputs)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rope_call_forms_match_their_original_function(family, inputs, dtype):
    """GPT-OSS's half-width and Gemma 4's one-tensor apply_rotary_pos_emb, fused: outputs and gradients."""
    model = tiny_model(family)
    ff.apply_kernels(model)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    install = rope_patch._INSTALLS[(module.__name__, "apply_rotary_pos_emb")]
    with torch.device(DEVICE):  # the kernels run where the models do (the GPU when there is one)
        tensors, (cos, sin), kwargs = inputs(dtype)
    tensors = [t.requires_grad_() for t in tensors]
    tensors64 = [t.detach().double().requires_grad_() for t in tensors]
    token = rope_patch._ACTIVE.set(True)  # as inside a patched attention forward
    try:
        fused = module.apply_rotary_pos_emb(*tensors, cos.to(dtype), sin.to(dtype), **kwargs)
    finally:
        rope_patch._ACTIVE.reset(token)
    expected = install.original(*tensors64, cos.double(), sin.double(), **kwargs)
    fused = (fused,) if torch.is_tensor(fused) else fused  # q and k, or one tensor
    expected = (expected,) if torch.is_tensor(expected) else expected
    grads = [torch.randn_like(e) for e in expected]
    for out, ref in zip(fused, expected):
        assert out.dtype == dtype and out.shape == ref.shape
        assert_close(out, ref, dtype)
    fused_grads = torch.autograd.grad(fused, tensors, [g.to(dtype) for g in grads])
    for got, want in zip(fused_grads, torch.autograd.grad(expected, tensors64, grads)):
        assert_close(got, want, dtype)
    ff.unpatch(model)


def test_deep_copy_of_a_patched_model_is_patched_and_independent(rope_calls):
    model = tiny_model("llama").eval()
    ff.apply_kernels(model)
    clone = copy.deepcopy(model)
    ff.unpatch(model)  # drops the last registered RoPE user: the global goes back
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_LLAMA_ROPE
    assert type(clone.model.norm).__name__ == "FusedLlamaRMSNorm" and ff.is_patched(clone)
    assert clone.forward.__self__ is clone  # the fused forward is bound to the copy, not the original
    with torch.no_grad():
        clone(input_ids=synthetic_batches(1)[0]["input_ids"])  # re-installs the dispatcher on demand
    assert len(rope_calls) == clone.config.num_hidden_layers
    ff.unpatch(clone)
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_LLAMA_ROPE


def test_class_patch_applies_to_instances_built_later(tmp_path):
    config = tiny_config("qwen2")
    saved = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p))  # weights no initializer would produce
    saved.save_pretrained(tmp_path)
    cls = transformers.Qwen2ForCausalLM
    original_init = cls.__init__
    report = ff.apply_kernels(cls, rope=False)
    try:
        assert report.target == "class Qwen2ForCausalLM" and report.family == "qwen2"
        assert ff.apply_kernels(cls, rope=False) is report  # idempotent on classes too
        assert cls.__init__ is not original_init
        assert inspect.signature(cls.__init__) == inspect.signature(original_init)
        built = transformers.AutoModelForCausalLM.from_config(config)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        assert ff.unpatch(cls) is True
    assert cls.__init__ is original_init
    for model in (built, loaded):
        instance_report = ff.get_patch_report(model)
        assert instance_report is not None and instance_report.flags["rope"] is False
        assert type(model.model.norm).__name__ == "FusedQwen2RMSNorm"
        assert type(model.model.layers[0].self_attn).__name__ == "Qwen2Attention"
    for (name, p_loaded), (_, p_saved) in zip(loaded.named_parameters(), saved.named_parameters()):
        assert torch.equal(p_loaded, p_saved), f"{name}: loaded weights changed by the class patch"
    assert not ff.is_patched(transformers.AutoModelForCausalLM.from_config(config))
    assert ff.is_patched(built)  # instances keep their patch until unpatched themselves
    ff.unpatch(built)
    ff.unpatch(loaded)


def test_auto_class_and_save_load_round_trip(tmp_path):
    model = ff.AutoFusedModelForCausalLM.from_config(tiny_config("llama"), swiglu=False)
    report = ff.get_patch_report(model)
    assert report.family == "llama" and "swiglu" not in report.patched and report.patched["rms_norm"]
    model.save_pretrained(tmp_path)  # a patched model saves exactly like the original
    saved = transformers.AutoConfig.from_pretrained(tmp_path)
    assert saved.architectures == ["LlamaForCausalLM"]

    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded = ff.AutoFusedModelForCausalLM.from_pretrained(tmp_path)
    assert ff.is_patched(loaded) and not ff.is_patched(plain)
    assert ff.get_patch_report(loaded).patched["swiglu"]  # default flags this time
    for (name, p_loaded), (_, p_model) in zip(loaded.named_parameters(), model.named_parameters()):
        assert torch.equal(p_loaded, p_model), name
    with pytest.raises(OSError, match="from_pretrained"):
        ff.AutoFusedModelForCausalLM()
    ff.unpatch(model)
    ff.unpatch(loaded)


@pytest.mark.parametrize(
    "model_type, patched, not_patched",
    [
        ("arcee", {"rms_norm", "rope"}, {"fused_linear_cross_entropy"}),  # llama-like, ReLU^2 MLP
        ("starcoder2", {"layer_norm", "rope"}, {"fused_linear_cross_entropy"}),  # nn.LayerNorm + GELU MLP
    ],
)
def test_unknown_model_type_warns_and_fuses_only_recognised_code(model_type, patched, not_patched):
    config = transformers.AutoConfig.for_model(model_type, **COMMON)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(DEVICE).eval()
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match=f"model type '{model_type}'.*not a supported") as record:
        report = ff.apply_kernels(model)
    message = str(record[0].message)
    for kernel in not_patched:
        assert f"{kernel}: NOT patched" in message
    assert set(report.patched_kernels()) == patched and not report.supported
    ids = synthetic_batches(1)[0]["input_ids"]
    with torch.no_grad():
        assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, FP32)
    ff.unpatch(model)


def test_code_that_differs_is_left_alone():
    """Helium's RMSNorm is code we have not verified (not a known fingerprint) and its RoPE is interleaved."""
    config = transformers.AutoConfig.for_model("helium", **COMMON)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.warns(UserWarning, match="HeliumRMSNorm: implementation not recognised"):
        report = ff.apply_kernels(model)
    assert "rms_norm" not in report.patched and "rope" not in report.patched
    assert any("apply_rotary_pos_emb" in reason for reason in report.skipped["rope"])
    assert all(type(m).__name__ == "HeliumRMSNorm" for m in model.modules() if "RMSNorm" in type(m).__name__)
    assert report.patched["swiglu"]  # its MLP is the standard one
    ff.unpatch(model)


def test_gpt_oss_experts_code_that_differs_is_refused(monkeypatch):
    """A GPT-OSS gate that is not the verified code is never swapped; an unverified eager loop keeps its own
    code, and only the (verified) gate that grouped_mm/batched_mm call is fused, with a warning."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    experts_cls = modeling_gpt_oss.GptOssExperts

    def other_gate(self, gate_up):  # e.g. a release that drops the clamp
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    with monkeypatch.context() as patch:
        patch.setattr(experts_cls, "_apply_gate", other_gate)
        model = tiny_model("gpt_oss")
        with pytest.warns(UserWarning, match="GptOssExperts: experts layout/gate is not"):
            report = ff.apply_kernels(model)
        assert "swiglu" not in report.patched
        assert all(type(m) is experts_cls for m in model.modules() if "Experts" in type(m).__name__)
        ff.unpatch(model)

    verified_loop = inspect.unwrap(experts_cls.forward)

    def other_loop(self, hidden_states, router_indices=None, routing_weights=None):
        return verified_loop(self, hidden_states, router_indices, routing_weights)

    monkeypatch.setattr(experts_cls, "forward", other_loop)
    model = tiny_model("gpt_oss")
    with pytest.warns(UserWarning, match="GptOssExperts: eager experts loop not recognised"):
        report = ff.apply_kernels(model)
    assert list(report.patched["swiglu"]) == ["GptOssExperts (experts, clamped swiglu, grouped_mm/batched_mm only)"]
    ff.unpatch(model)


def test_bad_arguments_are_rejected_with_clear_errors():
    model = tiny_model("qwen2")
    with pytest.raises(TypeError, match="flash"):
        ff.apply_kernels(model, flash=True)
    with pytest.raises(TypeError, match="rms_norm must be a bool"):
        ff.apply_kernels(model, rms_norm="yes")
    with pytest.raises(TypeError, match="nn.Module"):
        ff.apply_kernels("meta-llama/Llama-3.2-1B")
    with pytest.raises(TypeError, match="nn.Module"):
        ff.apply_kernels(dict)
    with pytest.raises(ValueError, match=r"apply_kernels_to_llama expects .*'qwen2'"):
        ff.apply_kernels_to_llama(model)
    assert not ff.is_patched(model)
    assert ff.apply_kernels_to_qwen2(model).family == "qwen2"
    ff.unpatch(model)


def test_patched_context_manager_restores_the_previous_state():
    model = tiny_model("mistral")
    with ff.patched(model) as report:
        assert ff.is_patched(model) and report.patched["rope"]
    assert not ff.is_patched(model) and type(model.model.norm).__name__ == "MistralRMSNorm"

    ff.apply_kernels(model, rope=False)
    with ff.patched(model, rms_norm=False):
        assert type(model.model.norm).__name__ == "MistralRMSNorm"
    assert ff.get_patch_report(model).flags["rope"] is False  # the outer patch is back
    assert type(model.model.norm).__name__ == "FusedMistralRMSNorm"
    ff.unpatch(model)


def test_forward_signature_is_kept_for_trainer_column_selection():
    model = tiny_model("phi3")
    before = inspect.signature(model.forward)
    ff.apply_kernels(model)
    assert "forward" in model.__dict__  # the fused loss forward, bound to this instance
    assert inspect.signature(model.forward) == before
    assert "labels" in before.parameters and "input_ids" in before.parameters
    ff.unpatch(model)


def test_custom_loss_function_is_respected():
    model = tiny_model("llama").train()
    ff.apply_kernels(model)
    seen = []

    def my_loss(logits, labels, vocab_size, **kwargs):
        seen.append(logits.shape)
        return logits.float().square().mean()

    model.loss_function = my_loss
    batch = synthetic_batches(1)[0]
    with pytest.warns(RuntimeWarning, match="custom loss_function"):
        out = model(**batch)
    assert seen == [(2, 24, model.config.vocab_size)] and out.logits is not None
    ff.unpatch(model)
    assert model.loss_function is my_loss  # the user's, not removed by unpatch

    with pytest.warns(UserWarning, match="custom loss_function; it is left in charge"):
        report = ff.apply_kernels(model)  # a custom loss set before patching: the loss is not fused
    assert "fused_linear_cross_entropy" not in report.patched and report.patched["rms_norm"]
    ff.unpatch(model)

    del model._loss_function  # back to the stock causal-LM loss
    ff.apply_kernels(model)  # an lm_head replaced after patching: logits and the model's loss again
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False).to(model.device)
    with pytest.warns(RuntimeWarning, match="lm_head that was replaced after apply_kernels"):
        assert model(**batch).logits is not None
    ff.unpatch(model)

    ff.apply_kernels(model)  # DeepSpeed ZeRO-3 marks partitioned parameters with ds_id
    model.lm_head.weight.ds_id = 0
    with pytest.warns(RuntimeWarning, match="ZeRO-3"):
        assert model(**batch).logits is not None
    ff.unpatch(model)
    del model.lm_head.weight.ds_id


def test_zero3_lm_head_registered_as_external_parameter_keeps_the_fused_loss():
    """A ZeRO-3 head weight registered with the causal LM (DeepSpeed's protocol for a weight read outside its
    module, which gathers it for the model's whole forward and backward) keeps the fused loss."""
    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed not installed (optional extra)")
    model = tiny_model("llama").train()
    batch = synthetic_batches(1)[0]
    ff.apply_kernels(model)
    model.lm_head.weight.ds_id = 0
    deepspeed.zero.register_external_parameter(model, model.lm_head.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert model(**batch).logits is None
    ff.unpatch(model)


def test_rope_global_is_restored_when_the_last_patched_model_is_collected():
    import gc

    model = tiny_model("llama")
    ff.apply_kernels(model)
    assert modeling_llama.apply_rotary_pos_emb is not ORIGINAL_LLAMA_ROPE
    del model
    gc.collect()
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_LLAMA_ROPE


# --- loss_chunk_size: tokens per chunk of the fused loss head -----------------------------------


@pytest.fixture
def flce_chunk_sizes(monkeypatch):
    """The chunk_size of every fused linear cross-entropy call the patched loss path makes."""
    seen = []
    original = loss_patch.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("chunk_size", "not passed"))
        return original(*args, **kwargs)

    monkeypatch.setattr(loss_patch, "fused_linear_cross_entropy", spy)
    return seen


def _loss_chunk_size(model):
    return getattr(model, loss_patch.LOSS_SPEC_ATTR).chunk_size


def test_loss_chunk_size_reaches_the_fused_loss_per_model(flce_chunk_sizes):
    ref = tiny_model("llama")
    batch = synthetic_batches(1)[0]
    assert (batch["labels"] != -100).sum() > 3 * 4  # several chunks of 4 tokens
    expected_loss, expected_grads, _ = _outputs(ref, batch)
    default, chunked = copy.deepcopy(ref), copy.deepcopy(ref)
    default_report = ff.apply_kernels(default)
    report = ff.apply_kernels(chunked, loss_chunk_size=4)  # two models, two chunk sizes, one process
    assert report.loss_chunk_size == 4 and "4 tokens per chunk (loss_chunk_size)" in str(report)
    assert default_report.loss_chunk_size is None and "tokens per chunk" not in str(default_report)
    try:
        for model, chunk_size in ((chunked, 4), (default, None)):
            flce_chunk_sizes.clear()
            loss, grads, _ = _outputs(model, batch)
            assert flce_chunk_sizes == [chunk_size]
            assert_close(loss, expected_loss, FP32)
            for name, grad in grads.items():
                assert_close(grad, expected_grads[name], FP32, msg=f"grad of {name} (loss_chunk_size={chunk_size})")
    finally:
        ff.unpatch(default)
        ff.unpatch(chunked)


def test_loss_chunk_size_is_carried_by_class_patches_and_changed_by_repatching():
    config = tiny_config("llama")
    cls = transformers.LlamaForCausalLM
    ff.apply_kernels(cls, rope=False, loss_chunk_size=8)
    try:
        class_report = ff.apply_kernels(cls, rope=False, loss_chunk_size=16)  # the class patch is updated
        assert class_report.loss_chunk_size == 16
        with pytest.raises(ValueError, match="loss_chunk_size"):
            ff.apply_kernels(cls, loss_chunk_size=0)
        assert ff.get_patch_report(cls).loss_chunk_size == 16  # a rejected call changes nothing
        model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        ff.unpatch(cls)
    assert _loss_chunk_size(model) == 16 and ff.get_patch_report(model).loss_chunk_size == 16

    first = ff.get_patch_report(model)
    assert ff.apply_kernels(model, rope=False, loss_chunk_size=16) is first  # same options: no-op
    assert ff.apply_kernels(model, rope=False, loss_chunk_size=32) is not first
    assert _loss_chunk_size(model) == 32
    with pytest.raises(TypeError, match="loss_chunk_size"):
        ff.apply_kernels(model, loss_chunk_size=2.5)
    assert _loss_chunk_size(model) == 32  # validated before the old patch is undone
    with ff.patched(model, loss_chunk_size=64):
        assert _loss_chunk_size(model) == 64
    assert _loss_chunk_size(model) == 32  # the outer patch is back, with its chunk size
    assert ff.apply_kernels(model).loss_chunk_size is None and _loss_chunk_size(model) is None
    ff.unpatch(model)
    assert not [a for a in model.__dict__ if a.startswith("_fuseforge")]

    assert ff.apply_kernels_to_llama(model, loss_chunk_size=24).loss_chunk_size == 24
    assert _loss_chunk_size(model) == 24
    ff.unpatch(model)
    auto = ff.AutoFusedModelForCausalLM.from_config(config, loss_chunk_size=40)
    assert _loss_chunk_size(auto) == 40 and ff.get_patch_report(auto).loss_chunk_size == 40
    ff.unpatch(auto)


@pytest.fixture
def fused_add_calls(monkeypatch):
    """Counts the fused residual-add norm calls of the decoder layers."""
    from fuseforge.transformers import layers as layers_patch

    return _count_calls(monkeypatch, layers_patch, "fused_add_rms_norm")


def _decoder_layer_and_hf_twin(family, dtype):
    """A patched model, its first decoder layer (fused), a copy of it with HF's forward over the same fused
    modules, and the arguments the model passes that layer."""
    from fuseforge.transformers._swap import restore
    from fuseforge.transformers.layers import ResidualFusedDecoderLayer

    model = tiny_model(family, **({"experts_implementation": "eager"} if family in MOE_FAMILIES else {})).to(dtype)
    _quiet_apply(model)
    layer = next(m for m in model.modules() if isinstance(m, ResidualFusedDecoderLayer))
    twin = copy.deepcopy(layer)
    assert restore(twin) and type(twin) is type(layer)._fuseforge_original
    call = {}
    handle = layer.register_forward_pre_hook(lambda m, args, kwargs: call.update(args=args, kwargs=kwargs),
                                             with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.randint(3, COMMON["vocab_size"], (2, 9), device=DEVICE), use_cache=False)
    handle.remove()
    return layer, twin, call


def _layer_run(layer, call, hidden, grad_out):
    """Output and gradients (input, then every parameter) of one decoder layer on `hidden`."""
    hidden = hidden.detach().clone().requires_grad_(True)
    out = layer(hidden, *call["args"][1:], **call["kwargs"])
    params = [p for _, p in layer.named_parameters()]
    grads = torch.autograd.grad(out, [hidden, *params], grad_out)
    return out.detach(), grads


def _as_float(value):
    """`value` (tensors, nested in tuples/lists/dicts) with floating tensors in fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_as_float(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_float(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("dtype", [FP32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "mixtral", "gemma3", "qwen3_vl"])
def test_decoder_layer_residual_add_runs_in_the_norm_kernel_with_hf_numbers(family, dtype, fused_add_calls):
    """Pre-norm layers (Llama; Mixtral's and Qwen3-VL's signatures) and Gemma 3's sandwich-norm layer."""
    layer, twin, call = _decoder_layer_and_hf_twin(family, dtype)
    hidden = torch.randn(call["args"][0].shape, device=DEVICE, dtype=dtype) * 4
    grad_out = torch.randn_like(hidden)
    fused_add_calls.clear()
    out, grads = _layer_run(layer, call, hidden, grad_out)
    assert len(fused_add_calls) == 1
    expected, expected_grads = _layer_run(twin, call, hidden, grad_out)
    assert len(fused_add_calls) == 1  # HF's forward adds, then calls the norm alone
    # The sum is rounded to the stream's dtype before the norm, as HF's add rounds it: same forward bits.
    assert torch.equal(out, expected)
    names = ["input", *(n for n, _ in layer.named_parameters())]
    if dtype == FP32:
        for got, want, name in zip(grads, expected_grads, names):
            assert_close(got, want, dtype, msg=f"gradient of {name}")
        return
    # bf16: the norm adds the skip's gradient in fp32 and rounds once, HF rounds and then adds, and the
    # attention's bf16 backward spreads that last-bit difference. Against the fp32 layer, fuseforge's
    # gradients must be as close as HF's own bf16 ones.
    reference = copy.deepcopy(twin).float()
    _, reference_grads = _layer_run(reference, _as_float(call), hidden.float(), grad_out.float())
    for got, hf, want, name in zip(grads, expected_grads, reference_grads, names):
        fused_error, hf_error = (got.float() - want).norm(), (hf.float() - want).norm()
        assert fused_error <= 1.25 * hf_error + 1e-3 * want.norm(), (name, fused_error, hf_error)


def test_decoder_layer_arguments_reach_the_attention_as_hf_passes_them(monkeypatch):
    """Positional or keyword, defaults filled from the layer's own signature; too many positionals refused."""
    layer, twin, call = _decoder_layer_and_hf_twin("llama", FP32)
    seen = []
    for module in (layer, twin):
        inner = type(module.self_attn).forward
        monkeypatch.setattr(module.self_attn, "forward",
                            lambda *a, _inner=inner, _m=module.self_attn, **k: seen.append(k) or _inner(_m, *a, **k))
    hidden, kwargs = call["args"][0], dict(call["kwargs"])
    mask, embeddings = kwargs.pop("attention_mask"), kwargs.pop("position_embeddings")
    for module in (layer, twin):  # attention_mask positionally, position_embeddings by keyword
        module(hidden, mask, position_embeddings=embeddings, **kwargs)
    assert seen[0].keys() == seen[1].keys() and "use_cache" in seen[0] and seen[0]["use_cache"] is False
    assert seen[0]["attention_mask"] is mask and seen[0]["position_embeddings"] is embeddings
    with pytest.raises(TypeError, match="positional"):
        layer(hidden, mask, None, None, False, embeddings, "one too many")


def test_decoder_layer_keeps_hf_promoting_add_when_the_attention_output_has_another_dtype(fused_add_calls):
    """fp32 residual stream, bf16 attention output (fp32 weights under autocast): HF's add promotes to fp32."""
    layer, twin, _ = _decoder_layer_and_hf_twin("llama", FP32)
    residual = torch.randn(2, 5, COMMON["hidden_size"], device=DEVICE)
    attention_out = torch.randn_like(residual).to(torch.bfloat16)
    fused_add_calls.clear()
    got = layer._after_attention(attention_out, residual)
    summed = residual + attention_out
    want = summed + twin.mlp(twin.post_attention_layernorm(summed))
    assert got.dtype == FP32 and torch.equal(got, want) and not fused_add_calls


def test_decoder_layers_are_left_to_hf_without_fused_norms_or_with_hooks_on_the_norm():
    model = tiny_model("llama")
    report = _quiet_apply(model, rms_norm=False)
    assert all(type(layer) is modeling_llama.LlamaDecoderLayer for layer in model.model.layers)
    assert "rms_norm" not in report.patched
    ff.unpatch(model)
    model.model.layers[1].post_attention_layernorm.register_forward_hook(lambda *args: None)
    report = _quiet_apply(model)
    assert type(model.model.layers[0]) is not modeling_llama.LlamaDecoderLayer
    assert type(model.model.layers[1]) is modeling_llama.LlamaDecoderLayer  # a hook expects one tensor back
    assert report.patched["rms_norm"]["LlamaDecoderLayer (residual add in post_attention_layernorm)"] == 1
    ff.unpatch(model)
