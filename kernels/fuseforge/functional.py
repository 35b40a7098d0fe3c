"""The public differentiable ops: fused Triton forward and backward for each.

All take and return torch tensors on a CUDA device (or on the CPU under
TRITON_INTERPRET=1) and support autograd.
"""

from fuseforge.ops.clamped_swiglu import clamped_swiglu
from fuseforge.ops.cross_entropy import cross_entropy
from fuseforge.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from fuseforge.ops.glu import geglu, swiglu
from fuseforge.ops.grpo import fused_linear_grpo_loss
from fuseforge.ops.jsd import fused_linear_jsd, jsd
from fuseforge.ops.kl_div import kl_div
from fuseforge.ops.layer_norm import layer_norm
from fuseforge.ops.lora import lora_linear
from fuseforge.ops.nf4 import dequantize_nf4
from fuseforge.ops.preference import (
    fused_linear_cpo_loss,
    fused_linear_dpo_loss,
    fused_linear_kto_kl,
    fused_linear_kto_loss,
    fused_linear_orpo_loss,
    fused_linear_simpo_loss,
)
from fuseforge.ops.rms_norm import fused_add_rms_norm, rms_norm
from fuseforge.ops.rope import rope
from fuseforge.ops.token_logprobs import fused_linear_token_logprobs, fused_linear_token_objective

__all__ = [
    "clamped_swiglu",
    "cross_entropy",
    "dequantize_nf4",
    "fused_add_rms_norm",
    "fused_linear_cpo_loss",
    "fused_linear_cross_entropy",
    "fused_linear_dpo_loss",
    "fused_linear_grpo_loss",
    "fused_linear_jsd",
    "fused_linear_kto_kl",
    "fused_linear_kto_loss",
    "fused_linear_orpo_loss",
    "fused_linear_simpo_loss",
    "fused_linear_token_logprobs",
    "fused_linear_token_objective",
    "geglu",
    "jsd",
    "kl_div",
    "layer_norm",
    "lora_linear",
    "rms_norm",
    "rope",
    "swiglu",
]
