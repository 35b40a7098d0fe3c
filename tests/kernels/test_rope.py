"""fuseforge.functional.rope against a float64 rendering of Hugging Face's RoPE formula."""

import pytest
import torch
from tolerances import assert_close

import fuseforge.ops.rope as rope_module
from fuseforge.functional import rope

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rope_reference(q, k, cos, sin, unsqueeze_dim=1, layout="rotate_half"):
    """HF's formula in float64: x_rot * cos + rotate_half(x_rot) * sin, the rest passed through.

    layout="interleaved" is GLM-4's: cos/sin[..., :Dr/2] repeat-interleaved, and rotate_half
    turning each pair (x[2i], x[2i+1]) into (-x[2i+1], x[2i]). layout="interleaved_to_half" is
    DeepSeek-V3's: the rotary dims de-interleaved (x[0::2], then x[1::2]), then Llama's formula
    with cos/sin[..., :Dr/2] for both halves.
    """
    cos = cos.double().unsqueeze(unsqueeze_dim)
    sin = sin.double().unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    if layout == "interleaved":
        cos = cos[..., :half].repeat_interleave(2, dim=-1)
        sin = sin[..., :half].repeat_interleave(2, dim=-1)
    elif layout == "interleaved_to_half":
        cos = torch.cat((cos[..., :half], cos[..., :half]), dim=-1)
        sin = torch.cat((sin[..., :half], sin[..., :half]), dim=-1)

    def rotate(rot):
        if layout == "interleaved":
            return torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)

    def apply(x):
        x = x.double()
        rot, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        if layout == "interleaved_to_half":
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        return torch.cat((rot * cos + rotate(rot) * sin, passed), dim=-1)

    return apply(q), apply(k)


def make_qk(batch, seq, q_heads, k_heads, head_dim, dtype, device, layout="hf"):
    """q/k as HF builds them: a [B, T, H, D] projection output viewed as [B, H, T, D] ("hf"), the same
    sliced out of a fused qkv projection ("fused_qkv", Phi-3), plain contiguous [B, H, T, D]
    ("contiguous"), or [B, T, H, D] for unsqueeze_dim=2 ("bthd")."""

    def one(heads):
        if layout == "contiguous":
            x = torch.randn(batch, heads, seq, head_dim, device=device)
        else:
            extra = 3 if layout == "fused_qkv" else 0
            x = torch.randn(batch, seq, (heads + extra) * head_dim, device=device)[..., : heads * head_dim]
            x = x.view(batch, seq, heads, head_dim)
            if layout in ("hf", "fused_qkv"):
                x = x.transpose(1, 2)
        return x.to(dtype).requires_grad_()

    return one(q_heads), one(k_heads)


def make_cos_sin(cos_batch, seq, rotary_dim, dtype, device):
    # Independent random halves (unlike HF's duplicated ones) so a mixed-up half cannot pass.
    cos = torch.randn(cos_batch, seq, rotary_dim, device=device).to(dtype)
    sin = torch.randn(cos_batch, seq, rotary_dim, device=device).to(dtype)
    return cos, sin


def check_against_reference(q, k, cos, sin, dtype, unsqueeze_dim=1, layout="rotate_half"):
    q_before, k_before = q.detach().clone(), k.detach().clone()
    q_out, k_out = rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, layout=layout)
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    q_ref, k_ref = rope_reference(q64, k64, cos, sin, unsqueeze_dim, layout)
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert_close(q_out, q_ref, dtype, msg="q_out")
    assert_close(k_out, k_ref, dtype, msg="k_out")

    grad_q, grad_k = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (grad_q, grad_k))
    dq_ref, dk_ref = torch.autograd.grad((q_ref, k_ref), (q64, k64), (grad_q.double(), grad_k.double()))
    assert_close(dq, dq_ref, dtype, msg="grad q")
    assert_close(dk, dk_ref, dtype, msg="grad k")
    assert torch.equal(q.detach(), q_before) and torch.equal(k.detach(), k_before), "inputs were modified"
    return q_out, k_out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "head_dim,rotary_dim", [(64, 64), (80, 80), (96, 96), (64, 32), (80, 48), (96, 40)], ids=lambda v: str(v)
)
def test_head_dims_and_partial_rotary(device, dtype, head_dim, rotary_dim):
    q, k = make_qk(2, 7, 4, 2, head_dim, dtype, device)
    cos, sin = make_cos_sin(1, 7, rotary_dim, dtype, device)
    check_against_reference(q, k, cos, sin, dtype)


