"""TRL's SFTTrainer: training steps take the model's fused loss, evaluation keeps TRL's path.

TRL (1.16) computes the loss, `entropy` and `mean_token_accuracy` from per-token log-probabilities of its own fused
LM head. The fused loss stays: the bound `compute_loss` is wrapped so that the training step takes the model's fused
loss. The two metrics need per-token logits statistics the fused loss never computes; they are not logged in
training (one warning). Settings whose loss is not the model's plain next-token loss: sft_unsupported.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from fuseforge.transformers.loss import LOSS_SPEC_ATTR

# Training metrics TRL's SFTTrainer computes from its fused LM head's per-token statistics.
SFT_LOGITS_METRICS = ("entropy", "mean_token_accuracy")


def sft_unsupported(trainer) -> str | None:
    """SFTTrainer options whose loss is not the model's plain next-token loss."""
    args = trainer.args
    if getattr(args, "loss_type", "nll") != "nll":
        return f"SFTConfig(loss_type={args.loss_type!r}) weights the per-token loss"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func needs the logits"
    if getattr(trainer, "label_smoother", None) is not None:
        return "label smoothing needs the logits"
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if config is not None and getattr(config, "sp_enabled", False):
        return "sequence parallelism is handled by TRL's fused LM head"
    return None


def _count_sft_tokens(trainer, inputs: dict) -> None:
    """SFTTrainer's `num_tokens` training metric, as its compute_loss keeps it."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None or not hasattr(trainer, "_total_train_tokens"):
        return
    if "attention_mask" in inputs:
        count = inputs["attention_mask"].sum()
    elif "position_ids" in inputs:
        count = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
    else:
        return
    count = trainer.accelerator.gather_for_metrics(count).sum().item()
    trainer._total_train_tokens += count // getattr(trainer, "_tp_size", 1)
    metrics["train"]["num_tokens"] = [trainer._total_train_tokens]


def adapt_sft(trainer, model: nn.Module, options: dict | None = None) -> None:
    """Training steps take the model's fused loss (when it has one); evaluation keeps TRL's path."""
    heads = [m for m in model.modules() if hasattr(m, LOSS_SPEC_ATTR)]
    if not heads:
        return  # no fused loss (turned off, or apply_kernels warned why not): TRL's path stays
    head = heads[0]
    original = trainer.compute_loss

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        """SFTTrainer.compute_loss's training step with the model's fused loss in place of TRL's head."""
        if return_outputs or not trainer.model.training:
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        inputs["use_cache"] = False
        moe = getattr(trainer, "aux_loss_enabled", False)
        if moe:
            inputs["output_router_logits"] = True
        if trainer.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model(**inputs)
        loss = outputs["loss"]
        aux_loss = outputs.get("aux_loss") if moe else None
        if aux_loss is not None and getattr(head, LOSS_SPEC_ATTR).router_aux_loss:
            # The fused forward adds the router loss as transformers' MoE forward does; SFTTrainer adds
            # its own coefficient, averaged over the accumulation steps, after the token-count scaling.
            loss = loss - head.router_aux_loss_coef * aux_loss.to(loss.device)
        if trainer.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())
        if aux_loss is not None:
            steps = trainer.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + trainer.router_aux_loss_coef * aux_loss.to(loss.device) / steps
            aux_metric = trainer.accelerator.gather_for_metrics(aux_loss.detach()).mean().item()
            trainer._metrics["train"]["aux_loss"].append(aux_metric)
        _count_sft_tokens(trainer, inputs)
        return loss

    compute_loss._fuseforge_wrapped = original
    trainer.compute_loss = compute_loss
    warnings.warn(
        f"fuseforge: {type(trainer).__name__}'s training metrics {' and '.join(SFT_LOGITS_METRICS)} are not "
        "logged: they need per-token logits statistics, which fused linear cross-entropy never builds "
        "(evaluation still logs them). apply_kernels(trainer, fused_linear_cross_entropy=False) keeps them, "
        "with TRL's own fused LM head for the loss.",
        UserWarning,
        stacklevel=4,
    )
