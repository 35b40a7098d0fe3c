"""Distillation in the engine: a frozen teacher beside the student, and the fused JSD to it.

Each micro-batch goes through the teacher's decoder first (no gradient); its last hidden states and LM
head weight go to the student's forward as `fuseforge.transformers.Distillation`, and the student's fused
loss head mixes cross-entropy with the fused linear JSD to the teacher: no [tokens, vocab] logits of either
model are built. The teacher is replicated on every rank (not sharded), in the run's compute dtype, with
fuseforge's norm / RoPE / MLP kernels. Evaluation reports the student's plain cross-entropy.
"""

from __future__ import annotations

import logging
from typing import Dict

import torch

from fuseforge_flyte.model_names import PRESETS, load_config
from fuseforge_flyte.training.models import build_model
from fuseforge_flyte.training.spec import TrainSpec

log = logging.getLogger("fuseforge.training")

# Batch keys that are not the decoder's input.
NOT_TEACHER_INPUTS = ("labels", "num_items_in_batch")


def check_teacher_fits(spec: TrainSpec) -> None:
    """Before any worker starts: a teacher and a student from their configs must share the vocabulary size
    (a preset's vocabulary follows the data's tokenizer, so it is checked in the worker)."""
    if not spec.teacher or spec.teacher in PRESETS or spec.model in PRESETS:
        return
    teacher, student = load_config(spec.teacher, option="teacher").vocab_size, load_config(spec.model).vocab_size
    if teacher != student:
        raise ValueError(f"TrainSpec.teacher: {spec.teacher!r} has a vocabulary of {teacher} tokens, the student "
                         f"{spec.model!r} has {student}: distillation needs one shared vocabulary (tokenizer)")


class Teacher:
    """The frozen teacher of a run with TrainSpec.teacher, built on `device` in `dtype`."""

    def __init__(self, spec: TrainSpec, student: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 attn_implementation: str, *, log_it: bool = True):
        vocab = student.get_output_embeddings().weight.shape[0]
        model = build_model(spec.teacher, seed=spec.seed, device=device,
                            vocab_size=vocab if spec.teacher in PRESETS else None)
        head = model.get_output_embeddings()
        if head is None or head.weight.shape[0] != vocab:
            got = None if head is None else head.weight.shape[0]
            raise ValueError(f"TrainSpec.teacher: {spec.teacher!r} has a vocabulary of {got} tokens, the student "
                             f"{spec.model!r} has {vocab}: distillation needs one shared vocabulary (tokenizer)")
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"TrainSpec.teacher: {spec.teacher!r}'s LM head has a bias, which the fused JSD lacks")
        from fuseforge.transformers.loss import LOGIT_TRANSFORMS  # the fused JSD computes plain logits

        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        scaled = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
        if scaled:
            raise ValueError(f"TrainSpec.teacher: {spec.teacher!r} transforms its logits ({', '.join(scaled)}), "
                             "which the fused JSD does not apply")
        if model.config._attn_implementation != attn_implementation:
            model.set_attn_implementation(attn_implementation)  # packed rows: attention stays within documents
        if spec.kernels:
            from fuseforge.transformers import apply_kernels

            apply_kernels(model, fused_linear_cross_entropy=False)  # its logits are never computed anyway
        model.requires_grad_(False).eval().to(dtype)
        self.model, self.decoder, self.head = model, model.base_model, head
        self.spec = spec
        if log_it:  # rank 0 only: one line per run, not one per worker
            log.info("teacher %s (%.3gM parameters, %s) for distillation: weight %g, beta %g, temperature %g",
                     spec.teacher, sum(p.numel() for p in model.parameters()) / 1e6,
                     str(dtype).replace("torch.", ""), spec.distill_weight, spec.distill_beta, spec.distill_temperature)

    @torch.no_grad()
    def target(self, batch: Dict[str, torch.Tensor]):
        """The Distillation the student's forward takes for `batch`."""
        from fuseforge.transformers import Distillation

        inputs = {k: v for k, v in batch.items() if k not in NOT_TEACHER_INPUTS}
        hidden = self.decoder(**inputs, use_cache=False).last_hidden_state
        spec = self.spec
        return Distillation(teacher_hidden=hidden, teacher_weight=self.head.weight, weight=spec.distill_weight,
                            beta=spec.distill_beta, temperature=spec.distill_temperature)