@pytest.mark.parametrize("q_heads,k_heads", [(4, 2), (4, 4), (4, 1), (6, 3)])
@pytest.mark.parametrize("cos_batch", ["broadcast", "per_batch"])
def test_gqa_and_cos_batch(device, q_heads, k_heads, cos_batch):
    batch = 3
    q, k = make_qk(batch, 5, q_heads, k_heads, 80, torch.float32, device)
    cos, sin = make_cos_sin(1 if cos_batch == "broadcast" else batch, 5, 64, torch.float32, device)
    check_against_reference(q, k, cos, sin, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "layout,unsqueeze_dim", [("contiguous", 1), ("fused_qkv", 1), ("bthd", 2), ("bthd", -2), ("hf", -3)]
)
def test_layouts(device, dtype, layout, unsqueeze_dim):
    q, k = make_qk(2, 6, 4, 2, 96, dtype, device, layout)
    cos, sin = make_cos_sin(2, 6, 64, dtype, device)
    check_against_reference(q, k, cos, sin, dtype, unsqueeze_dim=unsqueeze_dim)


def test_output_keeps_input_memory_layout(device):
    """Like HF's elementwise formula, outputs keep q/k's strides, so attention sees the same layout."""
    q, k = make_qk(2, 5, 4, 2, 64, torch.float32, device, "hf")
    cos, sin = make_cos_sin(1, 5, 64, torch.float32, device)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


def test_strided_cos_sin_and_mixed_dtypes(device):
    """cos/sin as non-contiguous slices, in fp32 while q/k are bf16: outputs stay bf16."""
    q, k = make_qk(2, 5, 4, 2, 64, torch.bfloat16, device)
    cos_sin = torch.randn(2, 5, 2 * 48, device=device)
    cos, sin = cos_sin[..., :48], cos_sin[..., 48:]
    assert not cos.is_contiguous()
    q_out, _ = check_against_reference(q, k, cos, sin, torch.bfloat16)
    assert q_out.dtype == torch.bfloat16


def test_strided_head_dim_and_cos_sin_of_different_layouts(device):
    """The kernel takes no last-dim strides and one layout for cos and sin: q/k whose head dim is strided,
    sin laid out unlike cos and cos with a strided last dim are copied first, with the same results."""
    q = torch.randn(2, 4, 5, 2 * 64, device=device)[..., ::2].requires_grad_()
    k = torch.randn(2, 2, 5, 3 * 64, device=device)[..., ::3].requires_grad_()
    cos = torch.randn(1, 5, 2 * 48, device=device)[..., ::2]
    sin = torch.randn(1, 48, 5, device=device).transpose(1, 2)
    assert q.stride(-1) == 2 and k.stride(-1) == 3 and cos.stride(-1) == 2 and sin.stride() != cos.stride()
    check_against_reference(q, k, cos, sin, torch.float32)


@pytest.mark.parametrize("tile", [64, 512])
def test_launch_tiling_does_not_change_results(device, monkeypatch, tile):
    """Small tiles force several programs, partial token blocks and the head loop with a masked tail."""
    monkeypatch.setattr(rope_module, "_INTERPRETER_TILE", tile)
    monkeypatch.setattr(rope_module, "_GPU_TILE", tile)
    q, k = make_qk(3, 5, 6, 3, 64, torch.float32, device)
    cos, sin = make_cos_sin(3, 5, 64, torch.float32, device)
    check_against_reference(q, k, cos, sin, torch.float32)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_matches_transformers_apply_rotary_pos_emb(device, family):
    """Real HF cos/sin (Phi-3 with partial_rotary_factor=0.5) against HF's own function."""
    if family == "llama":
        from transformers import LlamaConfig as Config
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        config = Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    else:
        from transformers import Phi3Config as Config
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as Rotary
        from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
        config = Config(hidden_size=160, num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5)
    head_dim = config.hidden_size // config.num_attention_heads
    q, k = make_qk(2, 9, config.num_attention_heads, config.num_key_value_heads, head_dim, torch.float32, device)
    position_ids = torch.arange(3, 12, device=device).expand(2, -1)
    cos, sin = Rotary(config).to(device)(q, position_ids)
    q_out, k_out = rope(q, k, cos, sin)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    assert_close(q_out, q_hf, torch.float32)
    assert_close(k_out, k_hf, torch.float32)
    grads = torch.randn_like(q_out), torch.randn_like(k_out)
    for ours, theirs in zip(
        torch.autograd.grad((q_out, k_out), (q, k), grads), torch.autograd.grad((q_hf, k_hf), (q, k), grads)
    ):
        assert_close(ours, theirs, torch.float32)


