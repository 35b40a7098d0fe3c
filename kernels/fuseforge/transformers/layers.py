"""Fused replacements for Hugging Face leaf modules (norms, gated MLPs, MoE experts) and decoder layers.

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
- Gemma 4 RMSNorm: as OLMo's (no offset), with or without a weight (`with_scale`).
- `down(act(gate(x)) * up(x))` and Phi-3's `gate_up_proj` split, act = SiLU or GELU.
- MoE experts with concatenated `[gate; up]` expert weights (Mixtral and ~50 others), SiLU or
  tanh GELU (Gemma 4's MoE layers).
- Llama 4: its RMSNorm (Llama casting, `eps`), its parameter-free L2 qk-norm (the same
  normalisation without a weight), its MLP (`activation_fn`) and its experts, which run every
  token through every expert as batched matmuls, `up * act(gate)`.
- GPT-OSS experts: their clamped SwiGLU gate on interleaved gate/up (`clamped_swiglu`).
- Decoder layers (pre-norm as Llama's, sandwich-norm as Gemma 2/3's): the residual add before the MLP's
  norm, inside that norm's kernel once the norms are swapped (`plan_decoder_layer`, a second pass).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fuseforge.functional import clamped_swiglu, fused_add_rms_norm, geglu, layer_norm, rms_norm, swiglu
from fuseforge.transformers._fingerprint import matches

# Verified implementation fingerprints (see _fingerprint.py), transformers 5.17-5.24.
LLAMA_RMS_NORM_FORWARD = frozenset({"607a0bc599d3"})
GEMMA_RMS_NORM_FORWARD = frozenset({"b2efe7f0a208"})
GEMMA_RMS_NORM_NORM = frozenset({"fd8d7a06072d"})
OLMO_RMS_NORM_FORWARD = frozenset({"a46c8ec460cb"})  # (self.weight * hidden_states).to(input_dtype); verified on 5.24
# Llama 4 (5.17 and 5.24): RMSNorm `_norm(x.float()).type_as(x) * self.weight`, and the parameter-free
# L2Norm `_norm(x.float()).type_as(x)`, both with GEMMA_RMS_NORM_NORM's x * rsqrt(mean(x^2) + eps).
LLAMA4_RMS_NORM_FORWARD = frozenset({"9d52d7421a94"})
L2_NORM_FORWARD = frozenset({"0a51f54893bb"})
SPLIT_GATED_MLP_FORWARD = frozenset({"7e0c35e5ee8b"})  # down_proj(act_fn(gate_proj(x)) * up_proj(x))
FUSED_GATE_UP_MLP_FORWARD = frozenset({"02e678880f6a"})  # Phi-3: gate_up_proj, chunk, activation_fn
# Llama 4 (5.17 and 5.24): down_proj(activation_fn(gate_proj(x)) * up_proj(x)) in two statements.
SPLIT_GATED_MLP_ACTIVATION_FN_FORWARD = frozenset({"84a6714a8187"})
# Llama 4's experts (5.17 and 5.24): x viewed [experts, tokens, hidden], bmm with gate_up_proj
# [experts, hidden, 2I], chunk, up * act_fn(gate), bmm with down_proj [experts, I, hidden].
BATCHED_EXPERTS_FORWARD = frozenset({"3463e3a26b1e"})
EXPERTS_APPLY_GATE = frozenset({"b42fe38ed914"})  # transformers.integrations.moe._default_apply_gate
EXPERTS_EAGER_FORWARD = frozenset({"cc14b3ec6864", "ceb5cf870ea9"})  # 5.24 / 5.17 per-expert loop
# GPT-OSS experts: interleaved gate/up, clamp to limit, (up + 1) * gate * sigmoid(alpha * gate); the eager
# loop (with biases) calls self._apply_gate. Both bodies identical on 5.17 and 5.24.
GPT_OSS_EXPERTS_APPLY_GATE = frozenset({"8b834c6b9c92"})
GPT_OSS_EXPERTS_EAGER_FORWARD = frozenset({"65cf0bf9da69"})
# Decoder layers whose bodies pass every argument after hidden_states on to self_attn by name, then:
# pre-norm (Llama and ~60 families that copy it: Mistral, Qwen2/3, their MoE and VL variants, DeepSeek-V2/V3,
# GLM, Gemma 1, ...; Mixtral's and Qwen3-VL's with their own signatures): residual + attention,
# post_attention_layernorm, mlp, residual + mlp. 5.17 (`past_key_values`) and 5.24 (`cache`) each.
PRE_NORM_DECODER_LAYER_FORWARDS = frozenset({
    "4c99802155b5", "8e8333f59d73",  # Llama
    "51b15551392d", "dd054f74c81f",  # Mixtral, PhiMoE, MiniMax-M2
    "207de060ebb8", "0770cb40f481",  # Qwen3-VL text
})
# Sandwich (Gemma 2/3): post_attention_layernorm(attention), residual add, pre_feedforward_layernorm, mlp,
# post_feedforward_layernorm, residual add. 5.17 and 5.24.
SANDWICH_NORM_DECODER_LAYER_FORWARDS = frozenset({"f382dc052e52", "f69600846a65"})
# Gemma 4: fp32 throughout, x * pow(mean(x^2) + eps, -0.5), optional `* weight` (no offset), one cast at
# the end: the kernel's Gemma casting with offset 0 (offset 1 on a zero weight without scale). 5.17 and 5.24.
GEMMA4_RMS_NORM_FORWARD = frozenset({"21617bc3257b"})
GEMMA4_RMS_NORM_NORM = frozenset({"0c775492f618"})


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


class FusedRMSNormMixin:
    """An RMSNorm on the kernel; `norm(x, residual)` also takes a residual to add first, in the same pass.

    The pair form returns `(norm(x + residual), x + residual)` and is what the fused decoder layers
    call (through `__call__`, so module hooks, e.g. DeepSpeed ZeRO-3's parameter gathering, still run).
    Subclasses say which weight, epsilon, offset and casting HF's module computes with.
    """

    def _kernel_args(self, x: torch.Tensor) -> tuple[torch.Tensor, float, float, str]:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        weight, eps, offset, casting = self._kernel_args(hidden_states)
        if residual is None:
            return rms_norm(hidden_states, weight, eps, offset=offset, casting=casting)
        return fused_add_rms_norm(hidden_states, residual, weight, eps, offset, casting)


class LlamaRMSNormMixin(FusedRMSNormMixin):
    def _kernel_args(self, x):
        return self.weight, self.variance_epsilon, 0.0, "llama"


class GemmaRMSNormMixin(FusedRMSNormMixin):
    def _kernel_args(self, x):
        return self.weight, self.eps, 1.0, "gemma"


class OlmoRMSNormMixin(FusedRMSNormMixin):
    def _kernel_args(self, x):
        return self.weight, self.variance_epsilon, 0.0, "gemma"


class Gemma4RMSNormMixin(FusedRMSNormMixin):
    def _kernel_args(self, x):
        if self.with_scale:
            return self.weight, self.eps, 0.0, "gemma"
        # No scale (v_norm, the router's norm): offset 1 on a zero weight multiplies by exactly 1.
        return torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device), self.eps, 1.0, "gemma"


class EpsLlamaRMSNormMixin(FusedRMSNormMixin):
    """The Llama casting, with the epsilon in `eps` (Llama 4)."""

    def _kernel_args(self, x):
        return self.weight, self.eps, 0.0, "llama"


class L2NormMixin(FusedRMSNormMixin):
    """Parameter-free RMS normalisation (Llama 4's qk-norm): the Llama casting with a unit weight in
    x's dtype, so multiplying by it is exact and the output keeps x's dtype."""

    def _kernel_args(self, x):
        return torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), self.eps, 0.0, "llama"


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


class GeGLUTanhExpertsGateMixin:
    """The default gate with act_fn = tanh GELU (Gemma 4's MoE experts), fused."""

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_out.chunk(2, dim=-1)
        return geglu(gate, up, approximate="tanh")


class GeGLUTanhExpertsMixin(GeGLUTanhExpertsGateMixin, SwiGLUExpertsMixin):
    """The eager per-expert loop of SwiGLUExpertsMixin, through the GeGLU gate (first in the MRO)."""


# experts activation -> (eager loop + gate mixin, gate-only mixin, label suffix)
_EXPERTS_MIXINS = {
    "silu": (SwiGLUExpertsMixin, SwiGLUExpertsGateMixin, ""),
    "gelu_tanh": (GeGLUTanhExpertsMixin, GeGLUTanhExpertsGateMixin, ", geglu tanh"),
}


class GptOssExpertsMixin:
    """GPT-OSS's clamped SwiGLU gate, fused; used by the eager loop and grouped_mm/batched_mm alike."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.alpha, self.limit, layout="interleaved")


class BatchedSwiGLUExpertsMixin:
    """Llama 4's experts (every token through every expert, batched matmuls) with the fused SwiGLU gate."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate, up = torch.bmm(hidden_states, self.gate_up_proj).chunk(2, dim=-1)
        next_states = torch.bmm(swiglu(gate, up), self.down_proj)
        return next_states.view(-1, self.hidden_size)


class ResidualFusedDecoderLayer:
    """A decoder layer whose residual add before the MLP's norm runs inside that norm's kernel.

    HF (pre-norm, Llama): `h = residual + attn; y = norm(h); out = h + mlp(y)`. Fused: `y, h = norm(attn,
    residual)`: one pass instead of an add and a norm forward, and in the backward the norm writes the
    gradient of `h` (its own plus the skip's) instead of a separate accumulation. Same numbers: the sum is
    rounded to the stream's dtype before it is normalised, as HF's add rounds it. Where the attention
    branch's dtype differs from the residual stream's (fp32 weights under autocast), HF's promoting add is
    kept. The swapped class keeps HF's name (`keeps_class_name`): FSDP wrap policies and
    `_no_split_modules` look decoder layers up by it.

    The verified HF bodies (fingerprints below) pass every argument of the layer after `hidden_states` on to
    the attention by name, whatever the signature (they differ across families and transformers versions):
    so does `forward`, with the defaults and positional order of the layer's own signature.
    """

    keeps_class_name = True
    fused_norm = "post_attention_layernorm"  # the norm that takes the residual

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        original = cls.__dict__.get("_fuseforge_original")
        if original is not None:  # a fused class (see _swap.fused_class): read the layer's signature once
            params = list(inspect.signature(inspect.unwrap(original.forward)).parameters.values())[2:]
            cls._positional_arguments = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
            cls._argument_defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if len(args) > len(self._positional_arguments):
            raise TypeError(f"{type(self).__name__}.forward takes {len(self._positional_arguments) + 1} positional "
                            f"arguments after self, got {len(args) + 1}")
        attention_kwargs = {**self._argument_defaults, **dict(zip(self._positional_arguments, args)), **kwargs}
        attention_out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **attention_kwargs)
        return self._after_attention(attention_out, hidden_states)

    def _add_and_norm(self, branch: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + branch), residual + branch) with `fused_norm`, in one kernel when the dtypes agree."""
        norm = getattr(self, self.fused_norm)
        if branch.dtype == residual.dtype:
            return norm(branch, residual)
        residual = residual + branch
        return norm(residual), residual


class PreNormDecoderLayerMixin(ResidualFusedDecoderLayer):
    """PRE_NORM_DECODER_LAYER_FORWARDS: Llama and the families that copy its layer."""

    def _after_attention(self, attention_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        normed, residual = self._add_and_norm(attention_out, residual)
        return residual + self.mlp(normed)


class SandwichNormDecoderLayerMixin(ResidualFusedDecoderLayer):
    """SANDWICH_NORM_DECODER_LAYER_FORWARDS (Gemma 2/3): norms after attention and MLP as well as before;
    the residual add between them goes into the MLP's pre-norm."""

    fused_norm = "pre_feedforward_layernorm"

    def _after_attention(self, attention_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        normed, residual = self._add_and_norm(self.post_attention_layernorm(attention_out), residual)
        return residual + self.post_feedforward_layernorm(self.mlp(normed))


def _accepting_past_key_values(forward):
    """HF's 5.24 forwards still take the old name `past_key_values` (with a warning) through this decorator."""
    try:
        from transformers.utils.deprecation import deprecate_kwarg
    except ImportError:  # a transformers without it has no callers of the old name to serve
        return forward
    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)


class CachePreNormDecoderLayerMixin(PreNormDecoderLayerMixin):
    """For layers whose forward renames `past_key_values` to `cache` through HF's decorator (5.24)."""

    forward = _accepting_past_key_values(ResidualFusedDecoderLayer.forward)


class CacheSandwichNormDecoderLayerMixin(SandwichNormDecoderLayerMixin):
    forward = _accepting_past_key_values(ResidualFusedDecoderLayer.forward)


# verified forwards -> (mixin, mixin when the forward carries the `cache` rename decorator)
_DECODER_LAYER_MIXINS = (
    (PRE_NORM_DECODER_LAYER_FORWARDS, PreNormDecoderLayerMixin, CachePreNormDecoderLayerMixin),
    (SANDWICH_NORM_DECODER_LAYER_FORWARDS, SandwichNormDecoderLayerMixin, CacheSandwichNormDecoderLayerMixin),
)


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
        matches(cls.forward, LLAMA4_RMS_NORM_FORWARD)
        and matches(getattr(cls, "_norm", None), GEMMA_RMS_NORM_NORM)
        and _float_attr(module, "eps")
        and _has_vector_weight(module)
    ):
        return Plan("rms_norm", name, EpsLlamaRMSNormMixin)
    if (
        matches(cls.forward, GEMMA_RMS_NORM_FORWARD)
        and matches(getattr(cls, "_norm", None), GEMMA_RMS_NORM_NORM)
        and _float_attr(module, "eps")
        and _has_vector_weight(module)
    ):
        return Plan("rms_norm", name, GemmaRMSNormMixin)
    if (
        matches(cls.forward, GEMMA4_RMS_NORM_FORWARD)
        and matches(getattr(cls, "_norm", None), GEMMA4_RMS_NORM_NORM)
        and _float_attr(module, "eps")
        and isinstance(getattr(module, "with_scale", None), bool)
        and (_has_vector_weight(module) or not module.with_scale)
    ):
        return Plan("rms_norm", name, Gemma4RMSNormMixin)
    return Plan(
        "rms_norm", name, reason=f"{name}: implementation not recognised as Llama, Gemma, Gemma 4 or OLMo RMSNorm"
    )


