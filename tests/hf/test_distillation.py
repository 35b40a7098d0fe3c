"""Distillation: `Distillation` through a patched causal LM's fused loss head, and the engine's teacher.

References are written here from the definitions (student and teacher logits in float64, the
generalized JSD from F.kl_div in test_jsd), on tiny models built in the tests.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fuseforge.transformers import Distillation, apply_kernels  # noqa: E402
from fuseforge_flyte.training.distill import check_teacher_fits  # noqa: E402
from fuseforge_flyte.training.engine import train  # noqa: E402
from fuseforge_flyte.training.spec import TrainSpec  # noqa: E402
from test_jsd import ref_jsd_rows  # noqa: E402
from test_transformers_tiny_models import synthetic_batches, tiny_model  # noqa: E402

IGNORE = -100


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""


def _teacher():
    """A tiny Llama of another width and depth with the students' vocabulary (tiny_model's)."""
    return tiny_model("llama", hidden_size=48, intermediate_size=96, num_hidden_layers=1).eval()


def _reference_loss(student, teacher, batch, weight, beta, temperature, num_items=None):
    """(1 - w) CE + w JSD over the label-carrying positions, from both models' float64 logits."""
    logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    with torch.no_grad():
        hidden = teacher.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        t_logits = hidden.double() @ teacher.lm_head.weight.double().T
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE)[:, 1:].reshape(-1)
    keep = targets != IGNORE
    s = logits.reshape(-1, logits.shape[-1])
    ce = torch.nn.functional.cross_entropy(s, targets, ignore_index=IGNORE, reduction="sum")
    rows = ref_jsd_rows((s / temperature).log_softmax(-1), (t_logits.reshape(s.shape) / temperature).log_softmax(-1),
                        beta)
    jsd = torch.where(keep, rows, torch.zeros_like(rows)).sum()
    n = keep.sum() if num_items is None else num_items
    return ((1 - weight) * ce + weight * jsd) / n, hidden


@pytest.mark.parametrize("beta, temperature, weight", [(0.5, 1.0, 0.5), (0.0, 2.0, 0.3), (1.0, 0.7, 1.0)])
@pytest.mark.parametrize("accumulated", [False, True])
def test_distillation_loss_and_gradients_match_the_reference(beta, temperature, weight, accumulated):
    student, teacher = tiny_model("llama"), _teacher()
    fused = copy.deepcopy(student)
    apply_kernels(fused)
    batch = synthetic_batches(1)[0]
    num_items = torch.tensor(37.0) if accumulated else None  # a global count larger than this batch's
    expected, teacher_hidden = _reference_loss(student, teacher, batch, weight, beta, temperature, num_items)
    expected.backward()
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    d = Distillation(teacher_hidden=teacher_hidden, teacher_weight=teacher.lm_head.weight, weight=weight, beta=beta,
                     temperature=temperature)
    out = fused(**batch, distillation=d, **extra)
    out.loss.backward()
    assert out.logits is None
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(fused.named_parameters(), student.parameters()):
        largest = q.grad.abs().max()
        torch.testing.assert_close(p.grad / largest, q.grad / largest, rtol=1e-4, atol=2e-5, msg=name)
    assert teacher.lm_head.weight.grad is None  # the teacher is a constant


def test_distillation_is_refused_where_the_fused_loss_cannot_compute_it():
    student, teacher = tiny_model("llama"), _teacher()
    apply_kernels(student)
    batch = synthetic_batches(1)[0]
    hidden = teacher.model(input_ids=batch["input_ids"]).last_hidden_state.detach()
    d = Distillation(teacher_hidden=hidden, teacher_weight=teacher.lm_head.weight)
    with pytest.raises(ValueError, match="needs a training forward with labels"):
        student.eval()(**batch, distillation=d)
    student.train()
    with pytest.raises(ValueError, match=r"covers 24 positions, the student's head sees 48"):
        student(**batch, distillation=Distillation(teacher_hidden=hidden[:1], teacher_weight=d.teacher_weight))
    with pytest.raises(ValueError, match=r"weight must be in \[0, 1\]"):
        Distillation(teacher_hidden=hidden, teacher_weight=d.teacher_weight, weight=1.5)


# --- the engine ------------------------------------------------------------------------------------

TINY = dict(model="tiny-llama", dataset="bench:bytes", batch_size=2, seq_len=32, steps=3, lr=3e-3, kernels=True)


def test_engine_distils_from_a_teacher():
    """Weight 0 is plain training (the teacher changes nothing); weight 1 trains on the JSD alone, which
    starts far below the cross-entropy of a random model (both models spread their mass alike)."""
    plain = train(TrainSpec(**TINY))
    zero = train(TrainSpec(teacher="tiny-qwen2", distill_weight=0.0, **TINY))
    only = train(TrainSpec(teacher="tiny-qwen2", distill_weight=1.0, distill_beta=0.5, **TINY))
    assert zero.loss_curve == pytest.approx(plain.loss_curve, abs=1e-6)
    assert all(math.isfinite(x) for x in only.loss_curve)
    assert only.loss_curve[0] < 0.1 * plain.loss_curve[0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(teacher="tiny-qwen2", kernels=False), "distillation runs through the fused loss head"),
        (dict(teacher="tiny-qwen2", skip_kernels="fused_linear_cross_entropy"), "keep fused_linear_cross_entropy"),
        (dict(teacher="./no-such-teacher"), "TrainSpec.teacher: unknown model"),
        (dict(teacher="tiny-qwen2", distill_weight=1.5), r"distill_weight must be in \[0, 1\]"),
        (dict(distill_temperature=0.0), "distill_temperature must be > 0"),
    ],
)
def test_bad_distillation_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainSpec(**{**TINY, **overrides}).validate()


def test_teacher_with_another_vocabulary_fails_before_training(tmp_path):
    paths = {}
    for name, vocab in (("student", 500), ("teacher", 600)):
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, vocab_size=vocab)
        paths[name] = tmp_path / name / "config.json"
        paths[name].parent.mkdir()
        paths[name].write_text(json.dumps(config.to_dict()))
    spec = TrainSpec(**{**TINY, "model": str(paths["student"]), "teacher": str(paths["teacher"])})
    with pytest.raises(ValueError, match="vocabulary of 600 tokens, the student .* has 500"):
        check_teacher_fits(spec)