def test_gradcheck_float64(device):
    q = torch.randn(1, 2, 2, 6, dtype=torch.float64, device=device).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 1, 2, 6, dtype=torch.float64, device=device, requires_grad=True)
    cos, sin = make_cos_sin(1, 2, 4, torch.float64, device)
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k, cos, sin), (q, k), fast_mode=True)


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved", "interleaved_to_half"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_broadcast_gradients_and_cos_sin_gradients(device, layout, unsqueeze_dim):
    """.sum() hands backward stride-0 gradients; cos/sin that require a gradient get torch's, summed over heads
    and the broadcast batch, in their own dtype (partial rotary: 48 of 64 dims)."""
    q, k = make_qk(2, 3, 2, 1, 64, torch.float32, device, layout="bthd" if unsqueeze_dim == 2 else "hf")
    cos, sin = make_cos_sin(1, 3, 48, torch.float32, device)
    cos.requires_grad_()
    sin = sin.double().requires_grad_()
    weight = torch.randn(q.shape, device=device)
    q_out, k_out = rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, layout=layout)
    ((q_out * weight).sum() + k_out.sum()).backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    cos64, sin64 = cos.detach().double().requires_grad_(), sin.detach().clone().requires_grad_()
    q_ref, k_ref = rope_reference(q64, k64, cos64, sin64, unsqueeze_dim, layout)
    ((q_ref * weight.double()).sum() + k_ref.sum()).backward()
    assert_close(q.grad, q64.grad, torch.float32)
    assert_close(k.grad, k64.grad, torch.float32)
    assert cos.grad is not None and cos.grad.dtype == torch.float32 and sin.grad.dtype == torch.float64
    assert_close(cos.grad, cos64.grad, torch.float32)
    assert_close(sin.grad, sin64.grad, torch.float32)


def test_cos_sin_without_grad_keep_only_the_fused_backward(device):
    q, k = make_qk(1, 3, 2, 1, 64, torch.float32, device)
    cos, sin = make_cos_sin(1, 3, 64, torch.float32, device)
    q_out, _ = rope(q, k, cos, sin)
    assert len(q_out.grad_fn.saved_tensors) == 2  # cos and sin only: q/k are not kept


def test_empty_sequence(device):
    q, k = make_qk(2, 0, 4, 2, 64, torch.float32, device)
    cos, sin = make_cos_sin(1, 0, 64, torch.float32, device)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape


