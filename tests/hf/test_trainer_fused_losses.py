"""apply_kernels(trainer) routes TRL's DPOTrainer / GRPOTrainer losses through fuseforge's fused losses (issue 19).

Each trainer (tiny Llama) is trained for a few fp32 steps twice from the same seed, unpatched and
through `apply_kernels(trainer)`: the per-step loss, grad_norm and every logged metric must match
(the full-vocabulary metrics are absent, with one warning), the fused op must run once per training
micro-batch, and no training step (DPO) / loss computation (GRPO) may build logits for more than
`loss_chunk_size` tokens. An unsupported configuration keeps TRL's loss with one warning naming why.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
import trl  # noqa: E402 - a pinned test dependency (pyproject's dev extra)

from test_transformers_tiny_models import single_thread  # noqa: E402,F401 - autouse fixture (one torch thread)

import fuseforge.transformers as ff  # noqa: E402
from fuseforge.transformers.trainers import dpo, grpo, kto  # noqa: E402
from fuseforge.transformers.trainers import DPO_LOGITS_METRICS, KTO_LOGITS_METRICS  # noqa: E402
from trainer_support import common_args, tiny_llama, tokenizer  # noqa: E402,F401 - tokenizer: a fixture

pytestmark = pytest.mark.filterwarnings(
    "ignore::FutureWarning",
    "ignore::DeprecationWarning",
    "ignore:.*experimental.*:UserWarning",
    "ignore::RuntimeWarning:triton.runtime.interpreter",
)

RTOL = 1e-4
CHUNK = 8  # loss_chunk_size: tokens per chunk of logits in the fused loss
PROMPTS = ["the cat", "hello world", "a b c", "one two", "red green", "up down", "left", "tea or coffee"]
CHOSEN = [" sat on the mat", " and more", " d e f", " three four", " blue", " and around", " right", " tea"]
REJECTED = [" ran", " no", " x y", " five", " black and white", " sideways", " up", " neither of them"]


def lora_config():
    """LoRA on every linear layer, adapters in the model's dtype; seeded B away from 0 (see peft_policy)."""
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def peft_policy(model):
    """The model with LoRA adapters whose B is random (the policy differs from the reference from step 1)."""
    import peft

    model = peft.get_peft_model(model, lora_config(), autocast_adapter_dtype=False)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05, generator=gen)
    return model


def dpo_trainer(tokenizer, tmp_path, *, with_ref_model=True, peft_adapter=False, **config):
    model = tiny_llama(tokenizer, hidden_size=32)
    if peft_adapter:
        model = peft_policy(model)
    # learning rate large enough that the policy leaves the reference: non-trivial rewards
    args = trl.DPOConfig(**common_args(tmp_path, gradient_accumulation_steps=2, learning_rate=1e-2, max_length=32,
                                       **config))
    data = datasets.Dataset.from_dict({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED})
    ref = copy.deepcopy(model) if with_ref_model else None
    return trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer)


class WideLogits(TorchFunctionMode):
    """Records every tensor a torch function returns that is vocabulary-wide with more than CHUNK rows
    (other than views of the models' parameters, such as the transposed LM head weight [H, V])."""

    def __init__(self, vocab: int, *models):
        super().__init__()
        self.vocab, self.seen = vocab, []
        self.params = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                if t.numel() // self.vocab > CHUNK and t.untyped_storage().data_ptr() not in self.params:
                    self.seen.append((getattr(func, "__name__", str(func)), tuple(t.shape)))
        return out


@pytest.fixture
def dpo_calls(monkeypatch):
    calls = Counter()
    real = dpo.fused_linear_dpo_loss

    def counted(*args, **kwargs):
        calls[kwargs["loss_type"]] += 1
        calls["reference: " + ("log-probs" if kwargs.get("ref_logps") is not None else "model")] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dpo, "fused_linear_dpo_loss", counted)
    return calls


def train(trainer, spy: WideLogits | None = None) -> list[dict]:
    with spy if spy is not None else contextlib.nullcontext():
        trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == trainer.args.max_steps and all(math.isfinite(log["loss"]) for log in logs)
    return logs


def fuseforge_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "fuseforge" in str(w.message)]


