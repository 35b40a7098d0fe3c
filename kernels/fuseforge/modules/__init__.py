"""Drop-in nn.Modules backed by fuseforge's fused kernels."""

from fuseforge.modules.distill import FusedLinearJSDLoss, JSDLoss, KLDivLoss
from fuseforge.modules.glu import GeGLUMLP, SwiGLUMLP
from fuseforge.modules.grpo import FusedLinearGRPOLoss
from fuseforge.modules.losses import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from fuseforge.modules.norms import FusedAddRMSNorm, LayerNorm, RMSNorm
from fuseforge.modules.preference import (
    FusedLinearCPOLoss,
    FusedLinearDPOLoss,
    FusedLinearKTOLoss,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
)

__all__ = [
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "FusedAddRMSNorm",
    "FusedLinearCPOLoss",
    "FusedLinearDPOLoss",
    "FusedLinearGRPOLoss",
    "FusedLinearJSDLoss",
    "FusedLinearKTOLoss",
    "FusedLinearORPOLoss",
    "FusedLinearSimPOLoss",
    "GeGLUMLP",
    "JSDLoss",
    "KLDivLoss",
    "LayerNorm",
    "RMSNorm",
    "SwiGLUMLP",
]
