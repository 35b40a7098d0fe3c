"""One-line patching of Hugging Face transformers models with fuseforge's fused kernels.

    from fuseforge.transformers import apply_kernels
    apply_kernels(model)        # before Trainer(model=model, ...) / SFTTrainer(model=model, ...)

Supported end to end (norms, RoPE, gated MLP, fused loss): see SUPPORTED_MODEL_TYPES.
Other models get the modules whose code is recognised and a warning for the rest.
Tested with transformers in TESTED_TRANSFORMERS.
"""

from fuseforge.transformers.auto import AutoFusedModelForCausalLM
from fuseforge.transformers.families import SUPPORTED_MODEL_TYPES
from fuseforge.transformers.loss import causal_lm_loss
from fuseforge.transformers.patching import (
    DEFAULT_FLAGS,
    FAMILY_FUNCTIONS,
    apply_kernels,
    get_patch_report,
    is_patched,
    patched,
    unpatch,
)
from fuseforge.transformers.report import PatchReport

# Oldest and newest transformers versions the test suite has been run against.
TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")

apply_kernels_to_llama = FAMILY_FUNCTIONS["apply_kernels_to_llama"]
apply_kernels_to_mistral = FAMILY_FUNCTIONS["apply_kernels_to_mistral"]
apply_kernels_to_mixtral = FAMILY_FUNCTIONS["apply_kernels_to_mixtral"]
apply_kernels_to_qwen2 = FAMILY_FUNCTIONS["apply_kernels_to_qwen2"]
apply_kernels_to_qwen3 = FAMILY_FUNCTIONS["apply_kernels_to_qwen3"]
apply_kernels_to_gemma2 = FAMILY_FUNCTIONS["apply_kernels_to_gemma2"]
apply_kernels_to_gemma3 = FAMILY_FUNCTIONS["apply_kernels_to_gemma3"]
apply_kernels_to_phi3 = FAMILY_FUNCTIONS["apply_kernels_to_phi3"]

__all__ = [
    "DEFAULT_FLAGS",
    "SUPPORTED_MODEL_TYPES",
    "TESTED_TRANSFORMERS",
    "AutoFusedModelForCausalLM",
    "PatchReport",
    "apply_kernels",
    "apply_kernels_to_gemma2",
    "apply_kernels_to_gemma3",
    "apply_kernels_to_llama",
    "apply_kernels_to_mistral",
    "apply_kernels_to_mixtral",
    "apply_kernels_to_phi3",
    "apply_kernels_to_qwen2",
    "apply_kernels_to_qwen3",
    "causal_lm_loss",
    "get_patch_report",
    "is_patched",
    "patched",
    "unpatch",
]
