"""Flyte workflows: `train` (one run), `compare` (the same run with and without the kernels), `distill`
(a student trained toward a teacher), `dpo` (preference optimisation against a reference scored once) and
`demo`.

Both prepare the data first on a CPU pod (cached: a second run with the same dataset contents,
tokenizer, format and seq_len reuses the shards), then train on the GPU pods.
Input defaults come from platform.toml's [training] and [checkpoint] tables (read at import).
Run locally:   pyflyte run workflows/train.py train --model tiny-llama --steps 20
On a cluster:  pyflyte run --remote workflows/train.py train --model meta-llama/Llama-3.2-1B --dataset ./chat.jsonl
"""

from __future__ import annotations

from typing import Any, List, NamedTuple

from flytekit import workflow

from flytekit.core.promise import Promise
from flytekit.types.directory import FlyteDirectory

from fuseforge_flyte import user_errors
from fuseforge_flyte.comparison import Comparison
from fuseforge_flyte.inputs import Dtype, summary_only, training_inputs
from fuseforge_flyte.posttrain.tasks import (DPOLossType, DPOOutput, dpo_train, prepare_preference_data,
                                             reference_logps)
from fuseforge_flyte.sampling import Samples
from fuseforge_flyte.training.dpo import DPOSettings
from fuseforge_flyte.training.spec import CHECKPOINT_OFF, TrainMetrics
from fuseforge_flyte.tasks import (DEFAULTS, DataSource, TrainOutput, fingerprint_data, prepare_data,
                                   sample_model, summarize_comparison, train_model)

# Questions of builtin:chat's kinds, for the demo's trained model to answer, with what a right answer says.
DEMO_PROMPTS = ["What is the capital of France?", "How many letters are in the word 'planet'?", "Hi there."]
DEMO_EXPECTED = ["Paris", "6 letters", "What can I do for you?"]
# Long enough on a CPU (a few minutes, kernels through Triton's interpreter) for the tiny model to answer each
# question differently and mostly right: 100 steps of 8 packed rows (about 5 epochs), peak lr 6e-3.
DEMO_STEPS = 100
DEMO_LR = 6e-3


# The data options: they go to the preparation task (and travel on to training, recorded in its checkpoints).
DATA_INPUTS = ("model", "tokenizer", "data_format", "dataset_config", "dataset_split", "seq_len", "packing",
               "eval_fraction", "eval_dataset", "seed")


def _prepared(dataset, model, tokenizer, data_format, dataset_config, dataset_split, seq_len, packing,
              eval_fraction, eval_dataset, seed) -> Promise:
    """The fingerprint task, then the cached preparation keyed on it: the shards as a FlyteDirectory."""
    fingerprint = fingerprint_data(dataset=dataset, eval_dataset=eval_dataset, tokenizer=tokenizer, model=model)
    return prepare_data(dataset=dataset, fingerprint=fingerprint, model=model, tokenizer=tokenizer,
                        data_format=data_format, dataset_config=dataset_config, dataset_split=dataset_split,
                        seq_len=seq_len, packing=packing, eval_fraction=eval_fraction, eval_dataset=eval_dataset,
                        seed=seed)


@workflow
@training_inputs(DEFAULTS)
def train(dataset: DataSource = DEFAULTS.dataset, **settings: Any) -> TrainOutput:
    """Fine-tune or train a causal LM on a dataset (optionally with the fuseforge kernels).

    Returns the throughput/memory/loss/eval metrics and the trained model as a Hugging Face directory.

    :param dataset: what to train on: a Hugging Face hub dataset id, a local or fsspec .json/.jsonl/.parquet/
        .csv/.txt file or folder (uploaded by pyflyte run --remote), builtin:chat, builtin:text; or the
        benchmark-only bench:synthetic / bench:bytes
    """
    data = _prepared(dataset, **{name: settings[name] for name in DATA_INPUTS})
    return train_model(data=data, **settings)