def _valid(device):
    q = torch.randn(2, 4, 5, 64, device=device)
    k = torch.randn(2, 2, 5, 64, device=device)
    cos, sin = make_cos_sin(1, 5, 64, torch.float32, device)
    return dict(q=q, k=k, cos=cos, sin=sin)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: dict(a, q=a["q"][0]), ValueError, "q must have 4 dimensions"),
        (lambda a: dict(a, k=[1.0]), TypeError, "k must be a torch.Tensor"),
        (lambda a: dict(a, cos=a["cos"][0]), ValueError, "cos must have 3 dimensions"),
        (lambda a: dict(a, q=a["q"].long()), TypeError, "q must have dtype"),
        (lambda a: dict(a, k=a["k"].double()), TypeError, "k has dtype"),
        (lambda a: dict(a, k=a["k"][:1]), ValueError, "must agree in batch"),
        (lambda a: dict(a, k=a["k"][..., :32]), ValueError, "must agree in batch, seq and head_dim"),
        (lambda a: dict(a, k=a["q"][:, :3]), ValueError, "k's 3 heads must divide q's 4"),
        (lambda a: dict(a, sin=a["sin"][..., :32]), ValueError, "cos .* and sin .* must have the same shape"),
        (lambda a: dict(a, cos=a["cos"].expand(3, -1, -1), sin=a["sin"].expand(3, -1, -1)), ValueError, "batch=2"),
        (lambda a: dict(a, cos=a["cos"][:, :4], sin=a["sin"][:, :4]), ValueError, "seq=5"),
        (lambda a: dict(a, cos=a["cos"][..., :31], sin=a["sin"][..., :31]), ValueError, "must be even"),
        (
            lambda a: dict(a, cos=a["q"].new_ones(1, 5, 66), sin=a["q"].new_ones(1, 5, 66)),
            ValueError,
            "rotary_dim=66",
        ),
        (lambda a: dict(a, unsqueeze_dim=3), ValueError, "unsqueeze_dim must be 1"),
        (lambda a: dict(a, unsqueeze_dim=1.0), TypeError, "unsqueeze_dim must be an int"),
        (
            lambda a: dict(a, layout="pairs"),
            ValueError,
            r"one of \('rotate_half', 'interleaved', 'interleaved_to_half'\), got 'pairs'",
        ),
        (lambda a: dict(a, layout=None), ValueError, "layout must be one of"),
        (
            lambda a: dict(a, cos=a["cos"][..., :31], sin=a["sin"][..., :31], layout="interleaved"),
            ValueError,
            r"rotary_dim=31\) must be even",
        ),
    ],
)
def test_bad_inputs(device, change, error, match):
    with pytest.raises(error, match=match):
        rope(**change(_valid(device)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to mix devices")
def test_mixed_devices_rejected():
    args = _valid("cuda")
    with pytest.raises(ValueError, match="cos is on"):
        rope(args["q"], args["k"], args["cos"].cpu(), args["sin"])


# --- layout="interleaved" (GLM-4: pairs (x[2i], x[2i+1]), cos/sin[..., :Dr/2] repeat-interleaved) ---


# Both layouts that read pairs (x[2i], x[2i+1]): GLM-4's, and DeepSeek-V3's, which writes them as halves.
PAIR_LAYOUTS = ["interleaved", "interleaved_to_half"]


@pytest.mark.parametrize("pairs", PAIR_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (16, 8), (80, 40), (96, 34)], ids=lambda v: str(v))
def test_interleaved_head_dims_and_partial_rotary(device, dtype, head_dim, rotary_dim, pairs):
    """Ragged sizes: 7 tokens, 6/3 heads, Dr/2 = 17 (not a power of two), pass-through tails."""
    q, k = make_qk(2, 7, 6, 3, head_dim, dtype, device)
    cos, sin = make_cos_sin(1, 7, rotary_dim, dtype, device)
    check_against_reference(q, k, cos, sin, dtype, layout=pairs)


@pytest.mark.parametrize("pairs", PAIR_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "layout,unsqueeze_dim", [("contiguous", 1), ("fused_qkv", 1), ("hf", 1), ("bthd", 2)]
)
def test_interleaved_layouts_gqa_and_cos_batch(device, dtype, layout, unsqueeze_dim, pairs):
    q, k = make_qk(3, 5, 4, 1, 48, dtype, device, layout)
    cos, sin = make_cos_sin(3, 5, 24, dtype, device)
    check_against_reference(q, k, cos, sin, dtype, unsqueeze_dim=unsqueeze_dim, layout=pairs)


@pytest.mark.parametrize("tile", [64, 512])
def test_interleaved_launch_tiling(device, monkeypatch, tile):
    monkeypatch.setattr(rope_module, "_INTERPRETER_TILE", tile)
    monkeypatch.setattr(rope_module, "_GPU_TILE", tile)
    q, k = make_qk(3, 5, 6, 3, 64, torch.float32, device)
    cos, sin = make_cos_sin(3, 5, 32, torch.float32, device)
    check_against_reference(q, k, cos, sin, torch.float32, layout="interleaved")


def test_interleaved_pairing_is_not_rotate_half(device):
    """The two layouts differ, and the interleaved one reads only cos/sin[..., :Dr/2]: a kernel
    that paired the wrong elements or read the second half of cos/sin would fail here."""
    q, k = make_qk(1, 4, 2, 1, 32, torch.float32, device, "contiguous")
    cos, sin = make_cos_sin(1, 4, 16, torch.float32, device)
    q_int, k_int = rope(q, k, cos, sin, layout="interleaved")
    q_rh, _ = rope(q, k, cos, sin)
    assert not torch.allclose(q_int, q_rh, atol=1e-3)
    q_ref, k_ref = rope_reference(q, k, cos, sin, layout="interleaved")
    assert_close(q_int, q_ref, torch.float32)
    assert_close(k_int, k_ref, torch.float32)
    # Changing the unread second half of cos/sin changes nothing.
    cos2, sin2 = cos.clone(), sin.clone()
    cos2[..., 8:], sin2[..., 8:] = 7.0, -5.0
    q_int2, k_int2 = rope(q, k, cos2, sin2, layout="interleaved")
    assert torch.equal(q_int, q_int2) and torch.equal(k_int, k_int2)
    # One pair by hand: out[0] = x0 c0 - x1 s0, out[1] = x1 c0 + x0 s0; dims >= 16 pass through.
    x, c, s = q[0, 0, 2].detach(), cos[0, 2, 0], sin[0, 2, 0]
    assert torch.allclose(q_int[0, 0, 2, 0], x[0] * c - x[1] * s, atol=1e-5)
    assert torch.allclose(q_int[0, 0, 2, 1], x[1] * c + x[0] * s, atol=1e-5)
    assert torch.equal(q_int[..., 16:], q.detach()[..., 16:])


@pytest.mark.parametrize("pairs", PAIR_LAYOUTS)
def test_interleaved_gradcheck_float64(device, pairs):
    q = torch.randn(1, 2, 2, 6, dtype=torch.float64, device=device).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 1, 2, 6, dtype=torch.float64, device=device, requires_grad=True)
    cos, sin = make_cos_sin(1, 2, 4, torch.float64, device)
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k, cos, sin, layout=pairs), (q, k), fast_mode=True)


