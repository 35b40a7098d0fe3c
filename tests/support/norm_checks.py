"""Reference comparisons shared by the normalization tests.

A tolerance check alone cannot see where a kernel rounds: rounding the normalized value
to bf16 before or after the weight multiply changes outputs by one ulp, well inside a
bf16 tolerance. So outputs are also compared at fp32 precision with the reference
rounded to the output dtype: a faithful kernel disagrees only where its fp32 arithmetic
lands across a rounding boundary (~1e-4 of elements), a misplaced rounding on ~25%.
"""

import torch

from fuseforge.ops._shared import rowwise
from tolerances import assert_close, tol


def force_split_backward(monkeypatch, norm_module) -> list:
    """Make every row width take the split backward (row kernel for dx, column kernel for the
    weight/bias gradients) and record each `param_grads` call `norm_module` makes (its kwargs)."""
    monkeypatch.setattr(rowwise, "SPLIT_BACKWARD_MIN_COLS", 1)
    calls = []
    real = rowwise.param_grads

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(norm_module, "param_grads", counted)
    return calls


def assert_matches_reference(
    actual: torch.Tensor,
    expected: torch.Tensor,
    out_dtype: torch.dtype,
    value_dtype: torch.dtype,
    scale: float = 1.0,
    what: str = "",
) -> None:
    """`actual` has `out_dtype`, is within `value_dtype`'s tolerance of the float64
    `expected` everywhere, and equals `expected.to(out_dtype)` at fp32 precision on all
    but max(1, 1%) of its elements."""
    assert actual.dtype == out_dtype, f"{what}: dtype {actual.dtype}, expected {out_dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_close(actual, expected, value_dtype, scale, msg=what)
    rounded = expected.detach().to(out_dtype).double()
    disagree = ~torch.isclose(actual.double(), rounded, **tol(torch.float32, scale))
    allowed = max(1, actual.numel() // 100)
    assert int(disagree.sum()) <= allowed, (
        f"{what}: {int(disagree.sum())}/{actual.numel()} elements differ from the reference rounded to {out_dtype}"
    )


def least_precise(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype with the fewest mantissa bits: the precision a mixed computation keeps."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps)
