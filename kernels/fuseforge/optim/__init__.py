"""Optimizers whose update is one fused Triton pass (the model's ops live in `fuseforge.ops`)."""

from fuseforge.optim.master_adamw import MasterAdamW

__all__ = ["MasterAdamW"]
