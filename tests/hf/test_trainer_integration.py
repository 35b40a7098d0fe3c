"""apply_kernels(trainer) on transformers' Trainer and TRL's trainers (issue 18), on tiny models.

Each trainer is trained for a few steps twice from the same seed, unpatched and through
`apply_kernels(trainer)`, with the fused ops wrapped in counters: the kernels must run, the
fused loss exactly where the trainer trains on the model's own loss (Trainer, SFTTrainer),
the per-step losses and logged metrics must match the unpatched run, and SFTTrainer's
logits-based training metrics must be absent with exactly one warning (or present, with the
fused loss off).
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
import trl  # noqa: E402 - a pinned test dependency (pyproject's dev extra)

from test_transformers_tiny_models import single_thread  # noqa: E402,F401 - autouse fixture (one torch thread)

import fuseforge.transformers as ff  # noqa: E402
from fuseforge.transformers import layers as layers_patch  # noqa: E402
from fuseforge.transformers import loss as loss_patch  # noqa: E402
from fuseforge.transformers import rope as rope_patch  # noqa: E402
from fuseforge.transformers.trainers import SFT_LOGITS_METRICS  # noqa: E402
from trainer_support import USE_CPU, common_args, tiny_llama, tokenizer  # noqa: E402,F401 - tokenizer: a fixture

pytestmark = pytest.mark.filterwarnings(
    "ignore::FutureWarning", "ignore::DeprecationWarning", "ignore:.*experimental.*:UserWarning"
)

LAYER_KERNELS = ("rms_norm", "swiglu", "rope")
RTOL = 1e-4  # fp32 end to end; a few optimizer steps amplify the kernels' last-ulp differences


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the fused ops the patched modules use (the names they look up at call time)."""
    counts = Counter()

    def spy(module, name, key):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            counts[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    spy(layers_patch, "rms_norm", "rms_norm")
    spy(layers_patch, "swiglu", "swiglu")
    spy(rope_patch, "rope", "rope")
    spy(loss_patch, "fused_linear_cross_entropy", "fused_linear_cross_entropy")
    return counts


def head_widths(model) -> list:
    """Last dimension of every lm_head output while training: 0 is the fused loss's placeholder."""
    widths = []
    model.lm_head.register_forward_hook(lambda m, i, out: widths.append(out.shape[-1]) if m.training else None)
    return widths


def train_logs(trainer) -> list[dict]:
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == trainer.args.max_steps
    assert all(math.isfinite(log["loss"]) for log in logs)
    return logs


def assert_logs_match(actual: list[dict], expected: list[dict], keys) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        for key in keys:
            assert a[key] == pytest.approx(e[key], rel=RTOL, abs=1e-6), f"step {step + 1}: {key}"


def fused_loss_notes(report) -> list[str]:
    return [note for note in report.notes if note.startswith("fused_linear_cross_entropy: off")]


# --- transformers.Trainer -----------------------------------------------------------------------


def lm_dataset(n: int = 8, seq: int = 24, vocab: int = 1000):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (n, seq), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt the loss ignores
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": labels.tolist()}
    )


def test_trainer_trains_on_fused_loss(tokenizer, tmp_path, kernel_calls):
    def run(patch: bool):
        model = tiny_llama(tokenizer)
        args = transformers.TrainingArguments(**common_args(tmp_path, gradient_accumulation_steps=2))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=lm_dataset())
        widths = head_widths(model)
        report = ff.apply_kernels(trainer) if patch else None
        return train_logs(trainer), widths, report

    expected, expected_widths, _ = run(patch=False)
    assert not kernel_calls and set(expected_widths) == {1024}  # the spies see nothing unpatched

    logs, widths, report = run(patch=True)
    assert "fused_linear_cross_entropy" in report.patched_kernels(), report
    assert all(kernel_calls[k] > 0 for k in LAYER_KERNELS), kernel_calls
    assert kernel_calls["fused_linear_cross_entropy"] == 2 * 2  # one per micro-batch: 2 steps x 2 accumulated
    assert widths and set(widths) == {0}  # no [tokens, vocab] logits in any training forward
    assert_logs_match(logs, expected, ("loss", "grad_norm"))


