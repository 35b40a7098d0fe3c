"""The model families fuseforge supports end to end, keyed by `config.model_type`.

Norms, MLPs and RoPE are recognised from their code in any model (layers.py,
rope.py). What needs per-family knowledge is the causal-LM head: which class it is,
and what its forward does to the logits besides `lm_head` (Gemma's final-logit
softcapping, Granite's division by `logits_scaling`) and to the loss (the router
load-balancing term of Mixtral, Qwen3-MoE and GPT-OSS). The loss is only fused for these
classes, whose forwards we have read and test.

Multimodal families (Qwen2.5-VL, Qwen3-VL, Gemma 3's image-text model) fuse their
language model and the loss of their `multimodal_lm` class (a ForConditionalGeneration
whose forward is `lm_head(hidden)` then the stock causal-LM loss); their vision tower
and projector (`vision_modules`) are left exactly as they are.

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
    causal_lm: str | None  # the text-only ForCausalLM class (None: the family has none)
    logit_softcap_attr: str | None = None  # config attribute: logits = cap * tanh(logits / cap)
    router_aux_loss: bool = False  # forward adds router_aux_loss_coef * aux_loss to the loss
    logit_scale_attr: str | None = None  # config attribute: logits = lm_head(hidden) / value (Granite)
    unfused: tuple[tuple[str, str], ...] = ()  # (kernel flag, why the kernels cannot do it for this family)
    title: str = ""  # how the README names the family
    notes: str = ""  # the README table's notes column
    # The image-text class whose loss is fused too. Its forward is lm_head(hidden), then the stock loss,
    # with none of the logit/aux-loss facts above (Gemma 3's multimodal forward does not softcap).
    multimodal_lm: str | None = None
    vision_modules: tuple[str, ...] = ()  # attribute names of the vision tower / projector: never patched

    def unfused_reason(self, kernel: str) -> str | None:
        return dict(self.unfused).get(kernel)

    def causal_lm_class(self) -> type | None:
        return self._modeling_class(self.causal_lm)

    def multimodal_lm_class(self) -> type | None:
        return self._modeling_class(self.multimodal_lm)

    def _modeling_class(self, name: str | None) -> type | None:
        if name is None:
            return None
        try:
            module = importlib.import_module(self.modeling_module)
        except ImportError:
            return None
        return getattr(module, name, None)


def _family(name: str, prefix: str, *model_types: str, **facts) -> Family:
    return Family(
        name=name,
        model_types=model_types or (name,),
        modeling_module=f"transformers.models.{name}.modeling_{name}",
        **{"causal_lm": f"{prefix}ForCausalLM", "title": prefix, **facts},
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
        # gemma3_text is Gemma3ForCausalLM (softcapped logits); the image-text "gemma3" is
        # Gemma3ForConditionalGeneration, whose forward (5.17-5.24) applies no softcap: lm_head, then the loss.
        _family(
            "gemma3",
            "Gemma3",
            "gemma3_text",
            "gemma3",
            logit_softcap_attr="final_logit_softcapping",
            multimodal_lm="Gemma3ForConditionalGeneration",
            vision_modules=("vision_tower", "multi_modal_projector"),
            title="Gemma 3",
            notes="as Gemma 2, plus q/k norms; image-text gemma3: language model and loss fused "
            "(its forward has no logit softcap), SigLIP tower and projector as they are",
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
        # DeepSeek-V3's forward returns router logits but adds no router aux loss (5.17-5.24): none to keep.
        _family(
            "deepseek_v3",
            "DeepseekV3",
            title="DeepSeek-V3",
            notes="MLA with its q/kv latent norms; RoPE in both layouts (rope_interleave: interleaved pairs "
            "to halves); dense MLPs, shared experts and each routed expert's SwiGLU; sigmoid router as is",
        ),
        # Llama4ForCausalLM (model_type llama4_text) adds no router aux loss either (5.17-5.24).
        _family(
            "llama4",
            "Llama4",
            "llama4_text",
            "llama4",
            # Image-text "llama4": its forward projects through language_model.lm_head, then the stock loss.
            multimodal_lm="Llama4ForConditionalGeneration",
            vision_modules=("vision_model", "multi_modal_projector"),
            title="Llama 4",
            notes="complex-multiplication RoPE as interleaved pairs (NoPE layers unchanged), L2 q/k norm; "
            "dense MLPs, shared expert and the batched experts' SwiGLU; sigmoid router as is; image-text llama4: "
            "language model and loss fused, vision model and projector as they are",
        ),
        _family(
            "gpt_oss",
            "GptOss",
            router_aux_loss=True,
            title="GPT-OSS",
            notes="experts' clamped SwiGLU (clamped_swiglu op: interleaved gate/up, biases); half-width cos/sin "
            "RoPE; attention sinks as they are; router aux loss kept",
        ),
        # Text-only Gemma 4 (Gemma4ForCausalLM, model_type gemma4_text); the image-text "gemma4" is not listed.
        _family(
            "gemma4",
            "Gemma4",
            "gemma4_text",
            logit_softcap_attr="final_logit_softcapping",
            title="Gemma 4",
            notes="RMSNorm without offset (also the unscaled v-norm), q/k norms, tanh GeGLU (MLP and MoE experts), "
            "RoPE per tensor "
            "(proportional partial RoPE on global layers), per-layer embeddings and KV sharing as they are, "
            "final-logit softcap in the loss",
        ),
        # mRoPE: the rotary embedding module merges the temporal/height/width sections into ordinary
        # [batch, seq, head_dim] cos/sin (Qwen3-VL interleaved), then the standard apply_rotary_pos_emb runs.
        _family(
            "qwen2_5_vl",
            "Qwen2_5_VL",
            causal_lm=None,
            multimodal_lm="Qwen2_5_VLForConditionalGeneration",
            vision_modules=("visual",),
            title="Qwen2.5-VL",
            notes="language model and loss fused; mRoPE sections merged into cos/sin upstream, vision tower as is",
        ),
        _family(
            "qwen3_vl",
            "Qwen3VL",
            causal_lm=None,
            multimodal_lm="Qwen3VLForConditionalGeneration",
            vision_modules=("visual",),
            title="Qwen3-VL",
            notes="as Qwen2.5-VL (interleaved mRoPE), q/k norms; vision tower as is",
        ),
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