def _plan_layer_norm(module: nn.Module, cls: type, name: str) -> Plan:
    if cls is nn.LayerNorm and len(module.normalized_shape) == 1:
        return Plan("layer_norm", name, LayerNormMixin)
    if cls is nn.LayerNorm:
        return Plan("layer_norm", name, reason=f"{name}: normalises over {len(module.normalized_shape)} dims")
    return Plan("layer_norm", name, reason=f"{name}: not torch.nn.LayerNorm itself (custom subclass or code)")


def _plan_l2_norm(module: nn.Module, cls: type, name: str) -> Plan:
    if (
        matches(cls.forward, L2_NORM_FORWARD)
        and matches(getattr(cls, "_norm", None), GEMMA_RMS_NORM_NORM)
        and _float_attr(module, "eps")
        and not any(True for _ in module.parameters())
    ):
        return Plan("rms_norm", f"{name} (no weight)", L2NormMixin)
    return Plan("rms_norm", name, reason=f"{name}: implementation not recognised as Llama 4's L2 norm")


# (verified forwards, the module's activation attribute, mixins per activation)
_GATED_MLPS = (
    (SPLIT_GATED_MLP_FORWARD, "act_fn", SPLIT_MLP_MIXINS),
    (SPLIT_GATED_MLP_ACTIVATION_FN_FORWARD, "activation_fn", SPLIT_MLP_MIXINS),
    (FUSED_GATE_UP_MLP_FORWARD, "activation_fn", FUSED_GATE_UP_MLP_MIXINS),
)


