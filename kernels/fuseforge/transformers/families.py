"""The model families fuseforge supports end to end, keyed by `config.model_type`.

Norms, MLPs and RoPE are recognised from their code in any model (layers.py,
rope.py). What needs per-family knowledge is the causal-LM head: which class it is,
and what its forward does to the logits besides `lm_head` (Gemma's final-logit
softcapping) and to the loss (Mixtral's router load-balancing term). The loss is
only fused for these classes, whose forwards we have read and test.
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

    def causal_lm_class(self) -> type | None:
        try:
            module = importlib.import_module(self.modeling_module)
        except ImportError:
            return None
        return getattr(module, self.causal_lm, None)


def _family(name: str, prefix: str, *model_types: str, **loss) -> Family:
    return Family(
        name=name,
        model_types=model_types or (name,),
        modeling_module=f"transformers.models.{name}.modeling_{name}",
        causal_lm=f"{prefix}ForCausalLM",
        **loss,
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _family("llama", "Llama"),
        _family("mistral", "Mistral"),
        _family("mixtral", "Mixtral", router_aux_loss=True),
        _family("qwen2", "Qwen2"),
        _family("qwen3", "Qwen3"),
        _family("gemma2", "Gemma2", logit_softcap_attr="final_logit_softcapping"),
        # gemma3_text is Gemma3ForCausalLM; the multimodal "gemma3" gets its text stack's norms,
        # MLPs and RoPE fused, but its ForConditionalGeneration loss is not fused.
        _family("gemma3", "Gemma3", "gemma3_text", "gemma3", logit_softcap_attr="final_logit_softcapping"),
        _family("phi3", "Phi3"),
    )
}

_BY_MODEL_TYPE = {model_type: f for f in FAMILIES.values() for model_type in f.model_types}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_BY_MODEL_TYPE))


def family_for_model_type(model_type: str | None) -> Family | None:
    return _BY_MODEL_TYPE.get(model_type) if model_type else None
