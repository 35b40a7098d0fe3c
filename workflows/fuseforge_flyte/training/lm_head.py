"""Guard for fused linear cross-entropy under sharding: the loss must see the full lm_head weight.

The fused loss computes logits-free cross-entropy from ``lm_head.weight`` inside
the (patched) lm_head forward. Under FSDP2 that weight is a DTensor shard outside
the forward of its FSDP unit, and under ZeRO-3 an empty placeholder until a module
hook gathers it: a loss reading it at the wrong moment would compute against
garbage. The engine keeps lm_head in the root FSDP unit (gathered for the whole root
forward) and, for ZeRO-3, registers the weight as an external parameter of the
causal LM so it is also gathered for the root's backward, where the fused loss's
weight gradient arrives. This guard checks, each time lm_head runs and after the
wrappers' own pre-forward hooks, that the weight really is whole.
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


def check_full_weight(head: torch.nn.Module) -> None:
    """Raise PartitionedWeightError unless `head.weight` is the full [out_features, in_features] matrix."""
    weight = head.weight
    expected = (getattr(head, "out_features", None), getattr(head, "in_features", None))
    problem = None
    if _is_dtensor(weight):
        problem = f"a DTensor shard (local shape {tuple(weight.to_local().shape)})"
    elif weight.numel() == 0:
        problem = "an empty placeholder (numel 0): the parameter is partitioned"
    elif None not in expected and tuple(weight.shape) != expected:
        problem = f"shaped {tuple(weight.shape)}"
    if problem is not None:
        raise PartitionedWeightError(
            f"lm_head.weight seen by the fused linear cross-entropy is {problem}, expected the full "
            f"[vocab, hidden] = {list(expected)} matrix; gather it before the loss reads it "
            f"(FSDP: keep lm_head in an FSDP unit whose forward is running; ZeRO-3: "
            f"deepspeed.zero.register_external_parameter or GatheredParameters)"
        )


def check_full_lm_head(model: torch.nn.Module) -> None:
    """check_full_weight on the model's output embedding (lm_head)."""
    check_full_weight(model.get_output_embeddings())


def install_lm_head_guard(model: torch.nn.Module):
    """Check lm_head's weight each time lm_head runs, after the wrappers' own pre-forward hooks.

    fuseforge's fused loss reads the weight inside lm_head's forward, so this sees
    exactly what the loss will read (hooks run in registration order, and FSDP2 and
    ZeRO-3 registered theirs when the model was wrapped).
    """
    return model.get_output_embeddings().register_forward_pre_hook(lambda head, args: check_full_weight(head))
