"""Fused replacements for Hugging Face leaf modules (norms, gated MLPs, MoE experts).

Each replacement is a mixin whose `forward` calls a fuseforge kernel with the
module's own parameters and submodules, so weights stay where they are and
wrappers on the projections (LoRA, quantised linears) keep working. `plan(module)`
decides, from the verified implementation fingerprints, whether a module can be
swapped and with which mixin, or why not.

Kernel semantics matched here (all checked against the transformers versions
listed in `fuseforge.transformers.TESTED_TRANSFORMERS`):
- Llama-style RMSNorm: fp32 normalisation, cast to the input dtype, then `* weight`.
- Gemma-style RMSNorm: everything in fp32 with `(1 + weight)`, one cast at the end.
- OLMo-style RMSNorm (OLMo 2/3): fp32 normalisation, `weight * x` in fp32, one cast at the
  end: the kernel's Gemma casting with offset 0.
- `down(act(gate(x)) * up(x))` and Phi-3's `gate_up_proj` split, act = SiLU or GELU.
- MoE experts with concatenated `[gate; up]` expert weights (Mixtral and ~50 others).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fuseforge.functional import geglu, layer_norm, rms_norm, swiglu
from fuseforge.transformers._fingerprint import matches

# Verified implementation fingerprints (see _fingerprint.py), transformers 5.17-5.24.
LLAMA_RMS_NORM_FORWARD = frozenset({"607a0bc599d3"})
GEMMA_RMS_NORM_FORWARD = frozenset({"b2efe7f0a208"})
GEMMA_RMS_NORM_NORM = frozenset({"fd8d7a06072d"})
OLMO_RMS_NORM_FORWARD = frozenset({"a46c8ec460cb"})  # (self.weight * hidden_states).to(input_dtype); verified on 5.24
SPLIT_GATED_MLP_FORWARD = frozenset({"7e0c35e5ee8b"})  # down_proj(act_fn(gate_proj(x)) * up_proj(x))
FUSED_GATE_UP_MLP_FORWARD = frozenset({"02e678880f6a"})  # Phi-3: gate_up_proj, chunk, activation_fn
EXPERTS_APPLY_GATE = frozenset({"b42fe38ed914"})  # transformers.integrations.moe._default_apply_gate
EXPERTS_EAGER_FORWARD = frozenset({"cc14b3ec6864", "ceb5cf870ea9"})  # 5.24 / 5.17 per-expert loop


# --- activations -------------------------------------------------------------------------------

_PROBE = torch.linspace(-8.0, 8.0, 321, dtype=torch.float64)
_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
_GLU_NAMES = {"silu": "swiglu", "gelu_tanh": "geglu tanh", "gelu": "geglu"}


def classify_activation(act: object) -> str | None:
    """'silu', 'gelu_tanh' or 'gelu' when `act` computes that function (float64 probe), else None.

    A numeric probe, not a class check: transformers has several classes per function
    (nn.SiLU, SiLUActivation, GELUTanh, NewGELU...), and only the function matters here.
    """
    if not callable(act) or (isinstance(act, nn.Module) and any(True for _ in act.parameters())):
        return None
    try:
        with torch.no_grad():
            out = act(_PROBE)
    except Exception:  # noqa: BLE001 - anything an unknown activation raises means "not ours"
        return None
    if not isinstance(out, torch.Tensor) or out.shape != _PROBE.shape or out.dtype != torch.float64:
        return None
    for name, reference in _ACTIVATIONS.items():
        if torch.allclose(out, reference(_PROBE), rtol=1e-12, atol=1e-12):
            return name
    return None


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none")


# --- mixins (the fused forwards) ---------------------------------------------------------------


class LlamaRMSNormMixin:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, casting="llama")


class GemmaRMSNormMixin:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, offset=1.0, casting="gemma")


class OlmoRMSNormMixin:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, offset=0.0, casting="gemma")


class LayerNormMixin:
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.LayerNorm's name
        return layer_norm(input, self.weight, self.bias, self.eps)


def _split_mlp_mixin(activation: str) -> type:
    class SplitGatedMLPMixin:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(_gated(self.gate_proj(x), self.up_proj(x), activation))

    SplitGatedMLPMixin.__name__ = SplitGatedMLPMixin.__qualname__ = f"SplitGatedMLP_{activation}"
    return SplitGatedMLPMixin


def _fused_gate_up_mlp_mixin(activation: str) -> type:
    class FusedGateUpMLPMixin:
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
            return self.down_proj(_gated(gate, up, activation))

    FusedGateUpMLPMixin.__name__ = FusedGateUpMLPMixin.__qualname__ = f"FusedGateUpMLP_{activation}"
    return FusedGateUpMLPMixin


SPLIT_MLP_MIXINS = {name: _split_mlp_mixin(name) for name in _ACTIVATIONS}
FUSED_GATE_UP_MLP_MIXINS = {name: _fused_gate_up_mlp_mixin(name) for name in _ACTIVATIONS}


class SwiGLUExpertsGateMixin:
    """The gate every non-eager experts implementation (grouped_mm, batched_mm) calls."""

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_out.chunk(2, dim=-1)
        return swiglu(gate, up)


class SwiGLUExpertsMixin(SwiGLUExpertsGateMixin):
    """Also the eager per-expert loop, routed through the fused gate."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if getattr(self.config, "_experts_implementation", None) != "eager":
            return super().forward(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            experts_hit = torch.unique(top_k_index)
            experts_hit = experts_hit[(experts_hit >= 0) & (experts_hit < self.num_experts)].tolist()
        for expert in experts_hit:
            # (slot, token) pairs in the same order as transformers' loop, so sums agree bit for bit.
            slot, token = torch.where(top_k_index.transpose(0, 1) == expert)
            gate_up = F.linear(hidden_states[token], self.gate_up_proj[expert])
            expert_out = F.linear(self._apply_gate(gate_up), self.down_proj[expert])
            expert_out = expert_out * top_k_weights[token, slot, None]
            out.index_add_(0, token, expert_out.to(out.dtype))
        return out


# --- planning ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What to do with one module: swap in `mixin` (label says which kernel form), or skip for `reason`."""

    kernel: str
    label: str
    mixin: type | None = None
    reason: str | None = None


def _float_attr(module: nn.Module, name: str) -> bool:
    value = getattr(module, name, None)
    return isinstance(value, (float, int)) and not isinstance(value, bool)


def _has_vector_weight(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 1


def _plan_rms_norm(module: nn.Module, cls: type, name: str) -> Plan:
    if matches(cls.forward, LLAMA_RMS_NORM_FORWARD) and _float_attr(module, "variance_epsilon"):
        if _has_vector_weight(module):
            return Plan("rms_norm", name, LlamaRMSNormMixin)
    if matches(cls.forward, OLMO_RMS_NORM_FORWARD) and _float_attr(module, "variance_epsilon"):
        if _has_vector_weight(module):
            return Plan("rms_norm", name, OlmoRMSNormMixin)
    if (
        matches(cls.forward, GEMMA_RMS_NORM_FORWARD)
        and matches(getattr(cls, "_norm", None), GEMMA_RMS_NORM_NORM)
        and _float_attr(module, "eps")
        and _has_vector_weight(module)
    ):
        return Plan("rms_norm", name, GemmaRMSNormMixin)
    return Plan("rms_norm", name, reason=f"{name}: implementation not recognised as Llama, Gemma or OLMo RMSNorm")


def _plan_layer_norm(module: nn.Module, cls: type, name: str) -> Plan:
    if cls is nn.LayerNorm and len(module.normalized_shape) == 1:
        return Plan("layer_norm", name, LayerNormMixin)
    if cls is nn.LayerNorm:
        return Plan("layer_norm", name, reason=f"{name}: normalises over {len(module.normalized_shape)} dims")
    return Plan("layer_norm", name, reason=f"{name}: not torch.nn.LayerNorm itself (custom subclass or code)")


def _plan_mlp(module: nn.Module, cls: type, name: str) -> Plan:
    if matches(cls.forward, SPLIT_GATED_MLP_FORWARD):
        activation = classify_activation(getattr(module, "act_fn", None))
        if activation is not None:
            return Plan("swiglu", f"{name} ({_GLU_NAMES[activation]})", SPLIT_MLP_MIXINS[activation])
        act = type(getattr(module, "act_fn", None)).__name__
        return Plan("swiglu", name, reason=f"{name}: activation {act} is not SiLU/GELU")
    if matches(cls.forward, FUSED_GATE_UP_MLP_FORWARD):
        activation = classify_activation(getattr(module, "activation_fn", None))
        if activation is not None:
            return Plan("swiglu", f"{name} ({_GLU_NAMES[activation]})", FUSED_GATE_UP_MLP_MIXINS[activation])
        act = type(getattr(module, "activation_fn", None)).__name__
        return Plan("swiglu", name, reason=f"{name}: activation {act} is not SiLU/GELU")
    return Plan("swiglu", name, reason=f"{name}: MLP implementation not recognised as a gated (GLU) MLP")


def _plan_experts(module: nn.Module, cls: type, name: str) -> Plan:
    layout_ok = (
        getattr(module, "has_gate", False)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "is_transposed", True)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "has_post_expert_norm", False)
        and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
        and isinstance(getattr(module, "down_proj", None), nn.Parameter)
    )
    if not layout_ok or not matches(cls._apply_gate, EXPERTS_APPLY_GATE):
        return Plan("swiglu", name, reason=f"{name}: experts layout/gate is not concatenated [gate; up] SwiGLU")
    if classify_activation(getattr(module, "act_fn", None)) != "silu":
        return Plan("swiglu", name, reason=f"{name}: experts activation is not SiLU")
    if matches(inspect.unwrap(cls.forward), EXPERTS_EAGER_FORWARD):
        return Plan("swiglu", f"{name} (experts)", SwiGLUExpertsMixin)
    return Plan(
        "swiglu",
        f"{name} (experts, grouped_mm/batched_mm only)",
        SwiGLUExpertsGateMixin,
        reason=f"{name}: eager experts loop not recognised; only the grouped_mm/batched_mm gate is fused",
    )


def plan(module: nn.Module) -> Plan | None:
    """How to fuse `module`, why it cannot be, or None when it is not a norm/MLP/experts at all."""
    cls = type(module)
    name = cls.__name__
    if name.lower().endswith("rmsnorm"):
        return _plan_rms_norm(module, cls, name)
    if isinstance(module, nn.LayerNorm) or name.endswith("LayerNorm"):
        return _plan_layer_norm(module, cls, name)
    if hasattr(cls, "_apply_gate"):
        return _plan_experts(module, cls, name)
    submodules = dict(module.named_children())
    if name.endswith("MLP") and ("gate_up_proj" in submodules or {"gate_proj", "up_proj"} <= submodules.keys()):
        return _plan_mlp(module, cls, name)
    return None
