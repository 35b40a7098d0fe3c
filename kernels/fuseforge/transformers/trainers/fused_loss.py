"""What the fused DPO, KTO and GRPO trainer losses share: the backbone / LM head split, the settings none of them
covers, running inside the trainer's model call, and the reference model's arguments.

PEFT policies run these losses too: without a reference model, the reference is the policy with its adapter
disabled (TRL's "ref" adapter when TRL made one), its last hidden states computed under `no_grad` and fed to the
same fused loss with the frozen LM head, so no [tokens, vocab] logits are built for it either.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fuseforge.transformers.lora import inner_model, is_peft_model
from fuseforge.transformers.loss import LOGIT_TRANSFORMS, active_head
from fuseforge.transformers.trainers.policy import unwrap_model


def _overrides_below(trainer, known: str, names: tuple[str, ...]) -> str | None:
    """The first of `names` a subclass defines below TRL's class `known` (None: none is overridden)."""
    for cls in type(trainer).__mro__:
        if cls.__name__ == known and cls.__module__.split(".")[0] == "trl":
            return None
        for name in names:
            if name in cls.__dict__:
                return f"{cls.__name__}.{name}"
    return None


def _backbone(model: nn.Module):
    """(the decoder that returns last_hidden_state, the LM head) of a causal LM (inside a PeftModel: its
    transformers model, whose adapted layers peft injected in place), or None."""
    model = inner_model(model)
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = active_head(head) if head is not None else None  # peft's modules_to_save: the copy in use
    if not isinstance(base, nn.Module) or base is model or head is None or not isinstance(
        getattr(head, "weight", None), torch.Tensor
    ):
        return None
    return base, head


def reference_unsupported(trainer) -> str | None:
    """Why the fused preference losses cannot take this trainer's reference (None: they can): they need
    precomputed log-probs or a reference causal LM whose head gives plain logits."""
    if getattr(trainer, "precompute_ref_logps", False) or _adapter_reference(trainer):
        return None
    ref = unwrap_model(trainer, getattr(trainer, "ref_model", None))
    if not isinstance(ref, nn.Module) or _backbone(ref) is None:
        return "the reference log-probs come neither from precomputed log-probs nor a reference causal LM"
    ref_config = ref.config.get_text_config() if hasattr(ref.config, "get_text_config") else ref.config
    if any(getattr(ref_config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return "the reference model scales or caps its logits"
    return None


def common_unsupported(trainer, model: nn.Module, known: str) -> str | None:
    """Settings no fused trainer loss covers (MoE router loss, Liger, parallelism, logit scaling, overrides)."""
    args = trainer.args
    if getattr(trainer, "aux_loss_enabled", False):
        return "the MoE router load-balancing loss is added by TRL's fused LM head"
    if getattr(args, "use_liger_kernel", False):
        return "Liger kernels (use_liger_kernel=True) replace the model's forward"
    accelerator = getattr(trainer, "accelerator", None)
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and (getattr(config, "sp_enabled", False) or getattr(config, "cp_enabled", False)):
        return "context / sequence parallelism shards the sequences before the loss"
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP / DeepSpeed shard the LM head weight, which the fused loss reads whole"
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scaled = [name for name in LOGIT_TRANSFORMS if getattr(text_config, name, None) not in (None, 1, 1.0)]
    if scaled:
        return f"the model scales or caps its logits ({', '.join(scaled)})"
    overridden = _overrides_below(trainer, known, ("compute_loss", "_compute_loss"))
    if overridden is not None:
        return f"{overridden} is overridden and may compute the loss differently"
    if _backbone(model) is None:
        return f"{type(model).__name__} has no separate backbone (base_model) and LM head"
    return None


def last_hidden(model: nn.Module, kwargs: dict) -> tuple[torch.Tensor, nn.Module]:
    """(the backbone's last hidden states predicting tokens 1.. (shifted), on the head's device; the LM head)."""
    base, head = _backbone(model)
    hidden = base(**kwargs).last_hidden_state[:, :-1]
    return hidden.to(head.weight.device), head


@contextlib.contextmanager
def forward_as(module: nn.Module, fn):
    """`module`'s forward is `fn` for the calls made inside.

    The fused trainer losses call the trainer's model (DDP's wrapper included: its forward prepares the
    gradient all-reduce, which a direct call of the backbone would skip, leaving the ranks' replicas to
    drift apart), while what runs inside is the backbone and the fused loss on the module's parameters.
    """
    previous = module.__dict__.get("forward", _MISSING)
    module.forward = fn
    try:
        yield
    finally:
        if previous is _MISSING:
            del module.forward
        else:
            module.forward = previous


_MISSING = object()


def _adapter_reference(trainer) -> bool:
    """Whether the reference is the policy's PeftModel with its adapter disabled (or its "ref" adapter), as TRL
    does when a PEFT policy comes without a reference model."""
    return getattr(trainer, "ref_model", None) is None and is_peft_model(unwrap_model(trainer, trainer.model))


def reference_args(trainer, kwargs: dict, precomputed: torch.Tensor | None, device) -> dict:
    """The reference arguments of a fused preference loss: TRL's precomputed per-sequence log-prob sums, or the
    frozen reference model's last hidden states and head (computed here without gradient); for a PEFT policy
    without a reference model, the policy's with its adapter disabled (TRL's "ref" adapter where it made one)."""
    if trainer.precompute_ref_logps:
        return {"ref_logps": precomputed.to(device)}
    adapter = contextlib.nullcontext()
    ref_model = unwrap_model(trainer, trainer.ref_model)
    if _adapter_reference(trainer):
        from trl.trainer.utils import use_adapter

        ref_model = unwrap_model(trainer, trainer.model)
        adapter = use_adapter(ref_model, adapter_name="ref" if "ref" in ref_model.peft_config else None)
    with torch.no_grad(), _no_checkpointing(trainer), adapter:
        ref_hidden, ref_head = last_hidden(ref_model, kwargs)
    return {"ref_hidden": ref_hidden.to(device), "ref_weight": ref_head.weight, "ref_bias": ref_head.bias}


def _no_checkpointing(trainer):
    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:  # pragma: no cover - TRL moved it
        return contextlib.nullcontext()
    return disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)


def vocab_mean_logits(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """Mean over the vocabulary of each token's logits, hidden @ weight.mean(0) (+ bias.mean()), in float64."""
    weight = head.weight.detach().double()
    mean = hidden.detach().double() @ weight.mean(0)
    if getattr(head, "bias", None) is not None:
        mean = mean + head.bias.detach().double().mean()
    return mean

