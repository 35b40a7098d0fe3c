"""Drop-in nn.Modules backed by fuseforge's fused kernels."""

from fuseforge.modules.distill import FusedLinearJSDLoss, JSDLoss, KLDivLoss
from fuseforge.modules.glu import GeGLUMLP, SwiGLUMLP
from fuseforge.modules.losses import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from fuseforge.modules.norms import FusedAddRMSNorm, LayerNorm, RMSNorm

__all__ = [
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "FusedAddRMSNorm",
    "FusedLinearJSDLoss",
    "GeGLUMLP",
    "JSDLoss",
    "KLDivLoss",
    "LayerNorm",
    "RMSNorm",
    "SwiGLUMLP",
]
