"""Image-text models (Qwen2.5-VL, Qwen3-VL, Gemma 3, Llama 4): the language model and the loss are fused,
the vision tower and projector are left exactly as they are.

Text-only training, eval logits, gradient accumulation and unpatch run for these models in the
shared parametrized tests (test_transformers_convergence.py, test_transformers_patching.py, via
FAMILY_CONFIGS / VARIANTS). Here: batches with a tiny image through the vision tower, which for
Qwen gives the text tokens distinct temporal/height/width mRoPE positions, and the parts of the
shared tests that are only parametrized over FAMILIES, for the gemma3_vl and llama4_vl variants.
"""

from __future__ import annotations

import pytest
import torch
from test_rope import check_against_reference, make_qk
from tolerances import assert_close

transformers = pytest.importorskip("transformers")

from test_transformers_convergence import (  # noqa: E402
    _assert_grads_close,
    _patched,
    kernel_calls,  # noqa: F401 - fixture
)
from test_transformers_convergence import (  # noqa: E402
    test_gradient_accumulation_with_num_items_matches_one_big_batch as _gradient_accumulation_matches,
)
from test_transformers_patching import (  # noqa: E402
    _collect_dead_patched_models,  # noqa: F401 - autouse fixture: earlier tests' patched models
)
from test_transformers_patching import (  # noqa: E402
    test_patch_keeps_weights_and_unpatch_restores_bit_exact_behaviour as _unpatch_restores,
)
from test_transformers_tiny_models import (  # noqa: E402
    DEVICE,
    MULTIMODAL,
    MOE_FAMILIES,
    ROPE_LAYERS,
    family_of,
    single_thread,  # noqa: F401 - autouse fixture
    skip_if_unpatched_forward_fails,
    synthetic_batches,
    tiny_model,
)

from fuseforge.transformers import apply_kernels, unpatch  # noqa: E402
from fuseforge.transformers._swap import is_fused  # noqa: E402
from fuseforge.transformers.families import family_for_model_type  # noqa: E402

FP32 = torch.float32
STEPS = 3
IMAGE_AT = 3  # first position of each row's image block


