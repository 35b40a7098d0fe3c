"""Drop-in normalization modules backed by fuseforge's fused kernels.

`RMSNorm` has HF LlamaRMSNorm's parameter and attributes (`weight`, `variance_epsilon`)
and also Gemma's `eps`, so HF state_dicts load unchanged; `LayerNorm` is a
torch.nn.LayerNorm whose forward runs the fused kernel.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fuseforge.modules._checks import check_size
from fuseforge.ops.layer_norm import layer_norm
from fuseforge.ops.rms_norm import CASTING_MODES, fused_add_rms_norm, rms_norm
from fuseforge.checks import check_positive

_WEIGHT_INITS = {"ones": nn.init.ones_, "zeros": nn.init.zeros_}


class RMSNorm(nn.Module):
    """RMSNorm with HF casting semantics.

    Llama-style: `RMSNorm(h)` (weight init ones, offset 0, casting "llama").
    Gemma-style: `RMSNorm(h, offset=1.0, casting="gemma", init="zeros")`.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting: str = "llama",
        init: str = "ones",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if casting not in CASTING_MODES:
            raise ValueError(f"casting must be one of {CASTING_MODES}, got {casting!r}")
        if init not in _WEIGHT_INITS:
            raise ValueError(f"init must be one of {tuple(_WEIGHT_INITS)}, got {init!r}")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise TypeError(f"offset must be a number, got {type(offset).__name__}")
        if not math.isfinite(offset):
            raise ValueError(f"offset must be finite, got {offset}")
        self.hidden_size = check_size("hidden_size", hidden_size)
        self.variance_epsilon = check_positive("eps", eps)
        self.offset = float(offset)
        self.casting = casting
        self.init = init
        self.weight = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def eps(self) -> float:
        """Gemma's name for `variance_epsilon`; both refer to one value."""
        return self.variance_epsilon

    @eps.setter
    def eps(self, value: float) -> None:
        self.variance_epsilon = check_positive("eps", value)

    def reset_parameters(self) -> None:
        _WEIGHT_INITS[self.init](self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, casting={self.casting!r}"


class FusedAddRMSNorm(RMSNorm):
    """`residual = x + residual; return RMSNorm(residual), residual` in one kernel pass."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(
            hidden_states, residual, self.weight, self.variance_epsilon, self.offset, self.casting
        )


class LayerNorm(nn.LayerNorm):
    """torch.nn.LayerNorm (same constructor, parameters and state_dict) with the fused kernel.

    A multi-dimensional `normalized_shape` is handled by flattening those trailing dims.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        if tuple(input.shape[-len(shape):]) != shape or input.dim() < len(shape):
            raise ValueError(f"input's trailing dimensions must be {shape}, got shape {tuple(input.shape)}")
        if len(shape) == 1:
            return layer_norm(input, self.weight, self.bias, self.eps)
        flat = input.reshape(*input.shape[: -len(shape)], math.prod(shape))
        weight = self.weight.reshape(-1) if self.weight is not None else None
        bias = self.bias.reshape(-1) if self.bias is not None else None
        return layer_norm(flat, weight, bias, self.eps).view(input.shape)
