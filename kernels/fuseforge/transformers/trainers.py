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
- TRL's `DPOTrainer`, `KTOTrainer`, `GRPOTrainer`, `RLOOTrainer`, `GKDTrainer`,
  `DistillationTrainer` and `RewardTrainer` compute their loss themselves (from per-token
  log-probabilities or logits), never from the model's `loss`: their models keep the
  norm / RoPE / MLP kernels and get no fused loss, so their numbers are unchanged.
- A trainer that overrides `compute_loss` below its known ancestor might read
  `outputs.logits`: its model gets no fused loss either, with a warning.

A trainer-specific fused loss (preference, RL) plugs in as the `adapt` of its TRAINER_POLICIES
entry, which runs on the patched model and may replace the trainer's loss computation.
"""

from __future__ import annotations

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

from fuseforge.transformers.loss import LOSS_SPEC_ATTR
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
    rule the fused loss out after all (None: they do not). adapt(trainer, model), after
    the model is patched (with or without the fused loss): adapts the trainer instance to
    the patched model. A trainer-specific fused loss (preference, RL) is installed here.
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


def _adapt_sft(trainer, model: nn.Module) -> None:
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


# --- the table ----------------------------------------------------------------------------------

# Trainer class name -> policy, matched along the trainer's MRO among classes of transformers and trl.
# The first entries a subclass meets win (GKDTrainer is an SFTTrainer subclass, for instance).
TRAINER_POLICIES: dict[str, TrainerPolicy] = {
    "Trainer": TrainerPolicy(uses_model_loss=True),
    "SFTTrainer": TrainerPolicy(uses_model_loss=True, check=_sft_unsupported, adapt=_adapt_sft),
    "DPOTrainer": _own_loss("DPOTrainer", "preference loss from per-token log-probabilities"),
    "KTOTrainer": _own_loss("KTOTrainer", "preference loss from per-token log-probabilities"),
    "GRPOTrainer": _own_loss("GRPOTrainer", "policy loss from per-token log-probabilities"),
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
    if policy.adapt is not None:
        try:
            policy.adapt(trainer, model)
        except BaseException:
            _put_back(model, theirs)
            raise
    # The model's own report stays as apply_kernels left it; the trainer's adds what the trainer changed.
    report = dataclasses.replace(report, target=f"{report.target} in {name}", notes=list(report.notes))
    report.notes.append(f"trainer: the {known.__module__}.{known.__name__} policy (TRAINER_POLICIES)")
    if reason is not None and options[_FLCE]:
        _say_why(name, reason, report, warn)

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
    "SFT_LOGITS_METRICS",
    "TRAINER_POLICIES",
    "TrainerPolicy",
    "apply_kernels_to_trainer",
    "unpatch_trainer",
]