def _plan_mlp(module: nn.Module, cls: type, name: str) -> Plan:
    for forwards, act_attr, mixins in _GATED_MLPS:
        if matches(cls.forward, forwards):
            activation = classify_activation(getattr(module, act_attr, None))
            if activation is not None:
                return Plan("swiglu", f"{name} ({_GLU_NAMES[activation]})", mixins[activation])
            act = type(getattr(module, act_attr, None)).__name__
            return Plan("swiglu", name, reason=f"{name}: activation {act} is not SiLU/GELU")
    return Plan("swiglu", name, reason=f"{name}: MLP implementation not recognised as a gated (GLU) MLP")


def _plan_batched_experts(module: nn.Module, cls: type, name: str) -> Plan:
    weights_ok = all(
        isinstance(getattr(module, attr, None), nn.Parameter) and getattr(module, attr).dim() == 3
        for attr in ("gate_up_proj", "down_proj")
    )
    if not (matches(cls.forward, BATCHED_EXPERTS_FORWARD) and weights_ok and isinstance(module.hidden_size, int)):
        return Plan("swiglu", name, reason=f"{name}: experts implementation not recognised")
    if classify_activation(getattr(module, "act_fn", None)) != "silu":
        return Plan("swiglu", name, reason=f"{name}: experts activation is not SiLU")
    return Plan("swiglu", f"{name} (experts, batched)", BatchedSwiGLUExpertsMixin)