@workflow
@training_inputs(DEFAULTS, exclude=("teacher",))
def distill(teacher: str, dataset: DataSource = DEFAULTS.dataset, **settings: Any) -> TrainOutput:
    """Distil a teacher into the student `model` on a dataset: the loss mixes cross-entropy with the JSD to the
    teacher's next-token distributions (distill_weight, distill_beta, distill_temperature), both LM heads
    fused (fused linear JSD: no [tokens, vocab] logits). Returns the student and its metrics.

    :param teacher: the model to distil: a preset, a Hugging Face id or model directory sharing the student's
        vocabulary (tokenizer)
    :param dataset: what to train on (as in train)
    """
    data = _prepared(dataset, **{name: settings[name] for name in DATA_INPUTS})
    return train_model(data=data, teacher=teacher, **settings)


# compare: both runs from step 0 (no checkpoints to resume from), no eval (it measures training).
NOT_COMPARED = ("kernels", "output_dir", "checkpoint_dir", "checkpoint_every", "keep_last", "resume_allow_changes",
                "resume_from", "allow_unsigned_checkpoints",
                "eval_fraction", "eval_dataset", "eval_every",
                "teacher", "distill_weight", "distill_beta", "distill_temperature")  # distillation needs kernels


@workflow
@training_inputs(DEFAULTS, exclude=NOT_COMPARED)
def compare(dataset: DataSource = DEFAULTS.dataset, **settings: Any) -> Comparison:
    """The same run (seed, data, model) with and without the kernels: throughput gain %, memory reduction %.

    No checkpointing: both runs must start from step 0 for the comparison to mean anything.

    :param dataset: what to train on (as in train)
    """
    data = _prepared(dataset, eval_fraction=0.0, eval_dataset="",
                     **{name: settings[name] for name in DATA_INPUTS if not name.startswith("eval_")})
    shared = dict(settings, data=data, checkpoint_dir=CHECKPOINT_OFF, checkpoint_every=0, output_dir="")
    fused = train_model(kernels=True, **shared).with_overrides(name="train-with-kernels")
    baseline = train_model(kernels=False, **shared).with_overrides(name="train-without-kernels")
    return summarize_comparison(with_kernels=fused.metrics, without_kernels=baseline.metrics)


DPO_DEFAULTS = DPOSettings(model="")


