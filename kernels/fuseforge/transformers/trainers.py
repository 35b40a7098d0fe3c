"""apply_kernels(trainer): fuseforge's kernels in an already-built transformers / TRL trainer.

Patching the model alone is not enough for every trainer: the fused linear cross-entropy
returns `logits=None` from a training forward with labels, and what a trainer does with
the model's outputs decides whether that is a saving or a crash. `apply_kernels(trainer)`
patches `trainer.model` (and a reference / teacher model, without the fused loss) and then
adapts the trainer instance according to TRAINER_POLICIES, looked up along the trainer's
class hierarchy (so subclasses inherit their parent's entry):

- `transformers.Trainer` trains on the model's own `loss`: the fused loss stays, nothing
  else changes.
- TRL's `SFTTrainer` (TRL 1.16) computes its loss, `entropy` and `mean_token_accuracy`
  from per-token log-probabilities of its own fused LM head. The fused loss stays: its
  bound `compute_loss` is wrapped so that the training step takes the model's fused loss,
  while evaluation keeps TRL's path. The two training metrics need per-token logits
  statistics the fused loss never computes; they are not logged (one warning says so).
  `fused_linear_cross_entropy=False` keeps TRL's own head and both metrics.
- TRL's `DPOTrainer` computes its loss itself from per-token log-probabilities: its models
  keep the norm / RoPE / MLP kernels without fused linear cross-entropy, and its bound
  `compute_loss` is wrapped so that each training step runs fuseforge's
  `fused_linear_dpo_loss` on the policy's (and the reference model's) last hidden states and
  LM head weight, chunked over the tokens (`loss_chunk_size` sizes the chunks), never building
  [tokens, vocab] logits. Loss types sigmoid, hinge, ipo and robust (one loss type, any
  `loss_weights` entry); the reference log-probs come from TRL's precomputed
  `ref_chosen_logps` / `ref_rejected_logps` or from the reference model. The loss, its
  gradients and the metrics rewards/*, logps/*, logits/chosen, logits/rejected (the mean logit
  over the vocabulary is `hidden @ weight.mean(0)`, cheap) and num_tokens are TRL's; `entropy`
  and `mean_token_accuracy` need every logit and are not logged in training (one warning;
  evaluation keeps TRL's path and logs them). Anything else falls back to TRL's own loss with
  one warning naming the reason (`_dpo_unsupported` holds the checks): another or several loss
  types, f-divergences, `ld_alpha`, WPO weighting, a MoE router loss, padding-free batches,
  vision inputs, Liger, context / sequence parallelism, FSDP or DeepSpeed (DDP runs
  fused: the loss is computed inside the DDP wrapper's forward, see `_forward_as`), a model
  that scales or caps its logits, a subclass overriding `compute_loss` / `_compute_loss`.
  `fused_linear_cross_entropy=False` keeps TRL's loss without a warning.
- TRL's `GRPOTrainer` likewise trains on fuseforge's `fused_linear_grpo_loss` (loss types grpo,
  dr_grpo, dapo, bnpo; token- or sequence-level importance sampling, `delta`, `beta` with the
  reference log-probs TRL stores in the batch, TRL's gradient-accumulation normalisation). The
  loss, gradients and metrics (kl, clip_ratio/*) are TRL's; `entropy` needs every logit and is
  not logged in training (one warning). Generation and TRL's scoring of old / reference
  log-probs between updates stay TRL's. Falls back with one warning for other loss types,
  `off_policy_mask_threshold`, `top_entropy_quantile < 1`, an entropy bonus, vLLM, vision
  inputs, `cast_lm_head_to_fp32` and the settings listed for DPO (MoE,
  Liger, parallelism, FSDP / DeepSpeed, logit scaling, overrides); batches with a `tool_mask`
  take TRL's loss (one warning).
- TRL's `KTOTrainer` likewise trains on fuseforge's `fused_linear_kto_loss` (loss types kto and
  apo_zero_unpaired, desirable / undesirable weights), its KL estimate from `fused_linear_kto_kl`
  on the mismatched completions TRL's collator builds, averaged over ranks as TRL does; reference
  log-probs precomputed or from the reference model. Metrics as TRL's, but `entropy` (one
  warning). Falls back with one warning as listed for DPO (MoE, vision, padding-free,
  FSDP / DeepSpeed, logit scaling, overrides).
- TRL's `RLOOTrainer`, `GKDTrainer`, `DistillationTrainer` and
  `RewardTrainer` compute their loss themselves (from per-token log-probabilities or
  logits), never from the model's `loss`: their models keep the norm / RoPE / MLP kernels
  and get no fused loss, so their numbers are unchanged.
- A trainer that overrides `compute_loss` below its known ancestor might read
  `outputs.logits`: its model gets no fused loss either, with a warning.

PEFT policies (a `peft.PeftModel`, e.g. from the trainer's `peft_config`) run these fused losses too: without a
reference model, the reference is the policy with its adapter disabled (TRL's "ref" adapter when TRL made one),
its last hidden states computed under `no_grad` and fed to the same fused loss with the frozen LM head, so no
[tokens, vocab] logits are built for it either (GRPO's reference log-probs stay TRL's, scored between updates).

A trainer-specific fused loss (preference, RL) plugs in as the `adapt` of its TRAINER_POLICIES
entry, which runs on the patched model and may replace the trainer's loss computation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fuseforge.ops._shared.loss_args import IGNORE_INDEX
from fuseforge.transformers.lora import inner_model, is_peft_model
from fuseforge.transformers.loss import active_head
from fuseforge.ops.grpo import fused_linear_grpo_loss
from fuseforge.ops.preference import fused_linear_dpo_loss, fused_linear_kto_kl, fused_linear_kto_loss
from fuseforge.transformers.loss import LOGIT_TRANSFORMS, LOSS_SPEC_ATTR
from fuseforge.transformers.patching import _STATE_ATTR, apply_kernels, unpatch
from fuseforge.transformers.report import PatchReport

logger = logging.getLogger(__name__)

# Training metrics TRL's SFTTrainer computes from its fused LM head's per-token statistics.
SFT_LOGITS_METRICS = ("entropy", "mean_token_accuracy")
# Attributes of TRL trainers holding models that run forwards but are not trained.
_FROZEN_MODEL_ATTRS = ("ref_model", "teacher_model")
_FLCE = "fused_linear_cross_entropy"


@dataclass(frozen=True)
class TrainerPolicy:
    """What one trainer class needs from a patched model.

    uses_model_loss: the trainer trains on the model's own `loss`, so fused linear
    cross-entropy can compute it; otherwise the model gets no fused loss and `reason`
    says why. check(trainer) -> str | None, before patching: why this trainer's settings
    rule the fused loss out after all (None: they do not). adapt(trainer, model, options),
    after the model is patched (with or without the fused loss): adapts the trainer instance
    to the patched model and may return a note for the report. A trainer-specific fused loss
    (preference, RL) is installed here.
    """

    uses_model_loss: bool
    reason: str = ""
    check: Callable | None = None
    adapt: Callable | None = None


def _is_trainer(obj) -> bool:
    """True for a transformers.Trainer instance (without importing transformers.trainer)."""
    module = sys.modules.get("transformers.trainer")
    return module is not None and isinstance(obj, module.Trainer)


def _own_loss(name: str, how: str) -> TrainerPolicy:
    return TrainerPolicy(
        uses_model_loss=False,
        reason=f"{name} computes its loss itself ({how}), not from the model's loss",
    )


# --- TRL's SFTTrainer ---------------------------------------------------------------------------


def _fused_head_forwards(model: nn.Module) -> dict:
    """Instance forwards installed by TRL's `add_fused_lm_head` (they take `fused_lm_head`)."""
    found = {}
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if forward is None or getattr(forward, "_fuseforge_fused_forward", False):
            continue
        try:
            params = inspect.signature(forward, follow_wrapped=False).parameters
        except (TypeError, ValueError):
            continue
        if "fused_lm_head" in params:
            found[module] = forward
    return found