def _plan_gpt_oss_experts(module: nn.Module, cls: type, name: str) -> Plan:
    """Experts whose `_apply_gate` is GPT-OSS's clamped SwiGLU (verified), with usable alpha/limit."""
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not (_float_attr(module, "alpha") and _float_attr(module, "limit")) or not (math.isfinite(alpha) and limit >= 0):
        return Plan("swiglu", name, reason=f"{name}: clamped SwiGLU alpha={alpha!r}/limit={limit!r} not usable")
    if matches(inspect.unwrap(cls.forward), GPT_OSS_EXPERTS_EAGER_FORWARD):
        return Plan("swiglu", f"{name} (experts, clamped swiglu)", GptOssExpertsMixin)
    return Plan(
        "swiglu",
        f"{name} (experts, clamped swiglu, grouped_mm/batched_mm only)",
        GptOssExpertsMixin,
        reason=f"{name}: eager experts loop not recognised; only the grouped_mm/batched_mm gate is fused",
    )


def _plan_experts(module: nn.Module, cls: type, name: str) -> Plan:
    if matches(cls._apply_gate, GPT_OSS_EXPERTS_APPLY_GATE):
        return _plan_gpt_oss_experts(module, cls, name)
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
    activation = classify_activation(getattr(module, "act_fn", None))
    if activation not in _EXPERTS_MIXINS:
        return Plan("swiglu", name, reason=f"{name}: experts activation is not SiLU or tanh GELU")
    eager_mixin, gate_mixin, kind = _EXPERTS_MIXINS[activation]
    if matches(inspect.unwrap(cls.forward), EXPERTS_EAGER_FORWARD):
        return Plan("swiglu", f"{name} (experts{kind})", eager_mixin)
    return Plan(
        "swiglu",
        f"{name} (experts{kind}, grouped_mm/batched_mm only)",
        gate_mixin,
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
    if name.endswith("L2Norm"):
        return _plan_l2_norm(module, cls, name)
    if hasattr(cls, "_apply_gate"):
        return _plan_experts(module, cls, name)
    if name.endswith("Experts") and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
        return _plan_batched_experts(module, cls, name)
    submodules = dict(module.named_children())
    if name.endswith("MLP") and ("gate_up_proj" in submodules or {"gate_proj", "up_proj"} <= submodules.keys()):
        return _plan_mlp(module, cls, name)
    return None


def plan_decoder_layer(module: nn.Module) -> Plan | None:
    """The fused residual add for a verified decoder layer whose norm after attention is already on the
    kernel (the leaves are swapped first); None for every other module, with no reason given: layers we
    do not recognise keep HF's add, which costs speed, never correctness."""
    cls = type(module)
    forward = inspect.unwrap(cls.forward)
    for fingerprints, mixin, cache_mixin in _DECODER_LAYER_MIXINS:
        if not matches(forward, fingerprints):
            continue
        norm = getattr(module, mixin.fused_norm, None)
        if not isinstance(norm, FusedRMSNormMixin) or "forward" in norm.__dict__ or norm._forward_hooks:
            return None  # not on the kernel, or hooks that expect one tensor back
        if cls.forward is not forward and "cache" in inspect.signature(forward).parameters:
            mixin = cache_mixin
        return Plan("rms_norm", f"{cls.__name__} (residual add in {mixin.fused_norm})", mixin)
    return None
