"""Tiny models of every supported family, a learnable synthetic data set, and recognition checks.

The helpers here are shared by the other test_transformers_* files. The tests check,
without running any kernel, that on the installed transformers every supported
family is recognised completely: each norm, MLP/experts block, attention RoPE and
causal-LM head gets its fused replacement and nothing is reported as skipped.
"""

from __future__ import annotations

import copy
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
FAMILIES_AND_VARIANTS = FAMILIES + tuple(VARIANTS)
MOE_FAMILIES = ("mixtral", "qwen3_moe")  # router aux loss in the loss; experts run eager in the tests
# Norms per decoder layer (the model adds one final norm): input/post-attention, plus q/k norms
# and Gemma's / OLMo's / GLM-4's / EXAONE's extra pre/post norms.
NORMS_PER_LAYER = {
    **dict.fromkeys(("gemma2", "qwen3", "qwen3_moe", "olmo2", "olmo3", "glm4", "exaone4"), 4),
    "gemma3": 6,
}
# Layers whose attention applies RoPE (NoPE layers keep the patched attention but never call it).
ROPE_LAYERS = {"smollm3": 1, "exaone4": 1}


def family_of(name: str) -> str:
    """The supported family a tiny-model name (family or VARIANTS entry) patches as."""
    return VARIANTS[name][0] if name in VARIANTS else name


def tiny_config(family: str, **overrides):
    if family in VARIANTS:
        family, variant = VARIANTS[family]
        overrides = {**variant, **overrides}
    spec = {**COMMON, **FAMILY_CONFIGS[family], **overrides}
    return transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)


def tiny_model(family: str, *, experts_implementation: str | None = None, **overrides):
    """A seeded-init fp32 model from a config on DEVICE (uses the global RNG, seeded by conftest)."""
    kwargs = dict(attn_implementation="eager")
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), **kwargs)
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
    layers = model.config.num_hidden_layers
    assert sum(report.patched["rms_norm"].values()) == NORMS_PER_LAYER.get(family, 2) * layers + 1
    if "rope" in unfused:
        assert "rope" not in report.patched
        assert f"rope: NOT patched: {unfused['rope']}" in report.summary()
    else:
        assert sum(report.patched["rope"].values()) == layers
    assert sum(report.patched["swiglu"].values()) == layers
    assert report.patched["fused_linear_cross_entropy"] == {f"{type(model).__name__} (lm_head)": 1}
    expected_glu = {"gemma": "geglu tanh", "gemma2": "geglu tanh", "gemma3": "geglu tanh"}.get(family, "swiglu")
    expected_glu = "experts" if family in MOE_FAMILIES else expected_glu
    assert all(expected_glu in label for label in report.patched["swiglu"])
    assert "cross_entropy" not in report.patched  # off by default
    assert type(model.lm_head).__name__ == "FusedLinear"
    if model.config.tie_word_embeddings:  # Phi-4: the fused head still shares the embedding's weight
        assert model.lm_head.weight is model.get_input_embeddings().weight
    unpatch(model)


def test_glm4_rope_is_fused_with_interleaved_pairs():
    """GLM-4's interleaved-pair apply_rotary_pos_emb is recognised, fused, and named in the report."""
    model = tiny_model("glm4")
    report = apply_kernels(model)
    labels = list(report.patched["rope"])
    assert labels and all("modeling_glm4.apply_rotary_pos_emb, interleaved pairs" in label for label in labels)
    assert "rope: NOT patched" not in report.summary()
    unpatch(model)


def test_supported_model_types_cover_every_family():
    types_ = {tiny_config(f).model_type for f in FAMILIES}
    assert types_ <= set(SUPPORTED_MODEL_TYPES)
    assert set(FAMILIES) == set(FAMILY_TABLE)  # every supported family has a tiny model in these tests


def test_readme_table_of_supported_models_is_the_family_table():
    """The README's table is families.fused_table() verbatim: one source of truth."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert fused_table() in readme, "README's supported-models table is stale: paste families.fused_table()"


def test_synthetic_batches_are_learnable_and_masked():
    batches = synthetic_batches(2)
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape == (2, 24)
        assert (b["labels"] == -100).any(dim=1).all()
        assert (b["attention_mask"][-1] == 0).any() and (b["attention_mask"][0] == 1).all()
        ids = b["input_ids"][0]
        assert len(set((ids[1:] - ids[:-1]).remainder(61).tolist())) == 1  # one stride per row
