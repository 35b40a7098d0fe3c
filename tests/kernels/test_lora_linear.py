"""fuseforge.ops.lora.lora_linear and the fused peft LoRA layer against peft's own lora.Linear.

The reference is peft's module itself (its forward and autograd backward), run in float64 from the same
weights; the fused layer runs in fp32 or bf16. Ragged sizes (nothing a power of two), a bias, frozen and
trainable base weights, peft's dropout (same masks: the fused layer calls peft's dropout module), rsLoRA
scaling, and NF4 (torchao) base weights, whose reference is the dequantized weight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from tolerances import assert_close

peft = pytest.importorskip("peft")

from fuseforge.ops.lora import lora_linear  # noqa: E402
from fuseforge.transformers import apply_kernels  # noqa: E402
from fuseforge.transformers.lora import FusedLoraLinearMixin, quantize_base_nf4  # noqa: E402

IN, OUT, RANK = 48, 40, 6


def assert_as_close_as_peft(actual, peft_same_dtype, expected, dtype, what, magnitude=1.0):
    """fp32: within fp32 tolerance of float64 peft. bf16: peft's own bf16 forward/backward rounds intermediates
    (the adapter's [tokens, r] product, its gradient) as the fused op does, so the bound is peft's bf16 error
    vs float64, doubled, plus bf16's tolerance; a wrong term (scaling, a missing product) is far outside it."""
    if dtype == torch.float32:
        assert_close(actual, expected, dtype, magnitude=magnitude, msg=what)
        return
    err = (actual.double() - expected).abs().max().item()
    peft_err = (peft_same_dtype.double() - expected).abs().max().item()
    bound = 2 * peft_err + 2e-2 * expected.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} vs float64, peft's own {dtype}: {peft_err:.3g}"


def lora_module(*, bias=True, dropout=0.0, rslora=False, dtype=torch.float32, train_base=False, in_features=IN,
                out_features=OUT):
    """nn.Sequential(Linear) wrapped by peft (LoRA on it), B random so the adapter contributes."""
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=bias))
    config = peft.LoraConfig(r=RANK, lora_alpha=9, lora_dropout=dropout, target_modules=["0"], use_rslora=rslora)
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    layer = model.base_model.model[0]
    nn.init.normal_(layer.lora_B["default"].weight, std=0.3)
    if train_base:
        layer.base_layer.weight.requires_grad_(True)
    return model.to(dtype)


def run(model, x, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    grad_y = torch.linspace(-1, 1, y.numel(), dtype=torch.float64, device=y.device).reshape(y.shape).to(y.dtype)
    y.backward(grad_y)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return y, x.grad, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "no_bias", "rslora", "trainable_base", "3d"])
