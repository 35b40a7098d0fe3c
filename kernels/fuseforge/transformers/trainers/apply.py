"""apply_kernels(trainer) and its undo: the trainer's models patched, then the trainer adapted by its
TRAINER_POLICIES entry, looked up along the trainer's class hierarchy (so subclasses inherit their parent's entry)."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field

from torch import nn

from fuseforge.transformers.patching import STATE_ATTR, patch_instance, unpatch_instance
from fuseforge.transformers.report import PatchReport
from fuseforge.transformers.trainers.dpo import adapt_dpo
from fuseforge.transformers.trainers.grpo import adapt_grpo
from fuseforge.transformers.trainers.kto import adapt_kto
from fuseforge.transformers.trainers.policy import FUSED_LOSS_FLAG, TrainerPolicy, unwrap_model
from fuseforge.transformers.trainers.sft import adapt_sft, sft_unsupported
from fuseforge.transformers.trainers.trl_head import patch_next_to_trl_head, put_back

logger = logging.getLogger(__name__)

# Attributes of TRL trainers holding models that run forwards but are not trained.
_FROZEN_MODEL_ATTRS = ("ref_model", "teacher_model")


def _own_loss(name: str, how: str) -> TrainerPolicy:
    return TrainerPolicy(
        uses_model_loss=False,
        reason=f"{name} computes its loss itself ({how}), not from the model's loss",
    )

# Trainer class name -> policy, matched along the trainer's MRO among classes of transformers and trl.
# The first entries a subclass meets win (GKDTrainer is an SFTTrainer subclass, for instance).
TRAINER_POLICIES: dict[str, TrainerPolicy] = {
    "Trainer": TrainerPolicy(uses_model_loss=True),
    "SFTTrainer": TrainerPolicy(uses_model_loss=True, check=sft_unsupported, adapt=adapt_sft),
    "DPOTrainer": dataclasses.replace(
        _own_loss("DPOTrainer", "preference loss from per-token log-probabilities"), adapt=adapt_dpo
    ),
    "KTOTrainer": dataclasses.replace(
        _own_loss("KTOTrainer", "preference loss from per-token log-probabilities"), adapt=adapt_kto
    ),
    "GRPOTrainer": dataclasses.replace(
        _own_loss("GRPOTrainer", "policy loss from per-token log-probabilities"), adapt=adapt_grpo
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


@dataclass
class _TrainerState:
    """What apply_kernels changed on a trainer; `options` and `report` as patching._State has them."""

    options: dict
    report: PatchReport
    models: list = field(default_factory=list)  # models patched for this trainer
    compute_loss: object = None  # our compute_loss wrapper, when installed


def _without_fused_loss(options: dict) -> dict:
    return {**options, FUSED_LOSS_FLAG: False, "loss_chunk_size": None}


def _say_why(trainer_name: str, reason: str, report: PatchReport, warn: bool) -> None:
    report.notes.append(f"{FUSED_LOSS_FLAG}: off for {trainer_name}: {reason}")
    message = f"fuseforge: fused linear cross-entropy is off for {trainer_name}'s model: {reason}"
    if warn:
        warnings.warn(message, UserWarning, stacklevel=4)
    else:
        logger.info(message)


def apply_kernels_to_trainer(trainer, options: dict) -> PatchReport:
    """apply_kernels for a built transformers.Trainer (options: apply_kernels' checked keyword arguments)."""
    state = trainer.__dict__.get(STATE_ATTR)
    if state is not None:
        if state.options == options:
            return state.report
        unpatch_trainer(trainer)
    model = unwrap_model(trainer, getattr(trainer, "model", None))
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
    elif options[FUSED_LOSS_FLAG] and policy.check is not None:
        reason = policy.check(trainer)
        warn = reason is not None

    if options[FUSED_LOSS_FLAG] and reason is None:
        report, theirs = patch_next_to_trl_head(model, options)
    else:
        report, theirs = patch_instance(model, _without_fused_loss(options)), {}
    adapt_note = None
    if policy.adapt is not None:
        try:
            adapt_note = policy.adapt(trainer, model, options)
        except BaseException:
            put_back(model, theirs)
            raise
    # The model's own report stays as apply_kernels left it; the trainer's adds what the trainer changed.
    report = dataclasses.replace(report, target=f"{report.target} in {name}", notes=list(report.notes))
    report.notes.append(f"trainer: the {known.__module__}.{known.__name__} policy (TRAINER_POLICIES)")
    if reason is not None and options[FUSED_LOSS_FLAG]:
        _say_why(name, reason, report, warn)
    if adapt_note:
        report.notes.append(adapt_note)

    trainer_state = _TrainerState(options=dict(options), report=report, models=[model])
    wrapper = trainer.__dict__.get("compute_loss")
    if getattr(wrapper, "_fuseforge_wrapped", None) is not None:
        trainer_state.compute_loss = wrapper
    for attr in _FROZEN_MODEL_ATTRS:
        other = unwrap_model(trainer, getattr(trainer, attr, None))
        if isinstance(other, nn.Module) and other is not model:
            with warnings.catch_warnings():  # its report is summarised in ours
                warnings.simplefilter("ignore")
                other_report = patch_instance(other, _without_fused_loss(options))
            trainer_state.models.append(other)
            done = ", ".join(other_report.patched_kernels()) or "nothing"
            report.notes.append(f"{attr} ({type(other).__name__}) patched without the fused loss: {done}")
    if getattr(trainer, "model_init", None) is not None:
        report.notes.append(
            "models the trainer re-creates with model_init are not patched: patch the class instead, "
            "apply_kernels(ModelClass)"
        )
    trainer.__dict__[STATE_ATTR] = trainer_state
    return report


def unpatch_trainer(trainer) -> bool:
    """Undo apply_kernels(trainer): its compute_loss wrapper and the patches of its models."""
    state = trainer.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return False
    if state.compute_loss is not None and trainer.__dict__.get("compute_loss") is state.compute_loss:
        del trainer.__dict__["compute_loss"]
    for model in state.models:
        unpatch_instance(model)
    return True
