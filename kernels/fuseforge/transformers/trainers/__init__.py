"""apply_kernels(trainer): fuseforge's kernels in an already-built transformers / TRL trainer.

Patching the model alone is not enough for every trainer: the fused linear cross-entropy returns `logits=None` from
a training forward with labels, and what a trainer does with the model's outputs decides whether that is a saving
or a crash. apply_kernels(trainer) patches `trainer.model` (and a reference / teacher model, without the fused loss),
then adapts the trainer by its TRAINER_POLICIES entry (apply.py):

- `transformers.Trainer` trains on the model's own `loss`: the fused loss stays, nothing else changes.
- TRL's SFTTrainer (sft.py): training steps take the model's fused loss, evaluation keeps TRL's path.
- TRL's DPOTrainer, KTOTrainer and GRPOTrainer (dpo.py, kto.py, grpo.py): training steps run fuseforge's fused
  DPO / KTO / GRPO loss on the last hidden states and the LM head weight, never building [tokens, vocab] logits,
  PEFT policies included (fused_loss.py). Which configurations they cover, and the reason each other one keeps
  TRL's loss (one warning): sft_unsupported, dpo_unsupported, kto_unsupported, grpo_unsupported and the
  common_unsupported they share.
- TRL's RLOOTrainer, GKDTrainer, DistillationTrainer and RewardTrainer compute their loss themselves from
  per-token log-probabilities or logits: their models keep the norm / RoPE / MLP kernels without the fused loss.
- A trainer that overrides `compute_loss` below its known ancestor might read `outputs.logits`: its model gets no
  fused loss either, with a warning.

`fused_linear_cross_entropy=False` keeps every trainer's own loss and metrics. A new trainer-specific fused loss
plugs in as the `adapt` of its TRAINER_POLICIES entry.
"""

from fuseforge.transformers.trainers.apply import TRAINER_POLICIES, apply_kernels_to_trainer, unpatch_trainer
from fuseforge.transformers.trainers.dpo import DPO_LOGITS_METRICS
from fuseforge.transformers.trainers.grpo import GRPO_LOGITS_METRICS
from fuseforge.transformers.trainers.kto import KTO_LOGITS_METRICS
from fuseforge.transformers.trainers.policy import TrainerPolicy, is_trainer
from fuseforge.transformers.trainers.sft import SFT_LOGITS_METRICS

__all__ = [
    "DPO_LOGITS_METRICS",
    "GRPO_LOGITS_METRICS",
    "KTO_LOGITS_METRICS",
    "SFT_LOGITS_METRICS",
    "TRAINER_POLICIES",
    "TrainerPolicy",
    "apply_kernels_to_trainer",
    "is_trainer",
    "unpatch_trainer",
]
