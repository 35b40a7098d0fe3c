"""TRL's KTOTrainer: training steps run fuseforge's fused_linear_kto_loss, and its KL estimate fused_linear_kto_kl
on the mismatched completions TRL's collator builds, averaged over ranks as TRL does; the reference log-probs are
precomputed or come from the reference model. Metrics as TRL's but KTO_LOGITS_METRICS (one warning). What falls
back to TRL's loss (one warning naming the reason): kto_unsupported.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from fuseforge.loss_args import IGNORE_INDEX
from fuseforge.ops.preference import fused_linear_kto_kl, fused_linear_kto_loss
from fuseforge.transformers.trainers.fused_loss import (
    common_unsupported,
    forward_as,
    last_hidden,
    reference_args,
    reference_unsupported,
    vocab_mean_logits,
)
from fuseforge.transformers.trainers.policy import FUSED_LOSS_FLAG, unwrap_model

# Training metric TRL's KTOTrainer computes from full-vocabulary statistics the fused KTO loss never builds.
KTO_LOGITS_METRICS = ("entropy",)
_KL_REFERENCE_NAMES = {"ref_logps": "ref_kl_logps", "ref_hidden": "ref_kl_hidden"}  # fused_linear_kto_kl's
_KTO_NON_MODEL_KEYS = frozenset({"completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask",
                                 "KL_token_type_ids", "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps"})


def kto_unsupported(trainer, model: nn.Module) -> str | None:
    """Why this KTOTrainer's configuration is not the fused KTO loss (None: it is)."""
    from fuseforge.ops.preference import KTO_LOSS_TYPES

    if trainer.loss_type not in KTO_LOSS_TYPES:
        return f"KTOConfig(loss_type={trainer.loss_type!r}): the fused KTO loss covers {KTO_LOSS_TYPES}"
    if getattr(trainer.args, "padding_free", False):
        return "padding-free batches"
    if getattr(trainer, "_is_vision_dataset", False):
        return "vision-language inputs"
    return common_unsupported(trainer, model, "KTOTrainer") or reference_unsupported(trainer)


def _completion_target(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Next-token targets of the completion tokens (IGNORE_INDEX elsewhere), aligned with hidden[:, :-1]."""
    return input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)[:, 1:]


def adapt_kto(trainer, model: nn.Module, options: dict) -> str | None:
    """Training steps compute TRL's KTO loss with fused_linear_kto_loss (and the KL estimate with
    fused_linear_kto_kl), never building [tokens, vocab] logits."""
    name = type(trainer).__name__
    if not options.get(FUSED_LOSS_FLAG, True):
        return None
    reason = kto_unsupported(trainer, model)
    if reason is not None:
        warnings.warn(f"fuseforge: {name} keeps TRL's own KTO loss (no fused KTO loss): {reason}", UserWarning,
                      stacklevel=4)
        return f"fused_linear_kto_loss: off for {name}: {reason}"
    original = trainer.compute_loss
    chunk_size = options.get("loss_chunk_size")

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        """KTOTrainer._compute_loss's training step with fused_linear_kto_loss in place of TRL's fused LM head."""
        if return_outputs or not trainer.model.training:
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        mode = "train"
        accelerator = trainer.accelerator
        batch = {k: (v.to(accelerator.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        model_kwargs = {k: v for k, v in batch.items() if k not in _KTO_NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        target = _completion_target(batch["input_ids"], batch["completion_mask"])
        desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=target.device)
        kl = 0.0
        if trainer.calculate_KL:
            kl_kwargs = {"input_ids": batch["KL_input_ids"], "attention_mask": batch["KL_attention_mask"],
                         "use_cache": False}
            kl_target = _completion_target(batch["KL_input_ids"], batch["KL_completion_mask"])
            with torch.no_grad():
                kl_hidden, head = last_hidden(unwrap_model(trainer, model), kl_kwargs)
                ref = reference_args(trainer, kl_kwargs, batch.get("ref_KL_logps"), kl_hidden.device)
                kl = fused_linear_kto_kl(
                    kl_hidden, head.weight, kl_target.to(kl_hidden.device), head.bias, ignore_index=IGNORE_INDEX,
                    chunk_size=chunk_size, **{_KL_REFERENCE_NAMES.get(k, k): v for k, v in ref.items()},
                )
            kl = accelerator.gather_for_metrics(kl.reshape(1)).mean()

        def fused_step(**kwargs):
            hidden, head = last_hidden(unwrap_model(trainer, model), kwargs)
            out = fused_linear_kto_loss(
                hidden, head.weight, target.to(hidden.device), desirable.to(hidden.device), head.bias,
                **reference_args(trainer, kwargs, batch.get("ref_logps"), hidden.device), kl=kl, beta=trainer.beta,
                desirable_weight=trainer.desirable_weight, undesirable_weight=trainer.undesirable_weight,
                loss_type=trainer.loss_type, chunk_size=chunk_size,
            )
            return out, vocab_mean_logits(hidden, head)

        with forward_as(unwrap_model(trainer, model), fused_step):
            out, mean_logits = model(**model_kwargs)

        metrics = trainer._metrics[mode]
        metrics["kl"].append(out.kl.item())
        tokens = accelerator.gather_for_metrics(batch["attention_mask"].sum()).sum().item()
        trainer._total_train_tokens += tokens // getattr(trainer, "_tp_size", 1)
        metrics["num_tokens"] = [trainer._total_train_tokens]
        mask = batch["completion_mask"][:, 1:].to(mean_logits.device).bool()
        d = desirable.to(mean_logits.device)
        for key, rows in (("logits/chosen", d), ("logits/rejected", ~d)):
            picked = mask & rows[:, None]
            total = accelerator.gather_for_metrics(mean_logits[picked].sum()).sum().item()
            count = accelerator.gather_for_metrics(picked.sum()).sum().item()
            if count > 0:
                metrics[key].append(total / count)
        n_chosen = accelerator.gather_for_metrics(d.sum()).sum().item()
        n_rejected = accelerator.gather_for_metrics((~d).sum()).sum().item()
        for side, rows, n in (("chosen", d, n_chosen), ("rejected", ~d, n_rejected)):
            if n > 0:
                for key, values in (("rewards", out.rewards), ("logps", out.logps)):
                    total = accelerator.gather_for_metrics(values[rows].nansum()).nansum().item()
                    metrics[f"{key}/{side}"].append(total / n)
        if n_chosen > 0 and n_rejected > 0:
            metrics["rewards/margins"].append(metrics["rewards/chosen"][-1] - metrics["rewards/rejected"][-1])
        return out.loss

    compute_loss._fuseforge_wrapped = original
    trainer.compute_loss = compute_loss
    warnings.warn(
        f"fuseforge: {name}'s training loss runs through fuseforge's fused KTO loss; its training metric "
        f"{' and '.join(KTO_LOGITS_METRICS)} is not logged: it needs every logit, which the fused loss never "
        "builds (evaluation still logs it). apply_kernels(trainer, fused_linear_cross_entropy=False) keeps it, "
        "with TRL's own loss.",
        UserWarning,
        stacklevel=4,
    )
    return f"trainer: {name}'s training loss is fused_linear_kto_loss (loss_type={trainer.loss_type!r})"
