"""Tiny models of every supported family, a learnable synthetic data set, and recognition checks.

The helpers here are shared by the other test_transformers_* files. The tests check,
without running any kernel, that on the installed transformers every supported
family is recognised completely: each norm, MLP/experts block, attention RoPE and
causal-LM head gets its fused replacement and nothing is reported as skipped.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fuseforge.transformers import SUPPORTED_MODEL_TYPES, apply_kernels, unpatch  # noqa: E402
from fuseforge.transformers.families import FAMILIES as FAMILY_TABLE  # noqa: E402
from fuseforge.transformers.families import fused_table  # noqa: E402

# Where models and batches live: the GPU when there is one (kernels compiled), else the CPU
# (kernels interpreted; conftest sets TRITON_INTERPRET=1 under the same condition).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 999  # not a power of two: exercises the vocabulary tail of the loss kernels
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILY_CONFIGS = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral"),
    "mixtral": dict(
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,  # the router aux loss must be added to the fused loss
        router_aux_loss_coef=0.05,
        router_jitter_noise=0.0,
    ),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    # A small final-logit softcap makes softcapping change the loss by far more than the tolerance.
    "gemma2": dict(model_type="gemma2", head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=0.5),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=16,
        query_pre_attn_scalar=16,
        final_logit_softcapping=0.5,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5),  # RoPE on half of each head
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        output_router_logits=True,  # the router aux loss must be added to the fused loss
        router_aux_loss_coef=0.05,
    ),
    "gemma": dict(model_type="gemma", head_dim=16),
    # Every multiplier away from 1, so that dropping any of them changes the loss by far more than the tolerance.
    "granite": dict(
        model_type="granite",
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=4.0,
    ),
    "smollm3": dict(model_type="smollm3", no_rope_layer_interval=2),  # layer 1 is a NoPE layer
    "olmo2": dict(model_type="olmo2"),
    "olmo3": dict(model_type="olmo3", sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "glm4": dict(model_type="glm4", head_dim=16),
    # RoPE only on sliding layers when a sliding window is set
    "exaone4": dict(model_type="exaone4", sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # Layer 0 dense, layer 1 MoE (4 routed experts, top-2, one shared expert). MLA: q and kv latents with
    # their own norms, RoPE on 8 of each head's 16 q/k dims; rope_interleave=True (the checkpoints' setting,
    # layout "interleaved_to_half"); the "deepseek_v3_rotate_half" variant turns it off.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        num_key_value_heads=4,  # MLA expands k/v to every head
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        rope_interleave=True,
    ),
    # Layer 0 dense with RoPE and chunked attention (chunks of 8: several per 24-token row), layer 1 MoE
    # (4 experts, top-1, shared expert) and NoPE (no_rope_layers[i] = 1 means layer i *uses* RoPE), where a
    # small floor_scale makes the attention temperature tuning vary with position.
    "llama4": dict(
        model_type="llama4_text",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size=64,  # the experts' and the shared expert's
        intermediate_size_mlp=128,  # the dense layers'
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 0],
        attention_chunk_size=8,
        floor_scale=4,
    ),
    # Attention sinks, biases everywhere, YaRN RoPE (cos/sin scaled by its attention factor). swiglu_limit far
    # below the default 7 so that the experts' clamp cuts values (and their gradients) in training; transformers
    # 5.17 ignores it (hard-coded limit 7), 5.2x reads it.
    "gpt_oss": dict(
        model_type="gpt_oss",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=2.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=32,
        ),
        output_router_logits=True,  # the router aux loss must be added to the fused loss
        router_aux_loss_coef=0.05,
        swiglu_limit=0.5,  # clamps some gate/up values, few near the bound (the clamp itself: test_clamped_swiglu)
    ),
    # Three layers, to cover every per-layer kind: sliding (head_dim 16, default RoPE), full (head_dim 32,
    # proportional RoPE on a quarter of it, keys as values, one KV head), and a full layer that reuses the
    # previous one's keys/values (KV sharing: no k/v projections or norms) with a double-wide MLP; per-layer
    # embeddings (PLE) feed every layer. Gemma 4's attention has scale 1 on q/k norms of unit RMS, which makes
    # this tiny model chaotic (a 1-ulp change of its weights moves the loss by 1e-3 within 10 AdamW steps,
    # unpatched); rms_norm_eps=0.1 shrinks the untrained q/k norms' outputs and keeps training reproducible.
    "gemma4": dict(
        model_type="gemma4_text",
        rms_norm_eps=0.1,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        head_dim=16,
        global_head_dim=32,
        sliding_window=8,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        num_kv_shared_layers=1,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=0.5,
    ),
    # Image-text models: COMMON sizes text_config; the vision tower is tiny (test_transformers_multimodal.py
    # runs images through it). mRoPE sections (T, H, W) sum to head_dim / 2 = 8.
    "qwen2_5_vl": dict(
        model_type="qwen2_5_vl",
        text_config=dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
        ),
        image_token_id=990, video_token_id=991, vision_start_token_id=992, vision_end_token_id=993,
    ),
    "qwen3_vl": dict(
        model_type="qwen3_vl",
        text_config=dict(
            head_dim=16,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True
            ),
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0],
        ),
        image_token_id=990, video_token_id=991, vision_start_token_id=992, vision_end_token_id=993,
    ),
}
FAMILIES = tuple(FAMILY_CONFIGS)
# Checkpoints that ship under another family's model_type: name -> (family, config overrides).
# Phi-4 (microsoft/phi-4, Phi-4-mini) is model_type "phi3"; Phi-4-mini's shape: GQA, rotary on 3/4 of
# each head (Dr/2 = 6 here, not a power of two), tied embeddings, LongRoPE scaling with an original
# context shorter than max_position_embeddings (so cos/sin carry an attention factor != 1).
VARIANTS = {
    "phi4": (
        "phi3",
        dict(
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,
                factor=2.0,
                original_max_position_embeddings=32,
                short_factor=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                long_factor=[1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
            ),
        ),
    ),
}
# Gemma 3's image-text model (model_type "gemma3", Gemma3ForConditionalGeneration): the gemma3_text
# spec (softcap 0.5 included, which this class's forward does not apply) inside a composite config.
VARIANTS["gemma3_vl"] = (
    "gemma3",
    dict(
        model_type="gemma3",
        text_config=FAMILY_CONFIGS["gemma3"],
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, image_size=16, patch_size=4,
        ),
        mm_tokens_per_image=4, boi_token_index=994, eoi_token_index=995, image_token_index=996,
    ),
)
# DeepSeek-V3 with rope_interleave=False: MLA through the plain (rotate-half) apply_rotary_pos_emb.
VARIANTS["deepseek_v3_rotate_half"] = ("deepseek_v3", dict(rope_interleave=False))
# Llama 4's image-text model (model_type "llama4", Llama4ForConditionalGeneration, which holds a
# Llama4ForCausalLM): the llama4_text spec inside a composite config. 16x16 images, 4x4 patches,
# pixel shuffle 0.5: 4 image tokens.
VARIANTS["llama4_vl"] = (
    "llama4",
    dict(
        model_type="llama4",
        text_config=FAMILY_CONFIGS["llama4"],
        vision_config=dict(
            hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=16,
            patch_size=4, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64,
            pixel_shuffle_ratio=0.5,
        ),
        boi_token_index=994, eoi_token_index=995, image_token_index=996,
    ),
)
FAMILIES_AND_VARIANTS = FAMILIES + tuple(VARIANTS)
MULTIMODAL = ("qwen2_5_vl", "qwen3_vl", "gemma3_vl", "llama4_vl")  # built with AutoModelForImageTextToText
# Experts run eager in the tests; the router aux loss is checked in the loss where FAMILY_TABLE says the
# family's forward adds one (not DeepSeek-V3's nor Llama 4's).
MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v3_rotate_half", "llama4", "llama4_vl")
# Gated MLPs patched per model where that is not one per layer: the dense layer's MLP, and the MoE
# layer's shared expert(s) and experts.
GATED_MLPS = {"deepseek_v3": 3, "llama4": 3}
# Experts that run every token through every expert in batched matmuls: one fused gate call per MoE layer.
BATCHED_EXPERTS = ("llama4", "llama4_vl")
# rms_norm calls per forward beyond one per patched norm: Llama 4's qk-norm module normalises q and k.
SHARED_NORM_CALLS = {"llama4": 1, "llama4_vl": 1}
# Norms per decoder layer (the model adds one final norm): input/post-attention, plus q/k norms
# and Gemma's / OLMo's / GLM-4's / EXAONE's extra pre/post norms.
NORMS_PER_LAYER = {
    **dict.fromkeys(("gemma2", "qwen3", "qwen3_moe", "olmo2", "olmo3", "glm4", "exaone4", "qwen3_vl"), 4),
    "deepseek_v3": 4,  # plus MLA's q and kv latent norms
    "gemma3": 6,
}
# Families whose layers differ in norm count, by total. Gemma 4: 8 per layer (4 around attention/MLP, q/k/v
# norms, the per-layer-input norm), minus k/v norms on the KV-shared layer, plus the final norm and PLE's norm.
NORMS_TOTAL = {"gemma4": 3 * 8 - 2 + 2}
NORMS_TOTAL["llama4"] = 2 * 2 + 1 + 1  # two per layer, the final norm, the RoPE layer's L2 qk-norm
# Layers whose attention applies RoPE (NoPE layers keep the patched attention but never call it), as calls
# of the rope kernel: Gemma 4 rotates q and k in separate calls, q only on its KV-shared layer.
# Families whose decoder layers are HF's Llama-style pre-norm or Gemma 2/3's sandwich-norm layer: the residual
# add before the MLP's norm runs in its kernel (fingerprints in fuseforge.transformers.layers). Others keep HF's add.
RESIDUAL_FUSED_DECODER_LAYERS = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3", "smollm3",
    "deepseek_v3", "deepseek_v3_rotate_half", "qwen2_5_vl", "qwen3_vl", "gemma3_vl",
)
ROPE_LAYERS = {"smollm3": 1, "exaone4": 1, "gemma4": 2 + 2 + 1, "llama4": 1, "llama4_vl": 1}


def family_of(name: str) -> str:
    """The supported family a tiny-model name (family or VARIANTS entry) patches as."""
    return VARIANTS[name][0] if name in VARIANTS else name


def skip_if_unpatched_forward_fails(name: str) -> None:
    """transformers 5.2x's Llama4ForConditionalGeneration.forward reads `outputs.image_outputs` off its
    language model's output, which has none: an AttributeError with return_dict=True, patched or not."""
    if name != "llama4_vl":
        return
    from transformers.models.llama4.modeling_llama4 import Llama4ForConditionalGeneration

    if "outputs.image_outputs" in inspect.getsource(Llama4ForConditionalGeneration.forward):
        pytest.skip(f"transformers {transformers.__version__}: Llama4ForConditionalGeneration.forward fails unpatched")


