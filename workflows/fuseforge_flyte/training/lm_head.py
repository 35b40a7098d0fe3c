"""Guard for fused linear cross-entropy under sharding: the loss must see the full lm_head weight.

The fused loss reads ``lm_head.weight`` directly inside the causal LM's forward
instead of calling ``lm_head(hidden)``. Under FSDP2 that weight is a DTensor shard
outside the forward of its FSDP unit, and under ZeRO-3 it is an empty placeholder
until a module hook gathers it: reading it there would silently compute the loss
against garbage. The engine keeps lm_head in the root FSDP unit (gathered while the
root forward runs) and registers it as an external parameter of the root module
for ZeRO-3; this guard checks, at the start of every root forward (after the
wrappers' own pre-forward hooks), that the weight really is whole.
"""

from __future__ import annotations

import torch


class PartitionedWeightError(RuntimeError):
    """The lm_head weight visible to the loss is a shard or a placeholder, not the full matrix."""


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        from torch.distributed._tensor import DTensor
    return isinstance(tensor, DTensor)


def check_full_lm_head(model: torch.nn.Module) -> None:
    """Raise PartitionedWeightError unless model's lm_head weight is the full [vocab, hidden] matrix."""
    head = model.get_output_embeddings()
    weight = head.weight
    expected = (head.out_features, head.in_features)
    problem = None
    if _is_dtensor(weight):
        problem = f"a DTensor shard (local shape {tuple(weight.to_local().shape)})"
    elif weight.numel() == 0:
        problem = "an empty placeholder (numel 0): the parameter is partitioned"
    elif tuple(weight.shape) != expected:
        problem = f"shaped {tuple(weight.shape)}"
    if problem is not None:
        raise PartitionedWeightError(
            f"lm_head.weight seen by the fused linear cross-entropy is {problem}, expected the full "
            f"[vocab, hidden] = {list(expected)} matrix; gather it before the loss reads it "
            f"(FSDP: keep lm_head in an FSDP unit whose forward is running; ZeRO-3: "
            f"deepspeed.zero.register_external_parameter or GatheredParameters)"
        )


def install_lm_head_guard(model: torch.nn.Module):
    """Check the lm_head weight at the start of each forward of `model` (hooks registered later run later)."""
    return model.register_forward_pre_hook(lambda module, args: check_full_lm_head(module))
