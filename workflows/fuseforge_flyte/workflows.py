"""Flyte workflows: `train` (one run) and `compare` (the same run with and without the kernels).

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

from fuseforge_flyte.comparison import Comparison
from fuseforge_flyte.inputs import Dtype, summary_only, training_inputs
from fuseforge_flyte.training.spec import CHECKPOINT_OFF, TrainMetrics
from fuseforge_flyte.tasks import (DEFAULTS, DataSource, TrainOutput, fingerprint_data, prepare_data,
                                   sample_model, summarize_comparison, train_model)

# Questions in the style of builtin:chat, for the demo's trained model to answer.
DEMO_PROMPTS = ["What is the capital of France?", "How many letters are in the word apple?", "Hi there."]


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


# compare: both runs from step 0 (no checkpoints to resume from), no eval (it measures training).
NOT_COMPARED = ("kernels", "checkpoint_dir", "checkpoint_every", "keep_last", "resume_allow_changes",
                "eval_fraction", "eval_dataset", "eval_every")


@workflow
@training_inputs(DEFAULTS, exclude=NOT_COMPARED)
def compare(dataset: DataSource = DEFAULTS.dataset, **settings: Any) -> Comparison:
    """The same run (seed, data, model) with and without the kernels: throughput gain %, memory reduction %.

    No checkpointing: both runs must start from step 0 for the comparison to mean anything.

    :param dataset: what to train on (as in train)
    """
    data = _prepared(dataset, eval_fraction=0.0, eval_dataset="",
                     **{name: settings[name] for name in DATA_INPUTS if not name.startswith("eval_")})
    shared = dict(settings, data=data, checkpoint_dir=CHECKPOINT_OFF, checkpoint_every=0)
    fused = train_model(kernels=True, **shared).with_overrides(name="train-with-kernels")
    baseline = train_model(kernels=False, **shared).with_overrides(name="train-without-kernels")
    return summarize_comparison(with_kernels=fused.metrics, without_kernels=baseline.metrics)


summary_only(train, compare)


class DemoOutput(NamedTuple):
    metrics: TrainMetrics
    model: FlyteDirectory
    answers: List[str]


@workflow
def demo(model: str = "tiny-llama", dataset: DataSource = "builtin:chat", steps: int = 60, batch_size: int = 4,
         seq_len: int = 128, lr: float = 3e-3, eval_fraction: float = 0.1, eval_every: int = 20,
         kernels: bool = True, prompts: List[str] = DEMO_PROMPTS) -> DemoOutput:
    """The README's main job: a small supervised fine-tuning (chat data, BPE tokenizer, loss on the assistant
    turns only, packed, with eval), then the returned model loaded by plain transformers and asked questions."""
    out = train(model=model, dataset=dataset, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
                eval_fraction=eval_fraction, eval_every=eval_every, kernels=kernels, dtype=Dtype.FP32, warmup_steps=5)
    answers = sample_model(model=out.model, prompts=prompts)
    return DemoOutput(metrics=out.metrics, model=out.model, answers=answers)