def assert_same_as_transformers(ours, theirs, inputs):
    """Outputs (q, k) and the gradients they send to `inputs` agree with transformers' function."""
    for a, b in zip(ours, theirs):
        assert_close(a, b, torch.float32)
    grads = torch.randn_like(ours[0]), torch.randn_like(ours[1])
    for a, b in zip(torch.autograd.grad(ours, inputs, grads), torch.autograd.grad(theirs, inputs, grads)):
        assert_close(a, b, torch.float32)


def test_interleaved_matches_transformers_glm4(device):
    """Real GLM-4 cos/sin (partial_rotary_factor=0.5) against transformers' glm4 apply_rotary_pos_emb."""
    from transformers import Glm4Config
    from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding, apply_rotary_pos_emb

    config = Glm4Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    q, k = make_qk(2, 9, 4, 2, 32, torch.float32, device)
    position_ids = torch.arange(3, 12, device=device).expand(2, -1)
    cos, sin = Glm4RotaryEmbedding(config).to(device)(q, position_ids)
    assert cos.shape[-1] < 32  # partial rotary
    ours = rope(q, k, cos, sin, layout="interleaved")
    assert_same_as_transformers(ours, apply_rotary_pos_emb(q, k, cos, sin), (q, k))


# --- layout="interleaved_to_half" (DeepSeek-V3 rope_interleave: pairs (x[2i], x[2i+1]) in, halves out) ---


def test_interleaved_to_half_is_neither_other_layout(device):
    """Pairs are read interleaved and written in halves: one pair by hand, and both other layouts differ."""
    q, k = make_qk(1, 4, 2, 1, 32, torch.float32, device, "contiguous")
    cos, sin = make_cos_sin(1, 4, 16, torch.float32, device)
    q_out, _ = rope(q, k, cos, sin, layout="interleaved_to_half")
    for other in ("rotate_half", "interleaved"):
        assert not torch.allclose(q_out, rope(q, k, cos, sin, layout=other)[0], atol=1e-3)
    x, c, s = q[0, 0, 2].detach(), cos[0, 2, 1], sin[0, 2, 1]  # pair 1 = (x[2], x[3]) -> out[1], out[9]
    assert torch.allclose(q_out[0, 0, 2, 1], x[2] * c - x[3] * s, atol=1e-5)
    assert torch.allclose(q_out[0, 0, 2, 9], x[3] * c + x[2] * s, atol=1e-5)
    assert torch.equal(q_out[..., 16:], q.detach()[..., 16:])