def test_fused_lora_layer_matches_peft_in_float64(dtype, case):
    model = lora_module(bias=case != "no_bias", rslora=case == "rslora", train_base=case == "trainable_base")
    reference = copy.deepcopy(model).double()
    unfused = copy.deepcopy(model).to(dtype)
    fused = copy.deepcopy(model).to(dtype)
    report = apply_kernels(fused)
    assert report.patched["lora"], report
    assert isinstance(fused.base_model.model[0], FusedLoraLinearMixin)
    shape = (3, 7, IN) if case == "3d" else (29, IN)
    x = torch.randn(shape, dtype=torch.float64)
    y, gx, grads = run(fused, x.to(dtype))
    y_p, gx_p, grads_p = run(unfused, x.to(dtype))
    y_ref, gx_ref, grads_ref = run(reference, x.to(dtype).double())
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert_as_close_as_peft(y, y_p, y_ref, dtype, "output")
    assert_as_close_as_peft(gx, gx_p, gx_ref, dtype, "grad x", magnitude=4)
    assert set(grads) == set(grads_ref)
    assert ("base_model.model.0.base_layer.weight" in grads) == (case == "trainable_base")
    for name, g in grads.items():
        assert_as_close_as_peft(g, grads_p[name], grads_ref[name], dtype, f"grad {name}", magnitude=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_layer_with_dropout_uses_peft_masks(dtype):
    model = lora_module(dropout=0.4).to(dtype)
    fused = copy.deepcopy(model)
    apply_kernels(fused)
    x = torch.randn(33, IN, dtype=dtype)
    y, gx, grads = run(fused, x, seed=7)
    y_ref, gx_ref, grads_ref = run(model, x, seed=7)  # peft's forward in the same dtype, same dropout mask
    assert_close(y, y_ref, dtype, msg="output")
    assert_close(gx, gx_ref, dtype, magnitude=4, msg="grad x")
    for name, g in grads.items():
        assert_close(g, grads_ref[name], dtype, magnitude=8, msg=f"grad {name}")
    _, _, other = run(fused, x, seed=8)  # another mask: another gradient (the dropout really is applied)
    assert not torch.allclose(other["base_model.model.0.lora_A.default.weight"],
                              grads["base_model.model.0.lora_A.default.weight"])


def test_calls_peft_cannot_fuse_take_peft_forward():
    """Disabled or merged adapters, several active adapters, mixed dtypes: peft's own forward, same numbers."""
    model = lora_module()
    fused = copy.deepcopy(model)
    apply_kernels(fused)
    x = torch.randn(11, IN)
    calls = []
    real = lora_linear.__globals__["_LoraLinear"].apply

    def counted(*args):
        calls.append(1)
        return real(*args)

    lora_linear.__globals__["_LoraLinear"].apply = counted
    try:
        fused(x)
        assert len(calls) == 1
        with fused.disable_adapter(), model.disable_adapter():
            torch.testing.assert_close(fused(x), model(x))
        assert len(calls) == 1
        layer = fused.base_model.model[0]
        layer.lora_A["default"].to(torch.float64)  # adapter dtype != activations: peft's cast path
        layer.lora_B["default"].to(torch.float64)
        fused(x)
        assert len(calls) == 1
    finally:
        lora_linear.__globals__["_LoraLinear"].apply = real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_base_weight_matches_peft_over_the_dequantized_weight(dtype, device):
    """QLoRA: NF4 base weights (torchao) under the fused layer equal peft over the dequantized weights (on a GPU the
    dequantization is the Triton kernel's)."""
    pytest.importorskip("torchao")
    model = lora_module(bias=False, in_features=64, out_features=32).to(device, dtype)
    fused = copy.deepcopy(model)
    assert quantize_base_nf4(fused, block_size=16, scaler_block_size=8) == ["base_model.model.0.base_layer"]
    nf4 = fused.base_model.model[0].base_layer.weight
    assert type(nf4).__name__ == "NF4Tensor" and not nf4.requires_grad
    reference = copy.deepcopy(model).double()
    reference.base_model.model[0].base_layer.weight.data = nf4.get_original_weight().double()
    unfused = copy.deepcopy(reference).to(dtype)  # peft over the dequantized weight, in dtype
    apply_kernels(fused)
    x = torch.randn(21, 64, dtype=torch.float64, device=device)
    y, gx, grads = run(fused, x.to(dtype))
    y_p, gx_p, grads_p = run(unfused, x.to(dtype))
    y_ref, gx_ref, grads_ref = run(reference, x.to(dtype).double())
    assert_as_close_as_peft(y, y_p, y_ref, dtype, "output")
    assert_as_close_as_peft(gx, gx_p, gx_ref, dtype, "grad x", magnitude=4)
    assert set(grads) == set(grads_ref) and len(grads) == 2
    for name, g in grads.items():
        assert_as_close_as_peft(g, grads_p[name], grads_ref[name], dtype, f"grad {name}", magnitude=8)


def test_nf4_refuses_sizes_its_blocks_do_not_divide():
    pytest.importorskip("torchao")
    with pytest.raises(ValueError, match=r"base_model.model.0.base_layer.weight \(41, 48\)"):
        quantize_base_nf4(lora_module(out_features=41))
    small = lora_module()  # 30 blocks of 64: scalers double-quantized in pairs
    assert quantize_base_nf4(small) == ["base_model.model.0.base_layer"]


def test_lora_linear_checks_its_shapes():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="do not chain"):
        lora_linear(x, w, torch.randn(2, 7), torch.randn(6, 2), 1.0)
    with pytest.raises(ValueError, match="share one dtype"):
        lora_linear(x, w, torch.randn(2, 8, dtype=torch.float64), torch.randn(6, 2), 1.0)