def train_patched(trainer, tokenizer):
    """apply_kernels(trainer, loss_chunk_size=CHUNK), then train with the vocabulary-wide tensors spied on:
    (the report, the step logs, fuseforge's warnings, the spy)."""
    spy = WideLogits(len(tokenizer), *(m for m in (trainer.model, trainer.ref_model) if m is not None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ff.apply_kernels(trainer, loss_chunk_size=CHUNK)
        logs = train(trainer, spy)
    return report, logs, fuseforge_warnings(caught), spy


@pytest.mark.parametrize(
    "loss_type, reference",
    [("sigmoid", "model"), ("ipo", "log-probs"), ("robust", "model"), ("hinge", "log-probs"), ("sigmoid", "adapter")],
)
def test_dpo_trainer_trains_on_fused_dpo_loss(loss_type, reference, tokenizer, tmp_path, dpo_calls):
    """reference "adapter": a LoRA policy (peft) without a reference model, whose reference is the policy with
    its adapter disabled: computed by the fused loss from hidden states too (no logits), equal to TRL's."""
    config = dict(loss_type=[loss_type], beta=0.5)
    if loss_type == "robust":
        config["label_smoothing"] = 0.2
    if loss_type == "hinge":
        config["loss_weights"] = [0.5]
    if reference == "log-probs":
        config.update(precompute_ref_log_probs=True)

    def build():
        return dpo_trainer(tokenizer, tmp_path, with_ref_model=reference == "model",
                           peft_adapter=reference == "adapter", **config)

    expected = train(build())
    assert all(metric in log for log in expected for metric in DPO_LOGITS_METRICS)  # what TRL logs unpatched

    trainer = build()
    model = trainer.model
    head_calls = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: head_calls.append(tuple(out.shape)) if m.training else None)
    report, logs, ours, spy = train_patched(trainer, tokenizer)
    assert len(ours) == 1 and all(m in ours[0] for m in DPO_LOGITS_METRICS), ours
    assert f"trainer: DPOTrainer's training loss is fused_linear_dpo_loss (loss_type={loss_type!r})" in report.notes

    kind = "model" if reference == "adapter" else reference  # the adapter-disabled policy is a reference model
    assert dpo_calls[loss_type] == 2 * 2 and dpo_calls[f"reference: {kind}"] == 2 * 2  # every micro-batch
    if reference == "adapter":
        assert report.patched["lora"] and any("PEFT" in note for note in report.notes), report
    assert not head_calls and not spy.seen, (head_calls, spy.seen[:5])  # no [tokens, vocab] logits in training
    numeric = [k for k, v in expected[0].items() if isinstance(v, float) and k not in ("step_time", "epoch")]
    assert {"loss", "grad_norm", "rewards/margins", "logps/chosen", "logits/chosen"} <= set(numeric)
    for step, (a, e) in enumerate(zip(logs, expected, strict=True)):
        assert not any(metric in a for metric in DPO_LOGITS_METRICS), a
        for key in numeric:
            if key in DPO_LOGITS_METRICS:
                continue
            if key == "rewards/accuracies" and abs(e["rewards/margins"]) < 1e-5:
                # policy == reference (step 1 with precomputed reference log-probs): each pair's margin is
                # rounding noise, so "chosen > rejected" is a coin toss that differs between devices
                continue
            assert a[key] == pytest.approx(e[key], rel=RTOL, abs=1e-6), f"step {step + 1}: {key}"
    # The run is not trivial: the policy moved away from the reference.
    assert any(abs(log["rewards/margins"]) > 1e-3 for log in logs)

    assert ff.unpatch(trainer) and "compute_loss" not in trainer.__dict__


def test_dpo_trainer_unsupported_loss_type_keeps_trl_loss_with_one_warning(tokenizer, tmp_path, dpo_calls):
    trainer = dpo_trainer(tokenizer, tmp_path, loss_type=["nca_pair"], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ff.apply_kernels(trainer)
        logs = train(trainer)
    ours = fuseforge_warnings(caught)
    assert len(ours) == 1, ours
    assert "DPOTrainer keeps TRL's own DPO loss" in ours[0] and "loss_type=['nca_pair']" in ours[0], ours
    assert any(note.startswith("fused_linear_dpo_loss: off for DPOTrainer") for note in report.notes)
    assert "compute_loss" not in trainer.__dict__ and not dpo_calls
    assert all(metric in logs[0] for metric in DPO_LOGITS_METRICS)  # TRL's path: its metrics stay


def test_dpo_trainer_fused_loss_off_keeps_trl_loss_silently(tokenizer, tmp_path, dpo_calls):
    trainer = dpo_trainer(tokenizer, tmp_path, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ff.apply_kernels(trainer, fused_linear_cross_entropy=False)
    assert not fuseforge_warnings(caught) and "compute_loss" not in trainer.__dict__


def test_dpo_trainer_subclass_overriding_compute_loss_falls_back(tokenizer, tmp_path):
    class MyDPO(trl.DPOTrainer):
        def _compute_loss(self, model, inputs, return_outputs):
            return super()._compute_loss(model, inputs, return_outputs)

    trainer = dpo_trainer(tokenizer, tmp_path, max_steps=1)
    trainer.__class__ = MyDPO
    with pytest.warns(UserWarning, match=r"MyDPO keeps TRL's own DPO loss .*: MyDPO._compute_loss is overridden"):
        ff.apply_kernels(trainer)
    assert "compute_loss" not in trainer.__dict__


# --- KTOTrainer ----------------------------------------------------------------------------------


@pytest.fixture
def kto_calls(monkeypatch):
    calls = Counter()
    real_loss, real_kl = kto.fused_linear_kto_loss, kto.fused_linear_kto_kl

    def loss(*args, **kwargs):
        calls[kwargs["loss_type"]] += 1
        calls["reference: " + ("log-probs" if kwargs.get("ref_logps") is not None else "model")] += 1
        return real_loss(*args, **kwargs)

    def kl(*args, **kwargs):
        calls["kl"] += 1
        return real_kl(*args, **kwargs)

    monkeypatch.setattr(kto, "fused_linear_kto_loss", loss)
    monkeypatch.setattr(kto, "fused_linear_kto_kl", kl)
    return calls


def kto_trainer(tokenizer, tmp_path, *, with_ref_model=True, peft_adapter=False, **config):
    model = tiny_llama(tokenizer, hidden_size=32)
    if peft_adapter:
        model = peft_policy(model)
    args = trl.KTOConfig(**common_args(tmp_path, gradient_accumulation_steps=2, learning_rate=1e-2, max_length=32,
                                       per_device_train_batch_size=4, **config))
    # unpaired: each prompt once with a desirable and once with an undesirable completion, in an order that
    # mixes the labels within batches
    rows = [(p, c, True) for p, c in zip(PROMPTS, CHOSEN)] + [(p, r, False) for p, r in zip(PROMPTS, REJECTED)]
    rows = rows[::2] + rows[1::2]
    data = datasets.Dataset.from_dict({"prompt": [r[0] for r in rows], "completion": [r[1] for r in rows],
                                       "label": [r[2] for r in rows]})
    ref = copy.deepcopy(model) if with_ref_model else None
    return trl.KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer)


@pytest.mark.parametrize(
    "loss_type, reference",
    [("kto", "model"), ("kto", "log-probs"), ("apo_zero_unpaired", "model"), ("kto", "adapter")],
)
def test_kto_trainer_trains_on_fused_kto_loss(loss_type, reference, tokenizer, tmp_path, kto_calls):
    config = dict(loss_type=loss_type, beta=0.5, desirable_weight=1.3, undesirable_weight=0.8)
    if reference == "log-probs":
        config.update(precompute_ref_log_probs=True)

    def build():
        return kto_trainer(tokenizer, tmp_path, with_ref_model=reference == "model",
                           peft_adapter=reference == "adapter", **config)

    expected = train(build())
    assert all(metric in log for log in expected for metric in KTO_LOGITS_METRICS)  # what TRL logs unpatched

    trainer = build()
    report, logs, ours, spy = train_patched(trainer, tokenizer)
    assert len(ours) == 1 and all(m in ours[0] for m in KTO_LOGITS_METRICS), ours
    assert f"trainer: KTOTrainer's training loss is fused_linear_kto_loss (loss_type={loss_type!r})" in report.notes
    kind = "model" if reference == "adapter" else reference  # the adapter-disabled policy is a reference model
    assert kto_calls[loss_type] == 2 * 2 and kto_calls[f"reference: {kind}"] == 2 * 2  # every micro-batch
    assert kto_calls["kl"] == (2 * 2 if loss_type == "kto" else 0)
    assert not spy.seen, spy.seen[:5]  # no [tokens, vocab] logits in training
    numeric = [k for k, v in expected[0].items() if isinstance(v, float) and k not in ("step_time", "epoch")]
    assert {"loss", "grad_norm", "kl", "rewards/chosen", "logps/chosen", "logits/rejected"} <= set(numeric)
    for step, (a, e) in enumerate(zip(logs, expected, strict=True)):
        assert not any(metric in a for metric in KTO_LOGITS_METRICS), a
        for key in numeric:
            if key not in KTO_LOGITS_METRICS:
                assert a[key] == pytest.approx(e[key], rel=RTOL, abs=1e-6), f"step {step + 1}: {key}"
    assert any(abs(log.get("rewards/chosen", 0.0)) > 1e-3 for log in logs)  # the policy left the reference
    if loss_type == "kto":
        assert any(log["kl"] > 0 for log in logs)  # the KL term took part
    assert ff.unpatch(trainer) and "compute_loss" not in trainer.__dict__


# --- GRPOTrainer ---------------------------------------------------------------------------------


def grpo_trainer(tokenizer, tmp_path, peft_adapter=False, **config):
    def longer_is_better(completions, **kwargs):
        return [float(len(c)) for c in completions]

    model = tiny_llama(tokenizer, hidden_size=32)
    if peft_adapter:
        model = peft_policy(model)

    # Two policy updates per generation with a tight clip range: old log-probs, ratios != 1, clipping.
    config = {"max_steps": 2, "loss_type": "dapo", "num_iterations": 2, "epsilon": 0.002, "beta": 0.0, **config}
    args = trl.GRPOConfig(**common_args(tmp_path, gradient_accumulation_steps=2, learning_rate=1e-2, num_generations=2,
                                        max_completion_length=4, **config))
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=longer_is_better,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS[:4]}),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("loss_type, policy", [("dapo", "full"), ("grpo", "full"), ("grpo", "adapter")])
def test_grpo_trainer_trains_on_fused_grpo_loss(loss_type, policy, tokenizer, tmp_path, monkeypatch):
    """policy "adapter": a LoRA policy (peft) with a KL term (beta > 0) to the policy with its adapter disabled."""
    extra = dict(peft_adapter=True, beta=0.1) if policy == "adapter" else {}
    calls = Counter()
    real = grpo.fused_linear_grpo_loss

    def counted(*args, **kwargs):
        calls[kwargs["loss_type"]] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "fused_linear_grpo_loss", counted)
    expected = train(grpo_trainer(tokenizer, tmp_path, loss_type=loss_type, **extra))
    assert all("entropy" in log for log in expected)

    trainer = grpo_trainer(tokenizer, tmp_path, loss_type=loss_type, **extra)
    spy = WideLogits(len(tokenizer), trainer.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ff.apply_kernels(trainer, loss_chunk_size=CHUNK)
        fused = trainer.compute_loss

        def spied(*args, **kwargs):  # the loss computation; TRL's scoring of old log-probs stays TRL's
            with spy:
                return fused(*args, **kwargs)

        trainer.compute_loss = spied
        trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    ours = fuseforge_warnings(caught)
    assert len(ours) == 1 and "entropy" in ours[0], ours
    assert f"trainer: GRPOTrainer's training loss is fused_linear_grpo_loss (loss_type={loss_type!r})" in report.notes
    assert calls[loss_type] == 2 * 2, calls  # every training micro-batch
    numeric = [k for k, v in expected[0].items() if isinstance(v, float) and k not in ("step_time", "epoch")]
    assert {"loss", "grad_norm", "clip_ratio/region_mean", "reward"} <= set(numeric), numeric
    for step, (a, e) in enumerate(zip(logs, expected, strict=True)):
        assert set(a) == set(e) - {"entropy"}, (a, e)
        for key in set(e) & set(numeric) - {"entropy"}:
            assert a[key] == pytest.approx(e[key], rel=RTOL, abs=1e-6), f"step {step + 1}: {key}"
    assert not spy.seen, spy.seen[:5]
    assert any(log["clip_ratio/region_mean"] > 0 for log in logs), logs  # the clipped branch ran
    if policy == "adapter":
        assert any(log["kl"] > 0 for log in logs), logs  # the adapter-disabled reference took part


def test_grpo_trainer_unsupported_loss_type_keeps_trl_loss_with_one_warning(tokenizer, tmp_path):
    trainer = grpo_trainer(tokenizer, tmp_path, loss_type="sapo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ff.apply_kernels(trainer)
    ours = fuseforge_warnings(caught)
    assert len(ours) == 1 and "GRPOTrainer keeps TRL's own GRPO loss" in ours[0] and "'sapo'" in ours[0], ours
    assert any(note.startswith("fused_linear_grpo_loss: off for GRPOTrainer") for note in report.notes)
    assert "compute_loss" not in trainer.__dict__