def test_interleaved_to_half_matches_transformers_deepseek_v3(device):
    """Real DeepSeek-V3 cos/sin against transformers' apply_rotary_pos_emb_interleave, on MLA's
    shapes: q_rot split off the end of each head (strided), k_rot one shared head."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=8)
    q_states = torch.randn(2, 9, 4, 24, device=device).transpose(1, 2).requires_grad_()
    q = q_states[..., 8:]
    k = torch.randn(2, 1, 9, 16, device=device, requires_grad=True)
    position_ids = torch.arange(3, 12, device=device).expand(2, -1)
    cos, sin = DeepseekV3RotaryEmbedding(config).to(device)(q, position_ids)
    ours = rope(q, k, cos, sin, layout="interleaved_to_half")
    assert_same_as_transformers(ours, apply_rotary_pos_emb_interleave(q, k, cos, sin), (q_states, k))


class _CallCounter:
    """Wraps a function of the op module, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _odd_batch_stride(x):
    """`x` (batch 1) with a batch stride no dense tensor has: it must not matter, as for torch's contiguity."""
    return x.detach().as_strided(x.shape, (7,) + x.stride()[1:]).requires_grad_()


@pytest.mark.parametrize(
    "case,compact_launches",
    [
        ("hf", 2), ("contiguous", 2), ("hf_q_contiguous_k", 2), ("bthd", 2), ("batch_1_odd_stride", 2),
        ("cos_per_batch", 2), ("single_token", 2),
        # the forward reads strided q/k (general kernel); their gradients are fresh dense tensors
        ("fused_qkv", 1), ("padded_batch", 1), ("every_other_token", 1),
        # dense, but neither [B, T, H, D] nor [B, H, T, D] in memory
        ("sequence_first", 0), ("heads_first", 0), ("batch_innermost", 0),
        # cos/sin sliced out of a wider buffer: their token stride is not the rotary width
        ("cos_sin_slices", 0),
    ],
)
def test_dense_layouts_take_the_compact_kernel(device, monkeypatch, case, compact_launches):
    """Dense q/k launch the kernel that derives strides from the shapes (8 arguments); anything else the
    general one; both give the reference's values and gradients."""
    compact = _CallCounter(rope_module.launch)  # how the compact kernel is launched
    every = _CallCounter(rope_module._launch)  # every launch, either kernel
    monkeypatch.setattr(rope_module, "launch", compact)
    monkeypatch.setattr(rope_module, "_launch", every)
    batch, seq, unsqueeze_dim = 2, 5, 1
    layout = {"contiguous": "contiguous", "bthd": "bthd", "fused_qkv": "fused_qkv"}.get(case, "hf")
    if case == "bthd":
        unsqueeze_dim = 2
    if case in ("batch_1_odd_stride", "every_other_token"):
        batch = 1
    if case == "single_token":
        seq = 1
    q, k = make_qk(batch, seq, 4, 2, 32, torch.float32, device, layout)
    if case == "hf_q_contiguous_k":
        k = k.detach().contiguous().requires_grad_()
    if case == "batch_1_odd_stride":
        q, k = _odd_batch_stride(q), _odd_batch_stride(k)
    if case == "padded_batch":  # dense but for the batch stride: [B, T + 1, H, D][:, :T]
        q, k = (torch.randn(batch, seq + 1, h, 32, device=device)[:, :seq].transpose(1, 2).requires_grad_()
                for h in (4, 2))
    if case == "sequence_first":  # memory [T, B, H, D]
        q, k = (torch.randn(seq, batch, h, 32, device=device).permute(1, 2, 0, 3).requires_grad_() for h in (4, 2))
    if case == "heads_first":  # memory [H, B, T, D]
        q, k = (torch.randn(h, batch, seq, 32, device=device).transpose(0, 1).requires_grad_() for h in (4, 2))
    if case == "batch_innermost":  # memory [H, T, B, D] with B == H: a token stride of H * D, as [B, T, H, D]'s
        q, k = (torch.randn(4, seq, 4, 32, device=device).permute(2, 0, 1, 3).requires_grad_() for _ in "qk")
    if case == "every_other_token":  # head stride as dense, token stride not
        q, k = (torch.randn(batch, 2 * seq, h, 32, device=device)[:, ::2].transpose(1, 2).requires_grad_()
                for h in (4, 2))
    cos, sin = make_cos_sin(batch if case == "cos_per_batch" else 1, seq, 24, torch.float32, device)
    if case == "cos_sin_slices":
        cos = torch.cat((cos, torch.randn_like(cos)), dim=-1)[..., :24]
        sin = torch.cat((torch.randn_like(sin), sin), dim=-1)[..., 24:]
    check_against_reference(q, k, cos, sin, torch.float32, unsqueeze_dim=unsqueeze_dim)
    assert (every.calls, compact.calls) == (2, compact_launches)