def _image_batch(model) -> dict:
    """synthetic_batches(1) with one tiny image per row, laid out as the model's processor would."""
    batch = synthetic_batches(1)[0]
    config = model.config
    rows = batch["input_ids"].shape[0]
    if config.model_type in ("gemma3", "llama4"):
        vision = config.vision_config
        pixels = torch.randn(rows, vision.num_channels, vision.image_size, vision.image_size)
        if config.model_type == "gemma3":
            block = [config.image_token_index] * config.mm_tokens_per_image
            type_key = "token_type_ids"  # bidirectional attention within the image block
        else:  # one token per 2x2 patches after the pixel shuffle
            patches = (vision.image_size // vision.patch_size) ** 2
            block = [config.image_token_index] * int(patches * vision.pixel_shuffle_ratio**2)
            type_key = None
        extra = {"pixel_values": pixels}
    else:  # Qwen2.5-VL / Qwen3-VL: 4x4 patches, merged 2x2 into 4 image tokens
        vision = config.vision_config
        grid = torch.tensor([[1, 4, 4]] * rows)
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.randn(int(grid.prod(-1).sum()), patch)
        tokens = int(grid[0].prod()) // vision.spatial_merge_size**2
        block = [config.vision_start_token_id, *[config.image_token_id] * tokens, config.vision_end_token_id]
        extra = {"pixel_values": pixels, "image_grid_thw": grid}
        type_key = "mm_token_type_ids"
    image_token = config.image_token_id if type_key == "mm_token_type_ids" else config.image_token_index
    span = slice(IMAGE_AT, IMAGE_AT + len(block))
    batch["input_ids"][:, span] = torch.tensor(block)
    batch["labels"][:, : span.stop] = -100  # no loss on the prompt and image block, as SFT collators do
    if type_key is not None:
        extra[type_key] = (batch["input_ids"] == image_token).long()
    return {**batch, **{k: v.to(DEVICE) for k, v in extra.items()}}


def _live_projector(model):
    """Gemma 3 initialises its projector weight to zeros (images would not reach the text); give it values."""
    for module in model.modules():
        if hasattr(module, "mm_input_projection_weight"):
            with torch.no_grad():
                module.mm_input_projection_weight.normal_(std=0.05)
    return model


def _vision_modules(model):
    names = set(family_for_model_type(model.config.model_type).vision_modules)
    return [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_cos_sin_are_exact_through_the_rope_op(name, dtype):
    """mRoPE needs no op of its own: the model's rotary embedding merges the temporal/height/width
    sections (Qwen3-VL interleaved) into [batch, seq, head_dim] cos/sin, which the rope op takes like
    any other (values and gradients against float64)."""
    rotary = tiny_model(name).model.language_model.rotary_emb
    batch, seq = 2, 13  # ragged
    positions = torch.randint(0, 40, (3, batch, seq), device=DEVICE)  # T, H, W differ per token
    x = torch.zeros((), dtype=dtype, device=DEVICE)
    cos, sin = rotary(x, positions)
    text_cos, _ = rotary(x, positions[:1].expand(3, -1, -1))
    assert cos.shape == (batch, seq, 16) and cos.dtype == dtype
    assert not torch.equal(cos, text_cos)  # the H and W sections moved cos/sin away from the T positions
    q, k = make_qk(batch, seq, 4, 2, 16, dtype, DEVICE)
    check_against_reference(q, k, cos, sin, dtype)


@pytest.mark.parametrize("name", MULTIMODAL)
def test_vision_side_is_left_as_is_and_named_in_the_report(name):
    model = tiny_model(name)
    vision = _vision_modules(model)
    assert vision, "the tiny model has a vision tower"
    report = apply_kernels(model)
    assert report.family == family_of(name)
    assert not [m for v in vision for m in v.modules() if is_fused(m)]
    for v in vision:
        assert any(type(v).__name__ in note and "left as it is" in note for note in report.notes)
    # The language model is fused: its norms, and the loss of the image-text class.
    assert report.patched["rms_norm"] and report.patched["rope"] and report.patched["swiglu"]
    assert report.patched["fused_linear_cross_entropy"] == {f"{type(model).__name__} (lm_head)": 1}
    assert "left as it is" in report.summary()
    assert type(model.get_output_embeddings()).__name__ == "FusedLinear"
    unpatch(model)


@pytest.mark.parametrize("name", MULTIMODAL)
def test_image_batches_train_like_the_unpatched_model(name, kernel_calls):
    """Images through the (unfused) vision tower into the fused language model: same losses and gradients."""
    skip_if_unpatched_forward_fails(name)
    experts = {"experts_implementation": "eager"} if name in MOE_FAMILIES else {}
    ref = _live_projector(tiny_model(name, **experts)).train()
    fused = _patched(ref).train()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=1e-6)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=3e-3, eps=1e-6)
    for step in range(STEPS):
        batch = _image_batch(ref)
        out_ref, out_fused = ref(**batch), fused(**batch)
        assert out_fused.logits is None
        assert_close(out_fused.loss, out_ref.loss, FP32, msg=lambda d: f"step {step} loss\n{d}")
        out_ref.loss.backward()
        out_fused.loss.backward()
        if step == 0:
            vision = _vision_modules(ref)[0]  # the image reached the loss through the tower
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision.parameters())
            _assert_grads_close(fused, ref, what=f"{name} image batch: ")
            layers = ROPE_LAYERS.get(name, ref.config.get_text_config().num_hidden_layers)
            assert kernel_calls["rope"] == layers and kernel_calls["fused_linear_cross_entropy"] == 1
        for opt in (opt_ref, opt_fused):
            opt.step()
            opt.zero_grad(set_to_none=True)
    if name.startswith("qwen"):  # the image gave the text tokens mRoPE positions that differ per section
        assert (fused.model.rope_deltas != 0).any()


@pytest.mark.parametrize("name", ["gemma3_vl", "llama4_vl"])
def test_image_text_variant_gradient_accumulation_matches_one_big_batch(name):
    skip_if_unpatched_forward_fails(name)
    _gradient_accumulation_matches(name)


@pytest.mark.parametrize("name", ["gemma3_vl", "llama4_vl"])
def test_image_text_variant_unpatch_restores_bit_exact_behaviour(name):
    skip_if_unpatched_forward_fails(name)
    _unpatch_restores(name)
