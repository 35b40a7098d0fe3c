"""TRL's GRPOTrainer: training steps run fuseforge's fused_linear_grpo_loss on the policy's last hidden states and LM
head weight (TRL's loss types, importance sampling levels, `delta`, `beta` with the reference log-probs TRL stores in
the batch, TRL's gradient-accumulation normalisation). The loss, gradients and metrics (kl, clip_ratio/*) are TRL's;
GRPO_LOGITS_METRICS need every logit and are not logged in training (one warning). Generation and TRL's scoring of
old / reference log-probs between updates stay TRL's. What falls back to TRL's loss (one warning naming the
reason): grpo_unsupported; batches with a `tool_mask` take TRL's loss too (one warning).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from fuseforge.loss_args import IGNORE_INDEX
from fuseforge.ops.grpo import fused_linear_grpo_loss
from fuseforge.transformers.trainers.fused_loss import common_unsupported, forward_as, last_hidden
from fuseforge.transformers.trainers.policy import FUSED_LOSS_FLAG, unwrap_model

# Training metric TRL's GRPOTrainer computes from full-vocabulary statistics the fused GRPO loss never builds.
GRPO_LOGITS_METRICS = ("entropy",)


def grpo_unsupported(trainer, model: nn.Module) -> str | None:
    """Why this GRPOTrainer's configuration is not the fused GRPO loss (None: it is)."""
    from fuseforge.ops.grpo import GRPO_LOSS_TYPES

    args = trainer.args
    if trainer.loss_type not in GRPO_LOSS_TYPES:
        return f"GRPOConfig(loss_type={trainer.loss_type!r}): the fused GRPO loss covers {GRPO_LOSS_TYPES}"
    if getattr(trainer, "off_policy_mask_threshold", None) is not None:
        return "GRPOConfig(off_policy_mask_threshold=...) masks sequences by their sampling KL"
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        return "GRPOConfig(top_entropy_quantile<1) masks tokens by their entropy, which needs every logit"
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return "the entropy bonus needs every logit"
    if getattr(trainer, "use_vllm", False):
        return "vLLM generation (importance-sampling correction against the sampler's log-probs)"
    if getattr(trainer, "_is_vlm", False):
        return "vision-language inputs"
    if getattr(args, "cast_lm_head_to_fp32", False):
        return "GRPOConfig(cast_lm_head_to_fp32=True)"
    return common_unsupported(trainer, model, "GRPOTrainer")


def adapt_grpo(trainer, model: nn.Module, options: dict) -> str | None:
    """Training steps compute TRL's GRPO loss with fused_linear_grpo_loss."""
    name = type(trainer).__name__
    if not options.get(FUSED_LOSS_FLAG, True):
        return None
    reason = grpo_unsupported(trainer, model)
    if reason is not None:
        warnings.warn(
            f"fuseforge: {name} keeps TRL's own GRPO loss (no fused GRPO loss): {reason}", UserWarning, stacklevel=4
        )
        return f"fused_linear_grpo_loss: off for {name}: {reason}"
    original = trainer.compute_loss
    chunk_size = options.get("loss_chunk_size")
    args = trainer.args
    tool_warned = []

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        """GRPOTrainer._compute_loss's training step with fused_linear_grpo_loss in place of TRL's fused LM head."""
        if return_outputs or not trainer.model.training:
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if "tool_mask" in inputs:  # known only per batch
            if not tool_warned:
                tool_warned.append(True)
                warnings.warn(f"fuseforge: {name} keeps TRL's own GRPO loss for batches with a tool_mask",
                              UserWarning, stacklevel=2)
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        out, device = _fused_grpo_forward(trainer, model, inputs, args, chunk_size)
        mask = inputs["completion_mask"].to(device)
        loss = out.loss
        if trainer.loss_type != "dapo":
            loss = loss / trainer.current_gradient_accumulation_steps
        _log_grpo_metrics(trainer, out, mask, inputs["advantages"], inputs.get("old_per_token_logps"))
        return loss

    compute_loss._fuseforge_wrapped = original
    trainer.compute_loss = compute_loss
    warnings.warn(
        f"fuseforge: {name}'s training loss runs through fuseforge's fused GRPO loss; its training metric "
        f"{' and '.join(GRPO_LOGITS_METRICS)} is not logged: it needs every logit, which the fused loss never "
        "builds (evaluation still logs it). apply_kernels(trainer, fused_linear_cross_entropy=False) keeps it, "
        "with TRL's own loss.",
        UserWarning,
        stacklevel=4,
    )
    return f"trainer: {name}'s training loss is fused_linear_grpo_loss (loss_type={trainer.loss_type!r})"


