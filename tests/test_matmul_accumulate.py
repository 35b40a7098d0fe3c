"""fuseforge.ops.matmul_accumulate.addmm_ (c += a @ b in one pass over c) against a float64 reference."""

import pytest
import torch

from fuseforge.ops.matmul_accumulate import MAX_INNER, addmm_, uses_triton_addmm
from tolerances import assert_close


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k", [(300, 200, 40), (129, 130, 65), (1, 7, 1)])
def test_matches_float64(dtype, m, n, k, device):
    c = torch.randn(m, n, device=device).to(dtype)
    a = torch.randn(k, m, device=device).to(dtype).t()  # the [V, tokens] view of a token-major chunk
    b = torch.randn(k, n, device=device).to(dtype)
    expected = c.double() + a.double() @ b.double()
    assert uses_triton_addmm(c, a, b)
    out = addmm_(c, a, b)
    assert out is c
    # one rounding of the fp32 sum to `dtype`; values grow like sqrt(k)
    assert_close(c, expected, dtype, scale=max(1.0, k**0.5 / 4))


def test_strided_b(device):
    c = torch.randn(70, 50, device=device).to(torch.bfloat16)
    a = torch.randn(70, 24, device=device).to(torch.bfloat16)
    b = torch.randn(50, 24, device=device).to(torch.bfloat16).t()
    expected = c.double() + a.double() @ b.double()
    addmm_(c, a, b)
    assert_close(c, expected, torch.bfloat16, scale=2.0)


@pytest.mark.parametrize(
    "dtype, k, reason",
    [(torch.float32, 8, "fp32 keeps cuBLAS's exact fp32 product"), (torch.bfloat16, MAX_INNER + 1, "long inner dim")],
)
def test_falls_back_to_torch(dtype, k, reason, device):
    c = torch.randn(9, 5, device=device).to(dtype)
    a = torch.randn(9, k, device=device).to(dtype)
    b = torch.randn(k, 5, device=device).to(dtype)
    assert not uses_triton_addmm(c, a, b), reason
    expected = c.double() + a.double() @ b.double()
    addmm_(c, a, b)
    assert_close(c, expected, dtype, scale=max(1.0, k**0.5 / 4))
