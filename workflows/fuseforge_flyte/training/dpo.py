"""DPO in the engine: TRL's DPOTrainer, reference log-probs scored once by a separate step, the fused loss.

Two steps, each a function of plain values, runnable without Flyte (the tasks in posttrain/tasks.py wrap them):

- `score_reference`: TRL's own tokenization of the prepared pairs (chat template, prompt/completion split,
  truncation rule) and TRL's own reference pass (`precompute_ref_log_probs`), run with the reference model
  as the trainer's model. The tokenized pairs and their `ref_chosen_logps` / `ref_rejected_logps` are saved.
  The Flyte task is cached on the prepared data, the reference model and `max_length`, so it runs once per
  dataset and reference model however many policies train on it.
- `train_dpo`: the policy, on those scored pairs. `ScoredDPOTrainer` skips TRL's tokenization and
  reference pass when their columns are present, so the policy's pods never load the reference model;
  `apply_kernels(trainer)` then trains on fuseforge's fused linear DPO loss (no [tokens, vocab] logits).

Both steps build the model the same way (fuseforge_flyte.training.models.build_model: a preset with seeded
init, an HF id or a model directory), so with the reference equal to the policy's start the first step's
sigmoid loss is exactly log 2.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional

from fuseforge_flyte.console import ensure_console_logging
from fuseforge_flyte.data.preferences import load_prepared

log = logging.getLogger("fuseforge.training")

TOKENIZED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
REFERENCE_FILE = "reference.json"  # what scored the pairs: the reference model, max_length, mean log-probs
# TRL 1.16 DPOTrainer loss types fuseforge's fused DPO loss computes (others train on TRL's own loss, warned)
FUSED_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
LOSS_TYPES = FUSED_LOSS_TYPES + ("exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
                                 "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DPO {name} must be a positive integer, got {value!r}")


@dataclass
class DPOSettings:
    """One DPO run. Checked once, where it enters (`validate`), before any model is loaded."""

    model: str
    tokenizer: str = ""  # "" = the model's own (a preset's is builtin:tiny-bpe)
    reference_model: str = ""  # "" = the policy's starting model
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    max_length: int = 512  # prompt + completion tokens; longer pairs are cut (TRL's keep_start)
    steps: int = 100
    batch_size: int = 4  # pairs per worker per micro-batch
    grad_accum: int = 1
    lr: float = 5e-7
    warmup_steps: int = 0
    eval_every: int = 0  # 0 = evaluate only at the end (when the data has an eval split)
    seed: int = 0
    kernels: bool = True
    loss_chunk_size: int = 0  # 0 = fuseforge's default
    # LoRA (training/lora.py): the policy trains peft adapters; the output model is the adapter directory
    lora: bool = False
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: str = ""  # "": the family's attention and MLP projections
    qlora: bool = False  # NF4 (torchao) base weights; turns lora on
    extra: Dict[str, Any] = field(default_factory=dict)  # further DPOConfig fields, passed as given

    def validate(self) -> "DPOSettings":
        if not self.model:
            raise ValueError("DPO model is empty: name a preset, a model directory or an HF id")
        if not (isinstance(self.beta, (int, float)) and self.beta > 0):
            raise ValueError(f"DPO beta must be > 0 (the KL penalty's strength), got {self.beta!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"DPO loss_type {self.loss_type!r} is not one of TRL's: {list(LOSS_TYPES)}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"DPO label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        for name in ("max_length", "steps", "batch_size", "grad_accum"):
            _positive_int(name, getattr(self, name))
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"DPO lr must be > 0, got {self.lr!r}")
        for name in ("warmup_steps", "eval_every", "loss_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DPO {name} must be an integer >= 0, got {value!r}")
        from fuseforge_flyte.training import lora

        lora.check(self, "DPO")
        return self

    @property
    def reference(self) -> str:
        return self.reference_model or self.model


def _scored_trainer_class():
    from trl import DPOTrainer

    class ScoredDPOTrainer(DPOTrainer):
        """DPOTrainer that takes pairs as `score_reference` saved them: already tokenized, already scored.

        Data without those columns goes through TRL's own tokenization and reference pass as usual.
        """

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if set(TOKENIZED_COLUMNS) <= set(dataset.column_names):
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def _precompute_ref_logps(self, dataset, name, batch_size):
            if set(REFERENCE_COLUMNS) <= set(dataset.column_names):
                return dataset
            return super()._precompute_ref_logps(dataset, name, batch_size)

    return ScoredDPOTrainer


def dpo_config(settings: DPOSettings, output_dir: str, *, has_eval: bool):
    """TRL's DPOConfig for `settings`: bf16 autocast over fp32 weights on a GPU, fp32 on the CPU."""
    import torch
    from trl import DPOConfig

    from fuseforge_flyte.training.optim import MIN_LR_RATIO

    cuda = torch.cuda.is_available()
    evaluate = dict(eval_strategy="steps", eval_steps=settings.eval_every) if has_eval and settings.eval_every \
        else {}
    return DPOConfig(
        output_dir=output_dir, max_steps=settings.steps, per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size, gradient_accumulation_steps=settings.grad_accum,
        learning_rate=settings.lr, warmup_steps=settings.warmup_steps,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO},  # optim.scheduler's
        beta=settings.beta, loss_type=[settings.loss_type], label_smoothing=settings.label_smoothing,
        max_length=settings.max_length, precompute_ref_log_probs=True, precompute_ref_batch_size=settings.batch_size,
        logging_steps=1, save_strategy="no", report_to=[], bf16=cuda, use_cpu=not cuda, seed=settings.seed,
        data_seed=settings.seed, dataloader_num_workers=0, ddp_find_unused_parameters=False, **evaluate,
        **settings.extra,
    )