def tiny_config(family: str, **overrides):
    variant = {}
    if family in VARIANTS:
        family, variant = VARIANTS[family]
    # An image-text variant is a whole composite spec; COMMON then sizes its text_config.
    spec = {**(FAMILY_CONFIGS[family] if "text_config" not in variant else {}), **variant, **overrides}
    if "text_config" in spec:
        text = {k: v for k, v in spec["text_config"].items() if k != "model_type"}
        spec["text_config"] = {**COMMON, **text}
    else:
        spec = {**COMMON, **spec}
    return transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)


def tiny_model(family: str, *, experts_implementation: str | None = None, **overrides):
    """A seeded-init fp32 model from a config on DEVICE (uses the global RNG, seeded by conftest)."""
    kwargs = dict(attn_implementation="eager")
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tiny_config(family, **overrides)
        image_text = getattr(config, "vision_config", None) is not None
        auto = transformers.AutoModelForImageTextToText if image_text else transformers.AutoModelForCausalLM
        model = auto.from_config(config, **kwargs)
    return model.to(DEVICE)


def synthetic_batches(n_batches: int, batch_size: int = 2, seq: int = 24, span: int = 61):
    """Learnable sequences: each row counts up through `span` token ids from a random start, stride 1-3.

    The ids stay in a small part of the vocabulary, so a few steps already lower the loss.

    Like SFT data: the first 3-6 tokens are the "prompt" (labels -100) and the last row of
    each batch is right-padded (pad id 0, attention_mask 0, labels -100).
    """
    out = []
    for _ in range(n_batches):
        start = torch.randint(0, span, (batch_size, 1))
        stride = torch.randint(1, 4, (batch_size, 1))
        input_ids = 3 + (start + stride * torch.arange(seq)) % span
        labels = input_ids.clone()
        attention_mask = torch.ones_like(input_ids)
        for row in range(batch_size):
            labels[row, : int(torch.randint(3, 7, ()))] = -100
        pad = int(torch.randint(2, seq // 3, ()))
        input_ids[-1, -pad:] = 0
        attention_mask[-1, -pad:] = 0
        labels[-1, -pad:] = -100
        batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        out.append({k: v.to(DEVICE) for k, v in batch.items()})
    return out


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny tensors: torch's intra-op threads only spin (and, on a shared 2-core CI, cost 5-10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fused_decoder_layers(report) -> int:
    """Decoder layers whose residual add the patch moved into a norm (listed under rms_norm)."""
    return sum(n for label, n in report.patched["rms_norm"].items() if "DecoderLayer" in label)


def patched_copy(model, **flags):
    """A deep copy of `model` (same weights), patched; warnings are the caller's business."""
    clone = copy.deepcopy(model)
    report = apply_kernels(clone, **flags)
    return clone, report


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES_AND_VARIANTS)
def test_every_module_of_a_supported_family_is_recognised(name):
    model = tiny_model(name)
    family = family_of(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported family must patch without any warning
        report = apply_kernels(model)
    assert report.supported and report.family == family
    unfused = dict(FAMILY_TABLE[family].unfused)  # what the kernels cannot do for this family
    assert report.skipped == {kernel: [reason] for kernel, reason in unfused.items()}
    layers = model.config.get_text_config().num_hidden_layers
    norms = NORMS_TOTAL.get(family, NORMS_PER_LAYER.get(family, 2) * layers + 1)
    decoder_layers = fused_decoder_layers(report)
    assert sum(report.patched["rms_norm"].values()) - decoder_layers == norms
    assert decoder_layers == (layers if name in RESIDUAL_FUSED_DECODER_LAYERS else 0), report
    if "rope" in unfused:
        assert "rope" not in report.patched
        assert f"rope: NOT patched: {unfused['rope']}" in report.summary()
    else:
        assert sum(report.patched["rope"].values()) == layers
    assert sum(report.patched["swiglu"].values()) == GATED_MLPS.get(family, layers)
    assert report.patched["fused_linear_cross_entropy"] == {f"{type(model).__name__} (lm_head)": 1}
    expected_glu = dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma4"), "geglu tanh").get(family, "swiglu")
    labels = list(report.patched["swiglu"])
    if family in MOE_FAMILIES:  # the experts, and in some families dense / shared-expert MLPs
        assert any("experts" in label for label in labels)
        labels = [label for label in labels if "experts" not in label]
    assert all(expected_glu in label for label in labels)
    assert "cross_entropy" not in report.patched  # off by default
    head = model.get_output_embeddings()  # Llama 4's image-text model: its language model's lm_head
    assert type(head).__name__ == "FusedLinear"
    if model.config.tie_word_embeddings:  # Phi-4: the fused head still shares the embedding's weight
        assert head.weight is model.get_input_embeddings().weight
    unpatch(model)


def test_glm4_rope_is_fused_with_interleaved_pairs():
    """GLM-4's interleaved-pair apply_rotary_pos_emb is recognised, fused, and named in the report."""
    model = tiny_model("glm4")
    report = apply_kernels(model)
    labels = list(report.patched["rope"])
    assert labels and all("modeling_glm4.apply_rotary_pos_emb, interleaved pairs" in label for label in labels)
    assert "rope: NOT patched" not in report.summary()
    unpatch(model)


@pytest.mark.parametrize(
    "name,label",
    [
        # MLA calls one of two RoPE globals, per config.rope_interleave: both are fused.
        (
            "deepseek_v3",
            "DeepseekV3Attention (modeling_deepseek_v3.apply_rotary_pos_emb; "
            "modeling_deepseek_v3.apply_rotary_pos_emb_interleave, interleaved pairs to halves)",
        ),
        ("llama4", "Llama4TextAttention (modeling_llama4.apply_rotary_emb, interleaved pairs)"),
    ],
)
def test_rope_sites_other_than_apply_rotary_pos_emb_are_named_in_the_report(name, label):
    model = tiny_model(name)
    report = apply_kernels(model)
    assert report.patched["rope"] == {label: model.config.num_hidden_layers}
    unpatch(model)


def test_supported_model_types_cover_every_family():
    types_ = {tiny_config(f).model_type for f in FAMILIES}
    assert types_ <= set(SUPPORTED_MODEL_TYPES)
    assert set(FAMILIES) == set(FAMILY_TABLE)  # every supported family has a tiny model in these tests


def test_the_docs_table_of_supported_models_is_the_family_table():
    """The docs' table (docs/kernels/patching.md) is families.fused_table() verbatim: one source of truth."""
    from docs_text import page

    assert fused_table() in page("kernels/patching.md"), "the supported-models table is stale: paste families.fused_table()"


def test_synthetic_batches_are_learnable_and_masked():
    batches = synthetic_batches(2)
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape == (2, 24)
        assert (b["labels"] == -100).any(dim=1).all()
        assert (b["attention_mask"][-1] == 0).any() and (b["attention_mask"][0] == 1).all()
        ids = b["input_ids"][0]
        assert len(set((ids[1:] - ids[:-1]).remainder(61).tolist())) == 1  # one stride per row