def _batch_loss_args(trainer, inputs: dict, args) -> dict:
    """fused_linear_grpo_loss's arguments TRL keeps in the batch besides the tokens: the reference log-probs (beta != 0)
    and, for dapo, TRL's normaliser (the generation's completion tokens, per process and accumulated micro-batch)."""
    extra = {}
    if trainer.beta != 0.0:
        extra["ref_logps"] = inputs["ref_per_token_logps"]
    if trainer.loss_type == "dapo":
        items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        steps = trainer.current_gradient_accumulation_steps
        extra["num_items_in_batch"] = items * steps / args.steps_per_generation
    return extra


def _fused_grpo_forward(trainer, model, inputs: dict, args, chunk_size):
    """The trainer's model called on the prompt and completion tokens, running the backbone and
    fused_linear_grpo_loss over the completion tokens inside (forward_as): (the loss's output, its device)."""
    accelerator = trainer.accelerator
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    n_keep = completion_ids.size(1)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    for key in ("token_type_ids", "mm_token_type_ids"):
        if inputs.get(key) is not None:
            kwargs[key] = inputs[key]
    advantages = inputs["advantages"]
    old = inputs.get("old_per_token_logps")
    loss_type = trainer.loss_type
    extra = _batch_loss_args(trainer, inputs, args)

    def fused_step(**kwargs):
        with accelerator.autocast():
            hidden, head = last_hidden(unwrap_model(trainer, model), kwargs)
            hidden = hidden[:, -n_keep:]
            target = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)[:, 1:][:, -n_keep:].to(
                hidden.device)
            out = fused_linear_grpo_loss(
                hidden, head.weight, target, advantages, head.bias, old_logps=old, loss_type=loss_type,
                beta=trainer.beta, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
                delta=args.delta, importance_sampling_level=trainer.importance_sampling_level,
                use_bias_correction_kl=args.use_bias_correction_kl,
                max_completion_length=trainer.max_completion_length, temperature=trainer.temperature,
                chunk_size=chunk_size, **extra,
            )
        return out, hidden.device

    with forward_as(unwrap_model(trainer, model), fused_step):
        return model(**kwargs)


def _log_grpo_metrics(trainer, out, mask: torch.Tensor, advantages: torch.Tensor, old) -> None:
    """TRL's training metrics kl and clip_ratio/* from the fused loss's output; `mask`: the completion tokens."""
    from trl.trainer.utils import nanmax, nanmin

    accelerator = trainer.accelerator
    metrics = trainer._metrics["train"]
    m = mask.to(torch.float32)

    def global_mean(local):  # TRL's global_masked_mean of a per-batch mean over `mask`
        totals = accelerator.reduce(torch.stack([local * m.sum(), m.sum()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if out.kl is not None:
        metrics["kl"].append(global_mean(out.kl))
    # Per-sequence clip fractions (TRL's clip_ratio/low_min and high_max) from the detached log-probs.
    logps = out.per_token_logps
    old_lp = logps if old is None else old.to(logps)
    log_ratio = logps - old_lp
    if trainer.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    low = ((ratio < 1 - trainer.epsilon_low) & (adv < 0)).float()
    high = ((ratio > 1 + trainer.epsilon_high) & (adv > 0)).float()

    def seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * m).sum(-1) / m.sum(-1)

    if trainer.importance_sampling_level == "sequence":
        for key, value in (("low_mean", out.clip_ratio_low), ("high_mean", out.clip_ratio_high),
                           ("region_mean", out.clip_ratio_region)):
            totals = accelerator.reduce(torch.stack([value * low.shape[0], torch.tensor(float(low.shape[0]),
                                                     device=value.device)]), reduction="sum")
            metrics[f"clip_ratio/{key}"].append((totals[0] / totals[1].clamp(min=1.0)).item())
    else:
        metrics["clip_ratio/low_mean"].append(global_mean(out.clip_ratio_low))
        metrics["clip_ratio/high_mean"].append(global_mean(out.clip_ratio_high))
        metrics["clip_ratio/region_mean"].append(global_mean(out.clip_ratio_region))
    metrics["clip_ratio/low_min"].append(nanmin(accelerator.gather(seq_mean(low))).item())
    metrics["clip_ratio/high_max"].append(nanmax(accelerator.gather(seq_mean(high))).item())