def _route(module: nn.Module, ours, theirs) -> None:
    """One instance forward: TRL's fused head for `fused_lm_head=True` calls, ours for the rest.

    `unpatch` puts TRL's forward back (see patching._undo).
    """

    @functools.wraps(type(module).forward)
    def forward(self, *args, fused_lm_head=False, **kwargs):
        if fused_lm_head:
            return theirs(*args, fused_lm_head=True, **kwargs)
        return ours(*args, **kwargs)

    forward._fuseforge_fused_forward = True
    forward._fuseforge_previous_forward = theirs
    module.forward = types.MethodType(forward, module)


def _sft_unsupported(trainer) -> str | None:
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


def _adapt_sft(trainer, model: nn.Module, options: dict | None = None) -> None:
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


# --- TRL's DPOTrainer ---------------------------------------------------------------------------

# Training metrics TRL's DPOTrainer computes from full-vocabulary statistics the fused DPO loss never builds.
DPO_LOGITS_METRICS = ("entropy", "mean_token_accuracy")
# Batch keys DPOTrainer keeps out of the model's forward.
_DPO_NON_MODEL_KEYS = frozenset({"completion_mask", "ref_chosen_logps", "ref_rejected_logps"})


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


def _dpo_unsupported(trainer, model: nn.Module) -> str | None:
    """Why this DPOTrainer's configuration is not the fused DPO loss (None: it is). The module docstring lists them."""
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
    return _common_unsupported(trainer, model, "DPOTrainer") or _reference_unsupported(trainer)