def _tokenizer_and_model(name: str, settings: DPOSettings):
    import torch

    from fuseforge_flyte.data.tokenizer import load_tokenizer
    from fuseforge_flyte.training.models import build_model

    tokenizer = load_tokenizer(settings.tokenizer, settings.model)
    model = build_model(name, seed=settings.seed, device=torch.device("cpu"), vocab_size=len(tokenizer))
    return tokenizer, model


def _patch(trainer, settings: DPOSettings) -> List[str]:
    """apply_kernels(trainer) when kernels are on; the report's notes (they say which loss trains)."""
    if not settings.kernels:
        return ["kernels off: TRL's own DPO loss"]
    from fuseforge.transformers import apply_kernels  # in the worker: Triton's mode is decided by now

    return list(apply_kernels(trainer, loss_chunk_size=settings.loss_chunk_size or None).notes)


def _fused(notes: List[str]) -> bool:
    """Whether the report's notes say the trainer's training loss is fuseforge's fused DPO loss."""
    return any(note.startswith("trainer:") and "is fused_linear_dpo_loss" in note for note in notes)


def score_reference(settings: DPOSettings, data_dir: str, out_dir: str) -> Dict[str, Any]:
    """Tokenize the prepared pairs and add the reference model's log-probs; save them to `out_dir`."""
    import datasets

    settings.validate()
    data = load_prepared(data_dir)
    tokenizer, reference = _tokenizer_and_model(settings.reference, settings)
    if settings.kernels:  # TRL's reference pass runs in the trainer's __init__: patch the model before
        from fuseforge.transformers import apply_kernels

        apply_kernels(reference, fused_linear_cross_entropy=False)  # scoring needs the logits
    trainer = _scored_trainer_class()(
        model=reference, args=dpo_config(settings, tempfile.mkdtemp(prefix="fuseforge-ref-"),
                                         has_eval="eval" in data),
        train_dataset=data["train"], eval_dataset=data.get("eval"), processing_class=tokenizer)
    scored = {"train": trainer.train_dataset}
    if trainer.eval_dataset is not None:
        scored["eval"] = trainer.eval_dataset
    keep = list(TOKENIZED_COLUMNS + REFERENCE_COLUMNS)
    scored = datasets.DatasetDict({name: part.select_columns(keep) for name, part in scored.items()})
    scored.save_to_disk(out_dir)
    summary = {"reference_model": settings.reference, "max_length": settings.max_length,
               "rows": {name: len(part) for name, part in scored.items()},
               "mean_ref_chosen_logps": float(sum(scored["train"]["ref_chosen_logps"]) / len(scored["train"])),
               "mean_ref_rejected_logps": float(sum(scored["train"]["ref_rejected_logps"]) / len(scored["train"]))}
    with open(os.path.join(out_dir, REFERENCE_FILE), "w", encoding="utf-8") as handle:
        json.dump(summary, handle)
    return summary


