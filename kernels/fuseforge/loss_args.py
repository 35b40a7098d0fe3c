"""Arguments the loss ops, the loss modules and apply_kernels share: IGNORE_INDEX, the fused losses' chunk size
(one check, one floor) and the per-token loss definition (LossOptions, one check).

Pure Python (no torch, no triton), so that the platform (fuseforge_flyte) can import IGNORE_INDEX
without loading the kernels.

The chunk size means the same everywhere: the number of tokens one chunk of a fused-head loss
(hidden @ weight.T computed a chunk of tokens at a time) processes. Inside the library its default
is None, meaning "let the op pick from its memory budget" (each op's `default_chunk_*` rule, never
fewer than MIN_CHUNK_TOKENS tokens unless the batch is smaller); a given value is a positive int.
The spelling follows the caller: `chunk_size` in the ops and modules, `loss_chunk_size` in
`apply_kernels`. The platform's "0: fuseforge's default" (Flyte inputs are plain ints) is turned
into None once, where it enters the library (fuseforge_flyte.training.engine).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from fuseforge.checks import check_int64, check_positive, check_reduction

# Labels equal to this carry no loss (PyTorch's and transformers' convention).
IGNORE_INDEX = -100

# Fewest tokens a default-sized chunk holds. Every chunk reads and writes all of grad_weight ([V, H])
# once, while its matmuls scale with the chunk's tokens, so the share of time lost to that traffic
# depends on the chunk length alone (~ element_size * FLOP/s / (3 * tokens * B/s): about half of the
# matmul time at 256 tokens on an H200); below it the vocabulary matmuls also stop filling the GPU.
MIN_CHUNK_TOKENS = 256


def check_chunk_size(chunk_size: object, name: str = "chunk_size") -> int | None:
    """None (the op picks) or a positive int of tokens per chunk, returned as an int.

    `name` is the argument as the caller spells it (`chunk_size`, `loss_chunk_size`), for the
    error message. Any integral number but a bool is accepted; anything else is a TypeError, an
    int below 1 a ValueError.
    """
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(
            f"{name} must be a positive int or None, got {chunk_size!r} ({type(chunk_size).__name__}): "
            "tokens per chunk of the fused loss, None for the default"
        )
    if chunk_size < 1:
        raise ValueError(
            f"{name} must be a positive int or None, got {chunk_size}: "
            "tokens per chunk of the fused loss, None for the default"
        )
    return int(chunk_size)


@dataclass(frozen=True)
class LossOptions:
    """The per-token loss definition shared by cross_entropy and fused_linear_cross_entropy."""

    ignore_index: int = IGNORE_INDEX
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    softcap: float | None = None


def check_loss_options(ignore_index, reduction, label_smoothing, z_loss_scale, softcap) -> LossOptions:
    """Validate the loss options once, with errors that name the argument."""
    check_int64("ignore_index", ignore_index)
    check_reduction(reduction)
    try:
        label_smoothing = float(label_smoothing)
        z_loss_scale = float(z_loss_scale)
    except (TypeError, ValueError):
        raise TypeError("label_smoothing and z_loss_scale must be numbers") from None
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (z_loss_scale >= 0.0 and math.isfinite(z_loss_scale)):
        raise ValueError(f"z_loss_scale must be a finite number >= 0, got {z_loss_scale}")
    if softcap is not None:
        softcap = check_positive("softcap", softcap)
    return LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