def _reference_unsupported(trainer) -> str | None:
    """Why the fused preference losses cannot take this trainer's reference (None: they can): they need
    precomputed log-probs or a reference causal LM whose head gives plain logits."""
    if getattr(trainer, "precompute_ref_logps", False) or _adapter_reference(trainer):
        return None
    ref = _unwrap(trainer, getattr(trainer, "ref_model", None))
    if not isinstance(ref, nn.Module) or _backbone(ref) is None:
        return "the reference log-probs come neither from precomputed log-probs nor a reference causal LM"
    ref_config = ref.config.get_text_config() if hasattr(ref.config, "get_text_config") else ref.config
    if any(getattr(ref_config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return "the reference model scales or caps its logits"
    return None


def _common_unsupported(trainer, model: nn.Module, known: str) -> str | None:
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


def _last_hidden(model: nn.Module, kwargs: dict) -> tuple[torch.Tensor, nn.Module]:
    """(the backbone's last hidden states predicting tokens 1.. (shifted), on the head's device; the LM head)."""
    base, head = _backbone(model)
    hidden = base(**kwargs).last_hidden_state[:, :-1]
    return hidden.to(head.weight.device), head


@contextlib.contextmanager
def _forward_as(module: nn.Module, fn):
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
    return getattr(trainer, "ref_model", None) is None and is_peft_model(_unwrap(trainer, trainer.model))


def _reference(trainer, kwargs: dict, precomputed: torch.Tensor | None, device) -> dict:
    """The reference arguments of a fused preference loss: TRL's precomputed per-sequence log-prob sums, or the
    frozen reference model's last hidden states and head (computed here without gradient); for a PEFT policy
    without a reference model, the policy's with its adapter disabled (TRL's "ref" adapter where it made one)."""
    if trainer.precompute_ref_logps:
        return {"ref_logps": precomputed.to(device)}
    adapter = contextlib.nullcontext()
    ref_model = _unwrap(trainer, trainer.ref_model)
    if _adapter_reference(trainer):
        from trl.trainer.utils import use_adapter

        ref_model = _unwrap(trainer, trainer.model)
        adapter = use_adapter(ref_model, adapter_name="ref" if "ref" in ref_model.peft_config else None)
    with torch.no_grad(), _no_checkpointing(trainer), adapter:
        ref_hidden, ref_head = _last_hidden(ref_model, kwargs)
    return {"ref_hidden": ref_hidden.to(device), "ref_weight": ref_head.weight, "ref_bias": ref_head.bias}


def _no_checkpointing(trainer):
    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:  # pragma: no cover - TRL moved it
        return contextlib.nullcontext()
    return disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)


def _mean_logits(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """Mean over the vocabulary of each token's logits, hidden @ weight.mean(0) (+ bias.mean()), in float64."""
    weight = head.weight.detach().double()
    mean = hidden.detach().double() @ weight.mean(0)
    if getattr(head, "bias", None) is not None:
        mean = mean + head.bias.detach().double().mean()
    return mean


def _adapt_dpo(trainer, model: nn.Module, options: dict) -> str | None:
    """Training steps compute TRL's DPO loss with fused_linear_dpo_loss (see the module docstring)."""
    name = type(trainer).__name__
    if not options.get(_FLCE, True):
        return None  # fused losses turned off: TRL's loss, no warning
    reason = _dpo_unsupported(trainer, model)
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
            hidden, head = _last_hidden(_unwrap(trainer, model), kwargs)
            target = labels[:, 1:].to(hidden.device)
            precomputed = None
            if trainer.precompute_ref_logps:
                precomputed = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
            ref = _reference(trainer, kwargs, precomputed, hidden.device)
            out = fused_linear_dpo_loss(
                hidden, head.weight, target, head.bias, **ref, beta=trainer.beta, loss_type=loss_type,
                label_smoothing=label_smoothing, chunk_size=chunk_size,
            )
            return out, _mean_logits(hidden, head)

        with _forward_as(_unwrap(trainer, model), fused_step):
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


# --- TRL's KTOTrainer ---------------------------------------------------------------------------

# Training metric TRL's KTOTrainer computes from full-vocabulary statistics the fused KTO loss never builds.
KTO_LOGITS_METRICS = ("entropy",)
_KL_REFERENCE_NAMES = {"ref_logps": "ref_kl_logps", "ref_hidden": "ref_kl_hidden"}  # fused_linear_kto_kl's
_KTO_NON_MODEL_KEYS = frozenset({"completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask",
                                 "KL_token_type_ids", "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps"})


def _kto_unsupported(trainer, model: nn.Module) -> str | None:
    """Why this KTOTrainer's configuration is not the fused KTO loss (None: it is)."""
    from fuseforge.ops.preference import KTO_LOSS_TYPES

    if trainer.loss_type not in KTO_LOSS_TYPES:
        return f"KTOConfig(loss_type={trainer.loss_type!r}): the fused KTO loss covers {KTO_LOSS_TYPES}"
    if getattr(trainer.args, "padding_free", False):
        return "padding-free batches"
    if getattr(trainer, "_is_vision_dataset", False):
        return "vision-language inputs"
    return _common_unsupported(trainer, model, "KTOTrainer") or _reference_unsupported(trainer)


def _completion_target(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Next-token targets of the completion tokens (IGNORE_INDEX elsewhere), aligned with hidden[:, :-1]."""
    return input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)[:, 1:]


def _adapt_kto(trainer, model: nn.Module, options: dict) -> str | None:
    """Training steps compute TRL's KTO loss with fused_linear_kto_loss (and the KL estimate with
    fused_linear_kto_kl), never building [tokens, vocab] logits."""
    name = type(trainer).__name__
    if not options.get(_FLCE, True):
        return None
    reason = _kto_unsupported(trainer, model)
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
                kl_hidden, head = _last_hidden(_unwrap(trainer, model), kl_kwargs)
                ref = _reference(trainer, kl_kwargs, batch.get("ref_KL_logps"), kl_hidden.device)
                kl = fused_linear_kto_kl(
                    kl_hidden, head.weight, kl_target.to(kl_hidden.device), head.bias, ignore_index=IGNORE_INDEX,
                    chunk_size=chunk_size, **{_KL_REFERENCE_NAMES.get(k, k): v for k, v in ref.items()},
                )
            kl = accelerator.gather_for_metrics(kl.reshape(1)).mean()

        def fused_step(**kwargs):
            hidden, head = _last_hidden(_unwrap(trainer, model), kwargs)
            out = fused_linear_kto_loss(
                hidden, head.weight, target.to(hidden.device), desirable.to(hidden.device), head.bias,
                **_reference(trainer, kwargs, batch.get("ref_logps"), hidden.device), kl=kl, beta=trainer.beta,
                desirable_weight=trainer.desirable_weight, undesirable_weight=trainer.undesirable_weight,
                loss_type=trainer.loss_type, chunk_size=chunk_size,
            )
            return out, _mean_logits(hidden, head)

        with _forward_as(_unwrap(trainer, model), fused_step):
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


# --- TRL's GRPOTrainer --------------------------------------------------------------------------

# Training metric TRL's GRPOTrainer computes from full-vocabulary statistics the fused GRPO loss never builds.
GRPO_LOGITS_METRICS = ("entropy",)


def _grpo_unsupported(trainer, model: nn.Module) -> str | None:
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
    return _common_unsupported(trainer, model, "GRPOTrainer")


def _adapt_grpo(trainer, model: nn.Module, options: dict) -> str | None:
    """Training steps compute TRL's GRPO loss with fused_linear_grpo_loss (see the module docstring)."""
    name = type(trainer).__name__
    if not options.get(_FLCE, True):
        return None
    reason = _grpo_unsupported(trainer, model)
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
        from trl.trainer.utils import nanmax, nanmin

        mode = "train"
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
        extra = {}
        if trainer.beta != 0.0:
            extra["ref_logps"] = inputs["ref_per_token_logps"]
        if loss_type == "dapo":
            items = inputs["num_items_in_batch"].clamp(min=1.0) / accelerator.num_processes
            steps = trainer.current_gradient_accumulation_steps
            extra["num_items_in_batch"] = items * steps / args.steps_per_generation

        def fused_step(**kwargs):
            with accelerator.autocast():
                hidden, head = _last_hidden(_unwrap(trainer, model), kwargs)
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

        with _forward_as(_unwrap(trainer, model), fused_step):
            out, device = model(**kwargs)
        mask = completion_mask.to(device)
        loss = out.loss
        if loss_type != "dapo":
            loss = loss / trainer.current_gradient_accumulation_steps

        metrics = trainer._metrics[mode]
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


# --- the table ----------------------------------------------------------------------------------

# Trainer class name -> policy, matched along the trainer's MRO among classes of transformers and trl.
# The first entries a subclass meets win (GKDTrainer is an SFTTrainer subclass, for instance).
TRAINER_POLICIES: dict[str, TrainerPolicy] = {
    "Trainer": TrainerPolicy(uses_model_loss=True),
    "SFTTrainer": TrainerPolicy(uses_model_loss=True, check=_sft_unsupported, adapt=_adapt_sft),
    "DPOTrainer": dataclasses.replace(
        _own_loss("DPOTrainer", "preference loss from per-token log-probabilities"), adapt=_adapt_dpo
    ),
    "KTOTrainer": dataclasses.replace(
        _own_loss("KTOTrainer", "preference loss from per-token log-probabilities"), adapt=_adapt_kto
    ),
    "GRPOTrainer": dataclasses.replace(
        _own_loss("GRPOTrainer", "policy loss from per-token log-probabilities"), adapt=_adapt_grpo
    ),
    "RLOOTrainer": _own_loss("RLOOTrainer", "policy loss from per-token log-probabilities"),
    "GKDTrainer": _own_loss("GKDTrainer", "divergence between student and teacher logits"),
    "DistillationTrainer": _own_loss("DistillationTrainer", "divergence between student and teacher"),
    "RewardTrainer": _own_loss("RewardTrainer", "pairwise loss on sequence scores"),
}


def _policy_for(trainer) -> tuple[type, TrainerPolicy, bool]:
    """(the known class, its policy, whether compute_loss is overridden below it)."""
    mro = type(trainer).__mro__
    loss_owner = next((c for c in mro if "compute_loss" in c.__dict__), None)
    for cls in mro:
        policy = TRAINER_POLICIES.get(cls.__name__)
        if policy is not None and cls.__module__.split(".")[0] in ("transformers", "trl"):
            return cls, policy, loss_owner is not None and loss_owner is not cls and issubclass(loss_owner, cls)
    raise TypeError(f"{type(trainer).__name__} is not a transformers.Trainer")  # unreachable: checked by the caller


# --- apply / unpatch ----------------------------------------------------------------------------


@dataclass
class _TrainerState:
    """What apply_kernels changed on a trainer; `options` and `report` as patching._State has them."""

    options: dict
    report: PatchReport
    models: list = field(default_factory=list)  # models patched for this trainer
    compute_loss: object = None  # our compute_loss wrapper, when installed


def _unwrap(trainer, model):
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None and isinstance(model, nn.Module):
        model = accelerator.unwrap_model(model)
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper


def _without_fused_loss(options: dict) -> dict:
    return {**options, _FLCE: False, "loss_chunk_size": None}


def _say_why(trainer_name: str, reason: str, report: PatchReport, warn: bool) -> None:
    report.notes.append(f"{_FLCE}: off for {trainer_name}: {reason}")
    message = f"fuseforge: fused linear cross-entropy is off for {trainer_name}'s model: {reason}"
    if warn:
        warnings.warn(message, UserWarning, stacklevel=4)
    else:
        logger.info(message)


def _patch_next_to_trl_head(model: nn.Module, options: dict) -> tuple[PatchReport, dict]:
    """Patch with the fused loss next to any fused LM head TRL installed on the model.

    TRL's head is an instance forward, which apply_kernels leaves alone (and then skips the
    fused loss): it is set aside, the model patched, and the two forwards combined by _route.
    Returns the report and TRL's forwards by module, to put back if a later step fails.
    """
    theirs = _fused_head_forwards(model)
    for module in theirs:
        del module.__dict__["forward"]
    if theirs:
        unpatch(model)  # an earlier patch's forward sits under TRL's: install ours afresh
    try:
        report = apply_kernels(model, **options)
    except BaseException:
        _put_back(model, theirs)
        raise
    for module, forward in theirs.items():
        ours = module.__dict__.get("forward")
        if getattr(ours, "_fuseforge_fused_forward", False):
            _route(module, ours, forward)
        else:  # no fused loss on this module (the report says why): TRL's head stays
            module.forward = forward
    return report, theirs


def _put_back(model: nn.Module, theirs: dict) -> None:
    unpatch(model)
    for module, forward in theirs.items():
        module.forward = forward


def apply_kernels_to_trainer(trainer, options: dict) -> PatchReport:
    """apply_kernels for a built transformers.Trainer (options: apply_kernels' checked keyword arguments)."""
    state = trainer.__dict__.get(_STATE_ATTR)
    if state is not None:
        if state.options == options:
            return state.report
        unpatch_trainer(trainer)
    model = _unwrap(trainer, getattr(trainer, "model", None))
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"{type(trainer).__name__}.model is {type(model).__name__}, not an nn.Module: "
            "apply_kernels(trainer) patches the model the trainer was built with"
        )
    name = type(trainer).__name__
    known, policy, overridden = _policy_for(trainer)
    reason, warn = None, False
    if not policy.uses_model_loss:
        reason = policy.reason
    elif overridden:
        reason = (
            f"{name} overrides compute_loss and may read outputs.logits, which the fused loss leaves None "
            "(if it only reads outputs.loss, apply_kernels(trainer.model) keeps the fused loss)"
        )
        warn = True
    elif options[_FLCE] and policy.check is not None:
        reason = policy.check(trainer)
        warn = reason is not None

    if options[_FLCE] and reason is None:
        report, theirs = _patch_next_to_trl_head(model, options)
    else:
        report, theirs = apply_kernels(model, **_without_fused_loss(options)), {}
    adapt_note = None
    if policy.adapt is not None:
        try:
            adapt_note = policy.adapt(trainer, model, options)
        except BaseException:
            _put_back(model, theirs)
            raise
    # The model's own report stays as apply_kernels left it; the trainer's adds what the trainer changed.
    report = dataclasses.replace(report, target=f"{report.target} in {name}", notes=list(report.notes))
    report.notes.append(f"trainer: the {known.__module__}.{known.__name__} policy (TRAINER_POLICIES)")
    if reason is not None and options[_FLCE]:
        _say_why(name, reason, report, warn)
    if adapt_note:
        report.notes.append(adapt_note)

    trainer_state = _TrainerState(options=dict(options), report=report, models=[model])
    wrapper = trainer.__dict__.get("compute_loss")
    if getattr(wrapper, "_fuseforge_wrapped", None) is not None:
        trainer_state.compute_loss = wrapper
    for attr in _FROZEN_MODEL_ATTRS:
        other = _unwrap(trainer, getattr(trainer, attr, None))
        if isinstance(other, nn.Module) and other is not model:
            with warnings.catch_warnings():  # its report is summarised in ours
                warnings.simplefilter("ignore")
                other_report = apply_kernels(other, **_without_fused_loss(options))
            trainer_state.models.append(other)
            done = ", ".join(other_report.patched_kernels()) or "nothing"
            report.notes.append(f"{attr} ({type(other).__name__}) patched without the fused loss: {done}")
    if getattr(trainer, "model_init", None) is not None:
        report.notes.append(
            "models the trainer re-creates with model_init are not patched: patch the class instead, "
            "apply_kernels(ModelClass)"
        )
    trainer.__dict__[_STATE_ATTR] = trainer_state
    return report


def unpatch_trainer(trainer) -> bool:
    """Undo apply_kernels(trainer): its compute_loss wrapper and the patches of its models."""
    state = trainer.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return False
    if state.compute_loss is not None and trainer.__dict__.get("compute_loss") is state.compute_loss:
        del trainer.__dict__["compute_loss"]
    for model in state.models:
        unpatch(model)
    return True


__all__ = [
    "DPO_LOGITS_METRICS",
    "GRPO_LOGITS_METRICS",
    "SFT_LOGITS_METRICS",
    "TRAINER_POLICIES",
    "TrainerPolicy",
    "apply_kernels_to_trainer",
    "unpatch_trainer",
]