def check_scored(data_dir: str, settings: DPOSettings) -> Dict[str, Any]:
    """The reference summary of scored data, after checking it was scored for this run's max_length."""
    path = os.path.join(data_dir, REFERENCE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{data_dir!r} holds no reference log-probs ({REFERENCE_FILE} missing): pass the output "
                         "of the reference_logps task")
    with open(path, encoding="utf-8") as handle:
        summary = json.load(handle)
    if summary["max_length"] != settings.max_length:
        raise ValueError(f"the reference log-probs were scored with max_length={summary['max_length']}, this run "
                         f"uses max_length={settings.max_length}: score again with the same max_length")
    return summary


@dataclass
class PreferenceMetrics:
    """What DPO adds to the training metrics: how often, and by how much, the policy prefers the chosen answer
    (implicit rewards beta * (log pi - log pi_ref)), per logged step and on the eval split."""

    loss_type: str = ""
    reference_model: str = ""
    fused_loss: bool = False  # the training loss ran on fuseforge's fused DPO loss (else TRL's own; see notes)
    notes: List[str] = field(default_factory=list)  # the trainer patch report's notes
    reward_accuracy: Optional[float] = None  # mean over the last 10% of the logged steps (at least one)
    reward_margin: Optional[float] = None
    accuracy_curve: List[float] = field(default_factory=list)
    margin_curve: List[float] = field(default_factory=list)
    eval_reward_accuracy: Optional[float] = None
    eval_reward_margin: Optional[float] = None

    def __str__(self) -> str:
        """A short summary (what `pyflyte run` prints); the curves stay in the fields and the Deck."""
        def number(value: Optional[float], digits: int) -> str:
            return "n/a" if value is None else f"{value:.{digits}f}"

        text = (f"reward accuracy {number(self.reward_accuracy, 2)}   reward margin {number(self.reward_margin, 4)}")
        if self.eval_reward_accuracy is not None:
            text += (f"   eval reward accuracy {number(self.eval_reward_accuracy, 2)}   eval reward margin "
                     f"{number(self.eval_reward_margin, 4)}")
        loss = f"{self.loss_type} ({'fused' if self.fused_loss else 'TRL'} loss)"
        return f"{text}   loss {loss}   reference {self.reference_model}"

    __repr__ = __str__  # pyflyte prints outputs (and tuples of them) through repr


