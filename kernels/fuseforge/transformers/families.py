"""The model families fuseforge supports end to end, keyed by `config.model_type`.

Norms, MLPs and RoPE are recognised from their code in any model (layers.py,
rope.py). What needs per-family knowledge is the causal-LM head: which class it is,
and what its forward does to the logits besides `lm_head` (Gemma's final-logit
softcapping, Granite's division by `logits_scaling`) and to the loss (the router
load-balancing term of Mixtral and Qwen3-MoE). The loss is only fused for these
classes, whose forwards we have read and test.

`unfused` names what the library's kernels cannot do for a family, and why: the patch
report lists it as NOT patched (a known limitation, so without a warning). This table
is the one source of truth for what is fused per family; `FUSED_TABLE` renders it and
the README's table of supported models must match it (a test checks).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    modeling_module: str
    causal_lm: str
    logit_softcap_attr: str | None = None  # config attribute: logits = cap * tanh(logits / cap)
    router_aux_loss: bool = False  # forward adds router_aux_loss_coef * aux_loss to the loss
    logit_scale_attr: str | None = None  # config attribute: logits = lm_head(hidden) / value (Granite)
    unfused: tuple[tuple[str, str], ...] = ()  # (kernel flag, why the kernels cannot do it for this family)
    title: str = ""  # how the README names the family
    notes: str = ""  # the README table's notes column

    def unfused_reason(self, kernel: str) -> str | None:
        return dict(self.unfused).get(kernel)

    def causal_lm_class(self) -> type | None:
        try:
            module = importlib.import_module(self.modeling_module)
        except ImportError:
            return None
        return getattr(module, self.causal_lm, None)


def _family(name: str, prefix: str, *model_types: str, **facts) -> Family:
    return Family(
        name=name,
        model_types=model_types or (name,),
        modeling_module=f"transformers.models.{name}.modeling_{name}",
        causal_lm=f"{prefix}ForCausalLM",
        **{"title": prefix, **facts},
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _family("llama", "Llama", title="Llama 2/3"),
        _family("mistral", "Mistral"),
        _family("mixtral", "Mixtral", router_aux_loss=True, notes="each expert's SwiGLU; router aux loss kept"),
        _family("qwen2", "Qwen2"),
        _family("qwen3", "Qwen3", notes="q/k norms"),
        _family(
            "gemma2",
            "Gemma2",
            logit_softcap_attr="final_logit_softcapping",
            title="Gemma 2",
            notes="offset RMSNorm (Gemma casting), tanh GeGLU, final-logit softcap in the loss",
        ),
        # gemma3_text is Gemma3ForCausalLM; the multimodal "gemma3" gets its text stack's norms,
        # MLPs and RoPE fused, but its ForConditionalGeneration loss is not fused.
        _family(
            "gemma3",
            "Gemma3",
            "gemma3_text",
            "gemma3",
            logit_softcap_attr="final_logit_softcapping",
            title="Gemma 3",
            notes="as Gemma 2, plus q/k norms; the multimodal gemma3's loss is not fused",
        ),
        # Phi-4 (microsoft/phi-4, Phi-4-mini) ships as model_type "phi3": Phi3ForCausalLM, same modules.
        _family(
            "phi3",
            "Phi3",
            title="Phi-3, Phi-4",
            notes="fused gate_up projection, partial rotary; Phi-4 is model_type phi3",
        ),
        _family(
            "qwen3_moe",
            "Qwen3Moe",
            router_aux_loss=True,
            title="Qwen3-MoE",
            notes="each expert's SwiGLU; router aux loss kept",
        ),
        _family("gemma", "Gemma", title="Gemma", notes="offset RMSNorm (Gemma casting), tanh GeGLU"),
        _family(
            "granite",
            "Granite",
            logit_scale_attr="logits_scaling",
            notes="the loss divides logits by logits_scaling; embedding/residual/attention multipliers untouched",
        ),
        _family("smollm3", "SmolLM3", notes="RoPE only on the layers that use it (NoPE layers unchanged)"),
        _family("olmo2", "Olmo2", title="OLMo 2", notes="post-norm, q/k norms over all heads (OLMo RMSNorm casting)"),
        _family("olmo3", "Olmo3", title="OLMo 3", notes="as OLMo 2, with sliding-window layers"),
        _family("glm4", "Glm4", title="GLM-4", notes='interleaved-pair partial RoPE (layout="interleaved")'),
        _family("exaone4", "Exaone4", title="EXAONE 4", notes="post-norm, q/k norms; RoPE on the layers that use it"),
    )
}

_BY_MODEL_TYPE = {model_type: f for f in FAMILIES.values() for model_type in f.model_types}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_BY_MODEL_TYPE))


# The README's table of supported models: one row per family, kernel columns as the patch report names them.
TABLE_KERNELS = (
    ("rms_norm", "RMSNorm"),
    ("rope", "RoPE"),
    ("swiglu", "gated MLP"),
    ("fused_linear_cross_entropy", "fused loss"),
)


def fused_table() -> str:
    """The markdown table of FAMILIES: model types, and per kernel "yes" or "no" (reason in the report)."""
    head = "| family | model_type | " + " | ".join(label for _, label in TABLE_KERNELS) + " | notes |"
    rows = [head, "|" + "---|" * (3 + len(TABLE_KERNELS))]
    for f in FAMILIES.values():
        cells = ["no" if f.unfused_reason(kernel) else "yes" for kernel, _ in TABLE_KERNELS]
        rows.append(f"| {f.title} | {', '.join(f.model_types)} | " + " | ".join(cells) + f" | {f.notes} |")
    return "\n".join(rows)


def family_for_model_type(model_type: str | None) -> Family | None:
    return _BY_MODEL_TYPE.get(model_type) if model_type else None
