"""TRL's DPOTrainer: training steps run fuseforge's fused_linear_dpo_loss.

The loss runs on the policy's (and the reference model's) last hidden states and LM head weight, chunked over the
tokens (`loss_chunk_size` sizes the chunks), never building [tokens, vocab] logits; the reference log-probs come
from TRL's precomputed `ref_chosen_logps` / `ref_rejected_logps` or from the reference model. The loss, its
gradients and the metrics rewards/*, logps/*, logits/chosen, logits/rejected (the mean logit over the vocabulary is
`hidden @ weight.mean(0)`, cheap) and num_tokens are TRL's; DPO_LOGITS_METRICS need every logit and are not logged
in training (one warning; evaluation keeps TRL's path). What falls back to TRL's loss (one warning naming the
reason): dpo_unsupported.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from fuseforge.loss_args import IGNORE_INDEX
from fuseforge.ops.preference import fused_linear_dpo_loss
from fuseforge.transformers.trainers.fused_loss import (
    common_unsupported,
    forward_as,
    last_hidden,
    reference_args,
    reference_unsupported,
    vocab_mean_logits,
)
from fuseforge.transformers.trainers.policy import FUSED_LOSS_FLAG, unwrap_model

# Training metrics TRL's DPOTrainer computes from full-vocabulary statistics the fused DPO loss never builds.
DPO_LOGITS_METRICS = ("entropy", "mean_token_accuracy")
# Batch keys DPOTrainer keeps out of the model's forward.
_DPO_NON_MODEL_KEYS = frozenset({"completion_mask", "ref_chosen_logps", "ref_rejected_logps"})


def dpo_unsupported(trainer, model: nn.Module) -> str | None:
    """Why this DPOTrainer's configuration is not the fused DPO loss (None: it is)."""
    from fuseforge.ops.preference import DPO_LOSS_TYPES

    args = trainer.args
    loss_types = list(getattr(trainer, "loss_types", None) or [])
    if len(loss_types) != 1 or loss_types[0] not in DPO_LOSS_TYPES:
        return f"DPOConfig(loss_type={loss_types!r}): the fused DPO loss covers one loss type among {DPO_LOSS_TYPES}"
    if getattr(trainer, "f_divergence_type", "reverse_kl") != "reverse_kl":
        return f"DPOConfig(f_divergence_type={trainer.f_divergence_type!r}): the fused DPO loss is reverse-KL DPO"
    if getattr(trainer, "ld_alpha", None) is not None:
        return "DPOConfig(ld_alpha=...) weights the log-probs of the tokens past the shared length"
    if getattr(trainer, "use_weighting", False):
        return "DPOConfig(use_weighting=True): WPO weights need sum_v p_v^2 of every token"
    ls = float(getattr(trainer, "label_smoothing", 0.0) or 0.0)
    if loss_types[0] == "robust" and not 0.0 <= ls < 0.5:
        return f"label_smoothing={ls} outside [0, 0.5) for the robust loss"
    if getattr(args, "padding_free", False):
        return "padding-free batches (DPOConfig(padding_free=True))"
    if getattr(trainer, "_is_vision_dataset", False):
        return "vision-language inputs"
    return common_unsupported(trainer, model, "DPOTrainer") or reference_unsupported(trainer)


def adapt_dpo(trainer, model: nn.Module, options: dict) -> str | None:
    """Training steps compute TRL's DPO loss with fused_linear_dpo_loss."""
    name = type(trainer).__name__
    if not options.get(FUSED_LOSS_FLAG, True):
        return None  # fused losses turned off: TRL's loss, no warning
    reason = dpo_unsupported(trainer, model)
    if reason is not None:
        warnings.warn(
            f"fuseforge: {name} keeps TRL's own DPO loss (no fused DPO loss): {reason}",
            UserWarning,
            stacklevel=4,
        )
        return f"fused_linear_dpo_loss: off for {name}: {reason}"
    original = trainer.compute_loss
    chunk_size = options.get("loss_chunk_size")
    loss_type = trainer.loss_types[0]
    loss_weight = float(trainer.loss_weights[0])
    # TRL applies label_smoothing to the robust loss only.
    label_smoothing = float(trainer.label_smoothing or 0.0) if loss_type == "robust" else 0.0

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        """DPOTrainer._compute_loss's training step with fused_linear_dpo_loss in place of TRL's fused LM head."""
        if return_outputs or not trainer.model.training:
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        mode = "train"
        accelerator = trainer.accelerator
        model_kwargs = {k: v for k, v in inputs.items() if k not in _DPO_NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, IGNORE_INDEX)
        def fused_step(**kwargs):
            hidden, head = last_hidden(unwrap_model(trainer, model), kwargs)
            target = labels[:, 1:].to(hidden.device)
            precomputed = None
            if trainer.precompute_ref_logps:
                precomputed = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
            ref = reference_args(trainer, kwargs, precomputed, hidden.device)
            out = fused_linear_dpo_loss(
                hidden, head.weight, target, head.bias, **ref, beta=trainer.beta, loss_type=loss_type,
                label_smoothing=label_smoothing, chunk_size=chunk_size,
            )
            return out, vocab_mean_logits(hidden, head)

        with forward_as(unwrap_model(trainer, model), fused_step):
            out, mean_logits = model(**model_kwargs)
        loss = out.loss * loss_weight

        metrics = trainer._metrics[mode]
        num_tokens = accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        trainer._total_train_tokens += num_tokens // getattr(trainer, "_tp_size", 1)
        metrics["num_tokens"] = [trainer._total_train_tokens]
        mask = completion_mask[..., 1:].to(mean_logits.device).bool()
        n_pairs = mask.shape[0] // 2
        for key, rows in (("logits/chosen", slice(0, n_pairs)), ("logits/rejected", slice(n_pairs, None))):
            total = accelerator.gather_for_metrics(mean_logits[rows][mask[rows]].sum()).sum().item()
            count = accelerator.gather_for_metrics(mask[rows].sum()).sum().item()
            metrics[key].append(total / count if count > 0 else 0.0)
        metrics["rewards/chosen"].append(accelerator.gather(out.chosen_rewards).mean().item())
        metrics["rewards/rejected"].append(accelerator.gather(out.rejected_rewards).mean().item())
        metrics["rewards/accuracies"].append(accelerator.gather(out.accuracies).mean().item())
        metrics["rewards/margins"].append(accelerator.gather(out.margins).mean().item())
        metrics["logps/chosen"].append(accelerator.gather(out.chosen_logps).mean().item())
        metrics["logps/rejected"].append(accelerator.gather(out.rejected_logps).mean().item())
        return loss

    compute_loss._fuseforge_wrapped = original
    trainer.compute_loss = compute_loss
    warnings.warn(
        f"fuseforge: {name}'s training loss runs through fuseforge's fused DPO loss; its training metrics "
        f"{' and '.join(DPO_LOGITS_METRICS)} are not logged: they need every logit, which the fused loss never "
        "builds (evaluation still logs them). apply_kernels(trainer, fused_linear_cross_entropy=False) keeps them, "
        "with TRL's own loss.",
        UserWarning,
        stacklevel=4,
    )
    return f"trainer: {name}'s training loss is fused_linear_dpo_loss (loss_type={loss_type!r})"