@workflow
def dpo(model: str, dataset: DataSource = "builtin:preferences", reference_model: str = "", tokenizer: str = "",
        dataset_config: str = "", dataset_split: str = "train", eval_fraction: float = 0.0,
        beta: float = DPO_DEFAULTS.beta, loss_type: DPOLossType = DPOLossType(DPO_DEFAULTS.loss_type),
        label_smoothing: float = DPO_DEFAULTS.label_smoothing, max_length: int = DPO_DEFAULTS.max_length,
        steps: int = DPO_DEFAULTS.steps, batch_size: int = DPO_DEFAULTS.batch_size,
        grad_accum: int = DPO_DEFAULTS.grad_accum, lr: float = DPO_DEFAULTS.lr,
        warmup_steps: int = DPO_DEFAULTS.warmup_steps, eval_every: int = DPO_DEFAULTS.eval_every, seed: int = 0,
        kernels: bool = True, loss_chunk_size: int = 0, lora: bool = DPO_DEFAULTS.lora,
        lora_rank: int = DPO_DEFAULTS.lora_rank, lora_alpha: float = DPO_DEFAULTS.lora_alpha,
        lora_dropout: float = DPO_DEFAULTS.lora_dropout, lora_target_modules: str = DPO_DEFAULTS.lora_target_modules,
        qlora: bool = DPO_DEFAULTS.qlora, output_dir: str = "") -> DPOOutput:
    """Direct preference optimisation of a causal LM on prompt/chosen/rejected pairs (TRL's DPOTrainer on
    fuseforge's fused DPO loss). The reference log-probs come from a cached task run once per dataset and
    reference model; returns the training and preference metrics and the trained model.

    :param model: the policy's starting model: an HF id, a model directory, or a preset such as tiny-llama
    :param dataset: pairs with chosen, rejected and optionally prompt columns (strings or chat messages): a hub
        id, a .jsonl/.json/.parquet/.csv file or folder, or builtin:preferences
    :param reference_model: the frozen reference ("" = the policy's starting model)
    :param tokenizer: "" = the model's own (a preset's is builtin:tiny-bpe); its chat template is applied
    :param dataset_config: the hub dataset's configuration name
    :param dataset_split: the split to read (slicing syntax allowed, e.g. train[:2000])
    :param eval_fraction: share of the pairs held out for evaluation (0 = none)
    :param beta: strength of the KL penalty toward the reference (> 0)
    :param loss_type: TRL's DPO loss; sigmoid, hinge, ipo and robust are fused
    :param label_smoothing: the robust loss's assumed label noise, in [0, 0.5)
    :param max_length: prompt + completion tokens per sequence; longer ones are cut at the end
    :param steps: optimizer steps to train
    :param batch_size: pairs per worker per micro-batch
    :param grad_accum: micro-batches per optimizer step
    :param lr: peak learning rate (cosine schedule after warmup_steps)
    :param warmup_steps: linear warmup steps
    :param eval_every: evaluate every this many steps (0 = only at the end; needs eval_fraction > 0)
    :param seed: data order and the initialisation of presets (policy and reference alike)
    :param kernels: fuseforge's kernels and fused DPO loss on
    :param loss_chunk_size: tokens per chunk of the fused loss (0 = fuseforge's default)
    :param lora: train LoRA adapters (peft) on the frozen policy; the returned model is the adapter directory
    :param lora_rank: the adapters' rank
    :param lora_alpha: the adapters' alpha (output scaled by alpha / rank)
    :param lora_dropout: dropout on the adapters' input
    :param lora_target_modules: linear layers to adapt, comma-separated ("" = attention and MLP projections)
    :param qlora: LoRA over NF4 (4-bit, torchao) base weights
    :param output_dir: where the trained policy (model/), metrics.json and settings.json go; empty: locally
        ./outputs/<model>-<UTC time>, on a cluster Flyte's store
    """
    fingerprint = fingerprint_data(dataset=dataset, eval_dataset="", tokenizer="", model="")
    pairs = prepare_preference_data(dataset=dataset, fingerprint=fingerprint, dataset_config=dataset_config,
                                    dataset_split=dataset_split, eval_fraction=eval_fraction, seed=seed)
    scored = reference_logps(data=pairs, model=model, reference_model=reference_model, tokenizer=tokenizer,
                             max_length=max_length, batch_size=batch_size, seed=seed, kernels=kernels)
    return dpo_train(data=scored, model=model, reference_model=reference_model, tokenizer=tokenizer, beta=beta,
                     loss_type=loss_type, label_smoothing=label_smoothing, max_length=max_length, steps=steps,
                     batch_size=batch_size, grad_accum=grad_accum, lr=lr, warmup_steps=warmup_steps,
                     eval_every=eval_every, seed=seed, kernels=kernels, loss_chunk_size=loss_chunk_size, lora=lora,
                     lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                     lora_target_modules=lora_target_modules, qlora=qlora, output_dir=output_dir)


summary_only(train, compare, distill, dpo)
user_errors.install_for_pyflyte()  # a user error ends a pyflyte run with one line (see user_errors.py)


class DemoOutput(NamedTuple):
    metrics: TrainMetrics
    model: FlyteDirectory
    samples: Samples  # each prompt beside its answer


@workflow
def demo(model: str = "tiny-llama", dataset: DataSource = "builtin:chat", steps: int = DEMO_STEPS, batch_size: int = 4,
         seq_len: int = 128, lr: float = DEMO_LR, eval_fraction: float = 0.1, eval_every: int = 25,
         kernels: bool = True, prompts: List[str] = DEMO_PROMPTS) -> DemoOutput:
    """The README's main job: a small supervised fine-tuning (chat data, BPE tokenizer, loss on the assistant
    turns only, packed, with eval), then the returned model loaded by plain transformers and asked questions."""
    out = train(model=model, dataset=dataset, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
                eval_fraction=eval_fraction, eval_every=eval_every, kernels=kernels, dtype=Dtype.FP32, warmup_steps=5)
    samples = sample_model(model=out.model, prompts=prompts)
    return DemoOutput(metrics=out.metrics, model=out.model, samples=samples)
