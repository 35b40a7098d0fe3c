"""The per-token loss definition the loss ops share (ignore_index, label smoothing, z-loss, softcap):
one dataclass and one check, where the options enter the library."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fuseforge.ops._shared.loss_args import IGNORE_INDEX
from fuseforge.ops._shared.utils import check_int64, check_positive, check_reduction


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
