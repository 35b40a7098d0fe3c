"""The input check of every op that runs an LM head (hidden @ weight.T + bias) without building the logits:
fused_linear_cross_entropy, the token log-prob objectives, the preference and GRPO losses, fused_linear_jsd."""

from __future__ import annotations

from typing import Iterable

import torch

from fuseforge.ops._shared.utils import (
    TRAINING_DTYPES,
    check_device_supported,
    check_same_device,
    check_target,
    check_tensor,
)


class DTypeMismatchError(TypeError, ValueError):
    """Tensors that must share a dtype do not. Both a TypeError (as fuseforge's other ops raise for
    dtypes) and a ValueError (as every other bad input of the preference and RL losses raises)."""


def check_lm_head_inputs(
    hidden: object,
    weight: object,
    bias: object,
    target: object | None,
    *,
    prefix: str = "",
    ndim: int | None = None,
    min_ndim: int = 1,
    target_dtypes: Iterable[torch.dtype] | None = None,
    autocast: bool = True,
) -> None:
    """Raise (naming the argument) unless hidden [..., H], weight [V, H] with V >= 1, bias [V] (or None) and
    integer target [...] = hidden.shape[:-1] (or None) fit one LM head on one device that runs the kernels.
    Runs no kernel.

    prefix: put before hidden, weight and bias in messages ("ref_", "student_"). ndim / min_ndim: hidden's
    rank. target_dtypes: the target dtypes allowed (default: any integer dtype). autocast: the op runs the
    head in the autocast dtype under torch.autocast, so hidden, weight and bias need share a dtype only
    outside it; False: they must always share one.
    """
    h, w, b = f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias"
    check_tensor(h, hidden, ndim=ndim, min_ndim=min_ndim, dtypes=TRAINING_DTYPES)
    check_tensor(w, weight, ndim=2, dtypes=TRAINING_DTYPES)
    if bias is not None:
        check_tensor(b, bias, ndim=1, dtypes=TRAINING_DTYPES)
    n_vocab, n_hidden = weight.shape
    if n_vocab == 0:
        raise ValueError(
            f"{w} has an empty vocabulary (shape {tuple(weight.shape)}); {w} must have at least one row "
            "(vocabulary entry)"
        )
    if hidden.shape[-1] != n_hidden:
        raise ValueError(
            f"{h} has {hidden.shape[-1]} features (shape {tuple(hidden.shape)}) but {w} expects {n_hidden}: "
            f"{w} must have shape [V, {hidden.shape[-1]}] ([vocab, hidden]), got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape[0] != n_vocab:
        raise ValueError(f"{b} has {bias.shape[0]} entries but {w} has {n_vocab} rows: vocabulary sizes differ")
    if target is not None:
        if target_dtypes is not None:
            check_tensor("target", target, dtypes=target_dtypes)
        check_target(target, hidden.shape[:-1], f"{h}.shape[:-1]")
    check_same_device(**{h: hidden, w: weight, b: bias, "target": target})
    check_device_supported(h, hidden)
    if autocast and torch.is_autocast_enabled(hidden.device.type):  # the head runs in the autocast dtype
        return
    for name, t in ((w, weight), (b, bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise DTypeMismatchError(
                f"{name} has dtype {t.dtype} but {h} has dtype {hidden.dtype}; cast them to one dtype"
                + (" or run under torch.autocast" if autocast else "")
            )
