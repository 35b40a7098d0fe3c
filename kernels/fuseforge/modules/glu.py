"""Gated MLP blocks (LLaMA's SwiGLU, Gemma's GeGLU) on the fused activation kernels.

Parameter names match Hugging Face's LlamaMLP/GemmaMLP (gate_proj, up_proj,
down_proj), so their state_dicts load unchanged. The activation never gets
stored: backward recomputes it and writes the gradients into the projection
outputs' memory (see fuseforge.ops.glu).
"""

from __future__ import annotations

import torch
from torch import nn

from fuseforge.modules._checks import check_size
from fuseforge.ops.glu import GELU_APPROXIMATIONS, geglu, swiglu


class _GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)); subclasses pick the fused activation."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size = check_size("hidden_size", hidden_size)
        self.intermediate_size = check_size("intermediate_size", intermediate_size)
        factory = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **factory)

    def _gated_activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._gated_activation(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"


class SwiGLUMLP(_GatedMLP):
    """LLaMA/Mistral/Qwen MLP: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def _gated_activation(self, gate, up):
        return swiglu(gate, up)


class GeGLUMLP(_GatedMLP):
    """Gemma MLP: down_proj(gelu(gate_proj(x), approximate) * up_proj(x)).

    approximate="tanh" matches hidden_act "gelu_pytorch_tanh" (Gemma's default), "none" matches "gelu".
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        approximate: str = "tanh",
        bias: bool = False,
        device=None,
        dtype=None,
    ):
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"approximate must be one of {tuple(GELU_APPROXIMATIONS)}, got {approximate!r}")
        super().__init__(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.approximate = approximate

    def _gated_activation(self, gate, up):
        return geglu(gate, up, self.approximate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, approximate={self.approximate!r}"