def test_trainer_overriding_compute_loss_gets_no_fused_loss(tokenizer, tmp_path, kernel_calls):
    class LogitsTrainer(transformers.Trainer):
        """Reads outputs.logits: the fused loss would hand it None."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return (loss, logits) if return_outputs else loss

    model = tiny_llama(tokenizer)
    trainer = LogitsTrainer(
        model=model,
        args=transformers.TrainingArguments(**common_args(tmp_path, max_steps=1)),
        train_dataset=lm_dataset(4),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ff.apply_kernels(trainer)
    ours = [str(w.message) for w in caught if "fuseforge" in str(w.message)]
    assert len(ours) == 1 and "LogitsTrainer overrides compute_loss" in ours[0], ours
    assert "fused_linear_cross_entropy" not in report.patched_kernels() and fused_loss_notes(report)
    train_logs(trainer)
    assert kernel_calls["rms_norm"] > 0 and kernel_calls["fused_linear_cross_entropy"] == 0


# --- TRL SFTTrainer -----------------------------------------------------------------------------

SFT_TEXTS = [
    "the cat sat on the mat and looked at the dog",
    "hello world, this is a tiny model",
    "one two three four five six seven",
    "a quick brown fox jumps over the lazy dog",
]


def sft_trainer(tokenizer, tmp_path, peft_config=None, **config):
    model = tiny_llama(tokenizer)
    args = trl.SFTConfig(**common_args(tmp_path, gradient_accumulation_steps=2, max_length=32, **config))
    data = datasets.Dataset.from_dict({"text": SFT_TEXTS * 2})
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data.select(range(2)), processing_class=tokenizer,
        peft_config=peft_config,
    )
    return trainer, model


@pytest.fixture(scope="module")
def sft_reference(tokenizer, tmp_path_factory):
    """The unpatched SFTTrainer run: per-step logs and evaluation metrics."""
    trainer, _ = sft_trainer(tokenizer, tmp_path_factory.mktemp("sft"))
    logs = train_logs(trainer)
    assert all(metric in log for log in logs for metric in SFT_LOGITS_METRICS)  # what TRL logs unpatched
    return logs, trainer.evaluate()


def test_sft_trainer_fused_loss_drops_logits_metrics_with_one_warning(tokenizer, tmp_path, kernel_calls, sft_reference):
    expected, expected_eval = sft_reference
    trainer, model = sft_trainer(tokenizer, tmp_path)
    widths = head_widths(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ff.apply_kernels(trainer)
        logs = train_logs(trainer)
        evaluation = trainer.evaluate()
    about_metrics = [str(w.message) for w in caught if "mean_token_accuracy" in str(w.message)]
    assert len(about_metrics) == 1 and "entropy" in about_metrics[0], about_metrics

    assert "fused_linear_cross_entropy" in report.patched_kernels(), report
    assert all(kernel_calls[k] > 0 for k in LAYER_KERNELS), kernel_calls
    assert kernel_calls["fused_linear_cross_entropy"] == 2 * 2  # every training micro-batch, nothing else
    assert widths and set(widths) == {0}
    assert_logs_match(logs, expected, ("loss", "grad_norm", "num_tokens"))
    assert not any(metric in log for log in logs for metric in SFT_LOGITS_METRICS), logs
    # Evaluation keeps TRL's own path, metrics included.
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"):
        assert evaluation[key] == pytest.approx(expected_eval[key], rel=RTOL, abs=1e-6), key


def test_sft_trainer_with_a_peft_config_trains_lora_on_every_kernel(tokenizer, tmp_path, kernel_calls):
    """SFTTrainer(peft_config=LoRA): the trainer's PeftModel gets every kernel, the fused LoRA linears and the
    fused loss; loss and grad norm as TRL + peft unpatched."""
    peft = pytest.importorskip("peft")

    def build():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        return sft_trainer(tokenizer, tmp_path, peft_config=config, learning_rate=1e-2)[0]

    expected = train_logs(build())
    trainer = build()
    assert type(trainer.model).__name__.startswith("PeftModel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = ff.apply_kernels(trainer)
        logs = train_logs(trainer)
    assert {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy", "lora"} <= set(report.patched_kernels())
    assert kernel_calls["fused_linear_cross_entropy"] == 2 * 2
    assert_logs_match(logs, expected, ("loss", "grad_norm"))


def test_sft_trainer_without_fused_loss_keeps_logits_metrics(tokenizer, tmp_path, kernel_calls, sft_reference):
    expected, _ = sft_reference
    trainer, _ = sft_trainer(tokenizer, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ff.apply_kernels(trainer, fused_linear_cross_entropy=False)
        logs = train_logs(trainer)
    assert not [w for w in caught if "fuseforge" in str(w.message)]
    assert report.patched_kernels() == ["rms_norm", "rope", "swiglu"]
    assert all(kernel_calls[k] > 0 for k in LAYER_KERNELS) and kernel_calls["fused_linear_cross_entropy"] == 0
    assert_logs_match(logs, expected, ("loss", "grad_norm", "num_tokens", *SFT_LOGITS_METRICS))


def test_sft_trainer_moe_router_loss_as_trl_adds_it(tokenizer, tmp_path, kernel_calls):
    """Mixtral: SFTTrainer weights the router loss with its own coefficient, spread over accumulation steps."""

    def run(patch: bool):
        torch.manual_seed(0)
        config = transformers.MixtralConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=len(tokenizer),
            num_local_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.5,  # the model's own; SFTConfig's below differs
            pad_token_id=tokenizer.pad_token_id,
        )
        args = trl.SFTConfig(
            **common_args(tmp_path, gradient_accumulation_steps=2, max_length=32, router_aux_loss_coef=0.3)
        )
        trainer = trl.SFTTrainer(
            model=transformers.MixtralForCausalLM(config),
            args=args,
            train_dataset=datasets.Dataset.from_dict({"text": SFT_TEXTS * 2}),
            processing_class=tokenizer,
        )
        if patch:
            with pytest.warns(UserWarning, match="mean_token_accuracy"):
                assert "fused_linear_cross_entropy" in ff.apply_kernels(trainer).patched_kernels()
        return train_logs(trainer)

    expected = run(patch=False)
    logs = run(patch=True)
    assert kernel_calls["fused_linear_cross_entropy"] == 2 * 2 and kernel_calls["swiglu"] > 0
    assert_logs_match(logs, expected, ("loss", "grad_norm", "aux_loss", "num_tokens"))


def test_sft_trainer_options_needing_logits_keep_trl_loss(tokenizer, tmp_path):
    trainer, _ = sft_trainer(tokenizer, tmp_path, loss_type="dft")
    off = r"fused linear cross-entropy is off for SFTTrainer's model: .*loss_type='dft'"
    with pytest.warns(UserWarning, match=off):
        report = ff.apply_kernels(trainer)
    assert "fused_linear_cross_entropy" not in report.patched_kernels() and "compute_loss" not in trainer.__dict__


def test_sft_trainer_unpatch_and_repeat(tokenizer, tmp_path):
    """The model may have been patched before the trainer was built; unpatch(trainer) undoes all of it."""
    model = tiny_llama(tokenizer)
    ff.apply_kernels(model)  # the old recipe: patch first, then build the trainer (TRL wraps our forward)
    args = trl.SFTConfig(**common_args(tmp_path, max_length=32))
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"text": SFT_TEXTS}),
        processing_class=tokenizer,
    )
    trl_forward = model.__dict__["forward"]
    assert "fused_lm_head" in inspect.signature(trl_forward, follow_wrapped=False).parameters

    with pytest.warns(UserWarning, match="mean_token_accuracy"):
        report = ff.apply_kernels(trainer)
    assert ff.get_patch_report(trainer) is report and ff.is_patched(model)
    assert getattr(model.forward, "_fuseforge_fused_forward", False) and "compute_loss" in trainer.__dict__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ff.apply_kernels(trainer) is report  # same options: nothing to do, no second warning

    assert ff.unpatch(trainer) and not ff.unpatch(trainer)
    assert model.__dict__["forward"] is trl_forward  # TRL's fused LM head is back
    assert "compute_loss" not in trainer.__dict__ and not ff.is_patched(model)
    assert ff.get_patch_report(trainer) is None


def test_apply_kernels_names_what_it_cannot_patch(tokenizer, tmp_path):
    with pytest.raises(TypeError, match=r"nn.Module or an nn.Module class, got object .*transformers.Trainer"):
        ff.apply_kernels(object())
    trainer = transformers.Trainer(
        model=tiny_llama(tokenizer), args=transformers.TrainingArguments(**common_args(tmp_path))
    )
    trainer.model = None
    with pytest.raises(ValueError, match=r"Trainer.model is NoneType, not an nn.Module"):
        ff.apply_kernels(trainer)


# --- TRL trainers that compute their loss themselves -------------------------------------------

PROMPTS = ["the cat", "hello world", "a b c", "one two"]


def gkd_trainer(tokenizer, tmp_path):
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    model = tiny_llama(tokenizer)
    teacher = copy.deepcopy(model)
    torch.nn.init.normal_(teacher.lm_head.weight, std=0.05)  # a teacher that differs: a non-zero loss
    chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": p[::-1]}] for p in PROMPTS]
    args = GKDConfig(**common_args(tmp_path, max_length=32, lmbda=0.0))  # lmbda=0: no on-policy generation
    return GKDTrainer(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"messages": chats}),
        processing_class=tokenizer,
    )


# DPOTrainer's, KTOTrainer's and GRPOTrainer's losses run through fused losses: tests/hf/test_trainer_fused_losses.py.
OWN_LOSS_TRAINERS = {
    "GKDTrainer": (gkd_trainer, "teacher_model"),
}


@pytest.mark.parametrize("name", list(OWN_LOSS_TRAINERS))
def test_trainer_with_own_loss_keeps_layer_kernels_only(name, tokenizer, tmp_path, kernel_calls):
    build, frozen = OWN_LOSS_TRAINERS[name]
    expected = train_logs(build(tokenizer, tmp_path))
    assert not kernel_calls

    trainer = build(tokenizer, tmp_path)
    assert type(trainer).__name__ == name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ff.apply_kernels(trainer)
        logs = train_logs(trainer)
    assert not [w for w in caught if "fuseforge" in str(w.message)]  # by design, not a problem: no warning
    assert report.patched_kernels() == ["rms_norm", "rope", "swiglu"]
    notes = fused_loss_notes(report)
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"fused_linear_cross_entropy: off for {name}: {name} computes its loss itself")
    if frozen:
        assert ff.is_patched(getattr(trainer, frozen)) and any(note.startswith(frozen) for note in report.notes)
    assert "compute_loss" not in trainer.__dict__
    assert all(kernel_calls[k] > 0 for k in LAYER_KERNELS), kernel_calls
    assert kernel_calls["fused_linear_cross_entropy"] == 0
    # Every logged number (loss, rewards, log-probs, entropy, ...) is what the unpatched trainer logs.
    numeric = [k for k, v in expected[0].items() if isinstance(v, float) and k not in ("step_time", "epoch")]
    assert {"loss", "grad_norm"} <= set(numeric)
    assert_logs_match(logs, expected, numeric)
