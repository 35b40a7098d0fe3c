"""Per-dtype tolerances for comparing kernels with float64/fp32 references: the one place they live.

bf16 keeps 8 mantissa bits (relative step 2**-8 ~ 4e-3) and fp16 11 bits (~5e-4);
references are computed in float64 from the same (rounded) inputs, so the kernel
may differ by a few ulps of its output dtype plus fp32 accumulation error.
"""

import torch

TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-8),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """atol/rtol for `dtype`, optionally loosened by `scale` for long reductions."""
    t = TOLERANCES[dtype]
    return dict(atol=t["atol"] * scale, rtol=t["rtol"] * scale)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    scale: float = 1.0,
    msg: str = "",
    magnitude: float = 1.0,
):
    """Compare in float64 with the tolerance of `dtype` (the dtype the kernel computed in).

    `magnitude`: the size of the terms whose difference `expected` is, where that exceeds 1. atol
    is relative to it: a difference that cancels to ~0 keeps a few roundings of those terms.
    """
    t = tol(dtype, scale)
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=t["atol"] * magnitude, rtol=t["rtol"], msg=msg or None
    )