def _tail_mean(curve: List[float]) -> Optional[float]:
    tail = curve[-max(1, len(curve) // 10):]
    return sum(tail) / len(tail) if tail else None


def preference_callback() -> "PreferenceLog":
    """A PreferenceLog that is a transformers TrainerCallback too. transformers' trainer modules are imported here,
    not with this module: they take seconds, and loading the workflows for pyflyte does not need them."""
    from transformers import TrainerCallback

    return type("PreferenceLogCallback", (PreferenceLog, TrainerCallback), {})()


class PreferenceLog:
    """Collects DPOTrainer's logged reward accuracy and margin, per step and at eval (see preference_callback)."""

    def __init__(self):
        self.accuracy: List[float] = []
        self.margin: List[float] = []
        self.eval_accuracy: Optional[float] = None
        self.eval_margin: Optional[float] = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "rewards/accuracies" in logs:
            self.accuracy.append(float(logs["rewards/accuracies"]))
            self.margin.append(float(logs.get("rewards/margins", float("nan"))))
            if state.is_world_process_zero:
                self._log_step(args, state, logs)
        if "eval_rewards/accuracies" in logs:
            self.eval_accuracy = float(logs["eval_rewards/accuracies"])
            self.eval_margin = float(logs.get("eval_rewards/margins", float("nan")))
            if state.is_world_process_zero:
                log.info("eval after step %d: loss %.4f reward accuracy %.2f margin %.4f", state.global_step,
                         float(logs.get("eval_loss", float("nan"))), self.eval_accuracy, self.eval_margin)

    def _log_step(self, args, state, logs) -> None:
        """The engine's progress line, for DPO (instead of the Trainer's printed dict)."""
        import time

        import torch

        from fuseforge_flyte.training.metrics import peak_memory_gib

        now, tokens = time.perf_counter(), float(state.num_input_tokens_seen or 0)
        last_time, last_tokens = getattr(self, "_last", (None, 0.0))
        rate = "" if last_time is None or now <= last_time else f" | {(tokens - last_tokens) / (now - last_time):,.0f} tok/s"
        self._last = (now, tokens)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        log.info("step %d/%d loss %.4f reward accuracy %.2f margin %.4f lr %.3g%s | mem %.2f GiB", state.global_step,
                 state.max_steps, float(logs.get("loss", float("nan"))), self.accuracy[-1], self.margin[-1],
                 float(logs.get("learning_rate", float("nan"))), rate, peak_memory_gib(device))

    def summary(self, settings: DPOSettings, notes: List[str]) -> PreferenceMetrics:
        return PreferenceMetrics(loss_type=settings.loss_type, reference_model=settings.reference,
                                 fused_loss=_fused(notes), notes=notes,
                                 reward_accuracy=_tail_mean(self.accuracy), reward_margin=_tail_mean(self.margin),
                                 accuracy_curve=list(self.accuracy), margin_curve=list(self.margin),
                                 eval_reward_accuracy=self.eval_accuracy, eval_reward_margin=self.eval_margin)


def dpo_trainer(settings: DPOSettings, data_dir: str, *, callbacks=()):
    """(the policy's patched ScoredDPOTrainer on the scored pairs, its tokenizer, the patch report's notes)."""
    settings.validate()
    check_scored(data_dir, settings)
    data = load_prepared(data_dir)
    tokenizer, model = _tokenizer_and_model(settings.model, settings)
    from fuseforge_flyte.training import lora

    if lora.lora_on(settings):  # a LoRA policy; the reference log-probs were scored on the base (precomputed)
        model = lora.attach(model, replace(settings, qlora=False), frozen_dtype=None, log_it=True)
    trainer = _scored_trainer_class()(
        model=model, args=dpo_config(settings, tempfile.mkdtemp(prefix="fuseforge-dpo-"), has_eval="eval" in data),
        train_dataset=data["train"], eval_dataset=data.get("eval"), processing_class=tokenizer,
        callbacks=list(callbacks))
    if settings.qlora:  # after TRL hashed the model's state (it cannot read NF4 tensors)
        from fuseforge.transformers.lora import quantize_base_nf4

        quantize_base_nf4(trainer.model)
    _without_printed_dicts(trainer)
    return trainer, tokenizer, _patch(trainer, settings)


def _without_printed_dicts(trainer) -> None:
    """The Trainer prints each log as a raw dict (PrinterCallback, ProgressCallback); PreferenceLog logs the step
    lines instead."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)


def train_dpo(settings: DPOSettings, data_dir: str, output_dir: str, *, callbacks=()) -> PreferenceMetrics:
    """Train the policy on scored pairs; rank 0 saves it (and the tokenizer) to `output_dir`.

    Returns the PreferenceMetrics on every rank. `callbacks` go to the trainer before the preference log: the
    caller measures the run as any Trainer's (measure.FuseforgeMetricsCallback), which the engine cannot import.
    """
    preference = preference_callback()
    trainer, tokenizer, notes = dpo_trainer(settings, data_dir, callbacks=[*callbacks, preference])
    ensure_console_logging()
    trainer.train()
    if trainer.eval_dataset is not None:
        trainer.evaluate()
    shutil.rmtree(trainer.args.output_dir, ignore_errors=True)  # the Trainer's scratch directory (nothing saved)
    if trainer.is_world_process_zero():
        trainer.save_model(output_dir)
        tokenizer.save_pretrained(output_dir)
        with open(os.path.join(output_dir, "fuseforge_dpo.json"), "w", encoding="utf-8") as handle:
            json.dump({k: v for k, v in asdict(settings).items() if k != "extra"}, handle)
    return preference.summary(settings, notes)
