"""One-line patching of Hugging Face transformers models with fuseforge's fused kernels.

    from fuseforge.transformers import apply_kernels
    apply_kernels(model)        # a model (or model class), before your own training loop
    apply_kernels(trainer)      # or a built transformers.Trainer / TRL trainer (SFT, DPO, KTO, GRPO, ...)

A trainer gets its model patched and is adapted to the fused loss, or the fused loss is
turned off where the trainer computes its loss itself (see trainers.TRAINER_POLICIES).
TRL's DPOTrainer (loss types sigmoid, hinge, ipo, robust) and GRPOTrainer (grpo, dr_grpo,
dapo, bnpo) train on fuseforge's fused DPO / GRPO losses from the hidden states and the LM
head weight, never building [tokens, vocab] logits: same loss, gradients and metrics, except
the full-vocabulary ones (`entropy`, DPO's `mean_token_accuracy`; one warning); a
configuration they do not cover keeps TRL's loss, with one warning naming why.

A peft.PeftModel (LoRA, QLoRA) is patched with every kernel, plus peft's LoRA linears as one op each, and
the trainers' fused losses take PEFT policies (reference: the adapter disabled); see transformers/lora.py
(also `quantize_base_nf4`, QLoRA's NF4 base weights). Tested with peft in TESTED_PEFT.

Supported end to end (norms, RoPE, gated MLP, fused loss): see SUPPORTED_MODEL_TYPES.
Other models get the modules whose code is recognised and a warning for the rest.
Tested with transformers in TESTED_TRANSFORMERS and TRL in TESTED_TRL.
"""

from fuseforge.transformers.auto import AutoFusedModelForCausalLM
from fuseforge.transformers.families import SUPPORTED_MODEL_TYPES
from fuseforge.transformers.lora import TESTED_PEFT, quantize_base_nf4
from fuseforge.transformers.loss import Distillation, causal_lm_loss
from fuseforge.transformers.dispatch import (
    DEFAULT_FLAGS,
    FAMILY_FUNCTIONS,
    apply_kernels,
    get_patch_report,
    is_patched,
    patched,
    unpatch,
)
from fuseforge.transformers.patching import set_loss_chunk_size
from fuseforge.transformers.report import PatchReport
from fuseforge.transformers.trainers import TRAINER_POLICIES, TrainerPolicy

# Oldest and newest transformers versions the test suite has been run against.
TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")
# TRL version the trainer integration (apply_kernels(trainer)) is tested with.
TESTED_TRL = ("1.16.0",)

apply_kernels_to_llama = FAMILY_FUNCTIONS["apply_kernels_to_llama"]
apply_kernels_to_mistral = FAMILY_FUNCTIONS["apply_kernels_to_mistral"]
apply_kernels_to_mixtral = FAMILY_FUNCTIONS["apply_kernels_to_mixtral"]
apply_kernels_to_qwen2 = FAMILY_FUNCTIONS["apply_kernels_to_qwen2"]
apply_kernels_to_qwen3 = FAMILY_FUNCTIONS["apply_kernels_to_qwen3"]
apply_kernels_to_gemma2 = FAMILY_FUNCTIONS["apply_kernels_to_gemma2"]
apply_kernels_to_gemma3 = FAMILY_FUNCTIONS["apply_kernels_to_gemma3"]
apply_kernels_to_phi3 = FAMILY_FUNCTIONS["apply_kernels_to_phi3"]
apply_kernels_to_qwen3_moe = FAMILY_FUNCTIONS["apply_kernels_to_qwen3_moe"]
apply_kernels_to_gemma = FAMILY_FUNCTIONS["apply_kernels_to_gemma"]
apply_kernels_to_granite = FAMILY_FUNCTIONS["apply_kernels_to_granite"]
apply_kernels_to_smollm3 = FAMILY_FUNCTIONS["apply_kernels_to_smollm3"]
apply_kernels_to_olmo2 = FAMILY_FUNCTIONS["apply_kernels_to_olmo2"]
apply_kernels_to_olmo3 = FAMILY_FUNCTIONS["apply_kernels_to_olmo3"]
apply_kernels_to_glm4 = FAMILY_FUNCTIONS["apply_kernels_to_glm4"]
apply_kernels_to_exaone4 = FAMILY_FUNCTIONS["apply_kernels_to_exaone4"]
apply_kernels_to_gpt_oss = FAMILY_FUNCTIONS["apply_kernels_to_gpt_oss"]
apply_kernels_to_gemma4 = FAMILY_FUNCTIONS["apply_kernels_to_gemma4"]
apply_kernels_to_deepseek_v3 = FAMILY_FUNCTIONS["apply_kernels_to_deepseek_v3"]
apply_kernels_to_llama4 = FAMILY_FUNCTIONS["apply_kernels_to_llama4"]
apply_kernels_to_qwen2_5_vl = FAMILY_FUNCTIONS["apply_kernels_to_qwen2_5_vl"]
apply_kernels_to_qwen3_vl = FAMILY_FUNCTIONS["apply_kernels_to_qwen3_vl"]

__all__ = [
    "DEFAULT_FLAGS",
    "SUPPORTED_MODEL_TYPES",
    "TESTED_TRANSFORMERS",
    "TESTED_PEFT",
    "TESTED_TRL",
    "TRAINER_POLICIES",
    "TrainerPolicy",
    "AutoFusedModelForCausalLM",
    "Distillation",
    "PatchReport",
    "apply_kernels",
    "apply_kernels_to_deepseek_v3",
    "apply_kernels_to_exaone4",
    "apply_kernels_to_gemma",
    "apply_kernels_to_gemma2",
    "apply_kernels_to_gemma3",
    "apply_kernels_to_gemma4",
    "apply_kernels_to_glm4",
    "apply_kernels_to_gpt_oss",
    "apply_kernels_to_granite",
    "apply_kernels_to_llama",
    "apply_kernels_to_llama4",
    "apply_kernels_to_mistral",
    "apply_kernels_to_mixtral",
    "apply_kernels_to_olmo2",
    "apply_kernels_to_olmo3",
    "apply_kernels_to_phi3",
    "apply_kernels_to_qwen2",
    "apply_kernels_to_qwen2_5_vl",
    "apply_kernels_to_qwen3",
    "apply_kernels_to_qwen3_moe",
    "apply_kernels_to_qwen3_vl",
    "apply_kernels_to_smollm3",
    "causal_lm_loss",
    "get_patch_report",
    "is_patched",
    "patched",
    "quantize_base_nf4",
    "set_loss_chunk_size",
    "unpatch",
]
