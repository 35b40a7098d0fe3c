"""fuseforge.ops.nf4.dequantize_nf4 against torchao's own NF4 dequantization (get_original_weight), bit for bit.

Ragged sizes (not a multiple of a program's bytes), several block / scaler-block sizes, fp32 / bf16 / fp16
weights, another output dtype; and the QLoRA path (ops.lora) really uses it.
"""

import pytest
import torch

torchao = pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402

from fuseforge.ops import lora as lora_op  # noqa: E402
from fuseforge.ops.nf4 import dequantize_nf4  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, block, scaler_block", [((96, 136), 64, 3), ((40, 64), 16, 8), ((2048, 36), 32, 256)])
def test_dequantize_matches_torchao_bit_for_bit(device, dtype, shape, block, scaler_block):
    weight = (torch.randn(shape, dtype=torch.float32) * 3).to(dtype).to(device)
    nf4 = to_nf4(weight, block, scaler_block)
    expected = nf4.get_original_weight()
    out = dequantize_nf4(nf4)
    assert out.dtype == dtype and out.shape == weight.shape
    assert torch.equal(out, expected), (out.float() - expected.float()).abs().max()
    assert torch.equal(dequantize_nf4(nf4, torch.float32), expected.float())  # then cast, as torchao's .to(dtype)


def test_dequantize_refuses_plain_tensors():
    with pytest.raises(TypeError, match="NF4Tensor"):
        dequantize_nf4(torch.randn(4, 64))


def test_lora_linear_over_nf4_dequantizes_with_the_kernel(monkeypatch, device):
    weight = to_nf4(torch.randn(32, 64, device=device), 64, 8)
    calls = []
    real = lora_op.dequantize_nf4
    monkeypatch.setattr(lora_op, "dequantize_nf4", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(5, 64, device=device, requires_grad=True)
    a = torch.randn(4, 64, device=device, requires_grad=True)
    b = torch.randn(32, 4, device=device, requires_grad=True)
    lora_op.lora_linear(x, weight, a, b, 0.5).sum().backward()
    assert len(calls) == 2  # the forward's matmul and the backward's grad @ W
    torch.testing.assert_close(x.grad, torch.ones(5, 32, device=device) @ (weight.get_original_weight() + 0.5 * b @ a))
