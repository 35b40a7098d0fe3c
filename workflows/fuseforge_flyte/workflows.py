"""Flyte workflows: `train` (one run) and `compare` (the same run with and without the kernels).

Both prepare the data first on a CPU pod (cached: a second run with the same dataset contents,
tokenizer, format and seq_len reuses the shards), then train on the GPU pods.
Input defaults come from platform.toml's [training] and [checkpoint] tables (read at import).
Run locally:   pyflyte run workflows/train.py train --model tiny-llama --steps 20
On a cluster:  pyflyte run --remote workflows/train.py train --model meta-llama/Llama-3.2-1B --dataset ./chat.jsonl
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

from flytekit import workflow

from flytekit.core.promise import Promise
from flytekit.types.directory import FlyteDirectory

from fuseforge_flyte.comparison import Comparison
from fuseforge_flyte.training.spec import TrainMetrics
from fuseforge_flyte.tasks import (DEFAULTS, DataSource, TrainOutput, fingerprint_data, prepare_data,
                                   sample_model, summarize_comparison, train_model)

# Questions in the style of builtin:chat, for the demo's trained model to answer.
DEMO_PROMPTS = ["What is the capital of France?", "How many letters are in the word apple?", "Hi there."]


def _prepared(dataset, model, tokenizer, data_format, dataset_config, dataset_split, seq_len, packing,
              eval_fraction, eval_dataset, seed) -> Promise:
    """The fingerprint task, then the cached preparation keyed on it: the shards as a FlyteDirectory."""
    fingerprint = fingerprint_data(dataset=dataset, eval_dataset=eval_dataset, tokenizer=tokenizer, model=model)
    return prepare_data(dataset=dataset, fingerprint=fingerprint, model=model, tokenizer=tokenizer,
                        data_format=data_format, dataset_config=dataset_config, dataset_split=dataset_split,
                        seq_len=seq_len, packing=packing, eval_fraction=eval_fraction, eval_dataset=eval_dataset,
                        seed=seed)


@workflow
def train(
    model: str = DEFAULTS.model,
    dataset: DataSource = DEFAULTS.dataset,
    dataset_config: str = DEFAULTS.dataset_config,
    dataset_split: str = DEFAULTS.dataset_split,
    data_format: str = DEFAULTS.data_format,
    tokenizer: str = DEFAULTS.tokenizer,
    packing: bool = DEFAULTS.packing,
    eval_fraction: float = DEFAULTS.eval_fraction,
    eval_dataset: str = DEFAULTS.eval_dataset,
    eval_every: int = DEFAULTS.eval_every,
    steps: int = DEFAULTS.steps,
    batch_size: int = DEFAULTS.batch_size,
    seq_len: int = DEFAULTS.seq_len,
    grad_accum: int = DEFAULTS.grad_accum,
    lr: float = DEFAULTS.lr,
    weight_decay: float = DEFAULTS.weight_decay,
    warmup_steps: int = DEFAULTS.warmup_steps,
    grad_clip: float = DEFAULTS.grad_clip,
    kernels: bool = DEFAULTS.kernels,
    loss_chunk_size: int = DEFAULTS.loss_chunk_size,
    strategy: str = DEFAULTS.strategy,
    zero_stage: int = DEFAULTS.zero_stage,
    offload: bool = DEFAULTS.offload,
    dtype: str = DEFAULTS.dtype,
    gradient_checkpointing: bool = DEFAULTS.gradient_checkpointing,
    seed: int = DEFAULTS.seed,
    checkpoint_dir: Optional[str] = DEFAULTS.checkpoint_dir,
    checkpoint_every: int = DEFAULTS.checkpoint_every,
    keep_last: int = DEFAULTS.keep_last,
    resume_allow_changes: str = DEFAULTS.resume_allow_changes,
    nonfinite_policy: str = DEFAULTS.nonfinite_policy,
    log_every: int = DEFAULTS.log_every,
) -> TrainOutput:
    """Fine-tune or train a causal LM on a dataset (optionally with the fuseforge kernels).

    Returns the throughput/memory/loss/eval metrics and the trained model as a Hugging Face directory.
    """
    data = _prepared(dataset, model, tokenizer, data_format, dataset_config, dataset_split, seq_len, packing,
                     eval_fraction, eval_dataset, seed)
    return train_model(
        data=data,
        model=model,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        grad_accum=grad_accum,
        lr=lr,
        weight_decay=weight_decay,
        warmup_steps=warmup_steps,
        grad_clip=grad_clip,
        kernels=kernels,
        loss_chunk_size=loss_chunk_size,
        strategy=strategy,
        zero_stage=zero_stage,
        offload=offload,
        dtype=dtype,
        gradient_checkpointing=gradient_checkpointing,
        seed=seed,
        eval_every=eval_every,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep_last=keep_last,
        resume_allow_changes=resume_allow_changes,
        nonfinite_policy=nonfinite_policy,
        log_every=log_every,
    )


@workflow
def compare(
    model: str = DEFAULTS.model,
    dataset: DataSource = DEFAULTS.dataset,
    dataset_config: str = DEFAULTS.dataset_config,
    dataset_split: str = DEFAULTS.dataset_split,
    data_format: str = DEFAULTS.data_format,
    tokenizer: str = DEFAULTS.tokenizer,
    packing: bool = DEFAULTS.packing,
    steps: int = DEFAULTS.steps,
    batch_size: int = DEFAULTS.batch_size,
    seq_len: int = DEFAULTS.seq_len,
    grad_accum: int = DEFAULTS.grad_accum,
    lr: float = DEFAULTS.lr,
    weight_decay: float = DEFAULTS.weight_decay,
    warmup_steps: int = DEFAULTS.warmup_steps,
    grad_clip: float = DEFAULTS.grad_clip,
    loss_chunk_size: int = DEFAULTS.loss_chunk_size,
    strategy: str = DEFAULTS.strategy,
    zero_stage: int = DEFAULTS.zero_stage,
    offload: bool = DEFAULTS.offload,
    dtype: str = DEFAULTS.dtype,
    gradient_checkpointing: bool = DEFAULTS.gradient_checkpointing,
    seed: int = DEFAULTS.seed,
    nonfinite_policy: str = DEFAULTS.nonfinite_policy,
    log_every: int = DEFAULTS.log_every,
) -> Comparison:
    """The same run (seed, data, model) with and without the kernels: throughput gain %, memory reduction %.

    No checkpointing: both runs must start from step 0 for the comparison to mean anything.
    """
    data = _prepared(dataset, model, tokenizer, data_format, dataset_config, dataset_split, seq_len, packing,
                     0.0, "", seed)
    shared = dict(
        data=data,
        model=model,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        grad_accum=grad_accum,
        lr=lr,
        weight_decay=weight_decay,
        warmup_steps=warmup_steps,
        grad_clip=grad_clip,
        loss_chunk_size=loss_chunk_size,  # used by the run with kernels only
        strategy=strategy,
        zero_stage=zero_stage,
        offload=offload,
        dtype=dtype,
        gradient_checkpointing=gradient_checkpointing,
        seed=seed,
        checkpoint_dir=None,
        checkpoint_every=0,
        nonfinite_policy=nonfinite_policy,
        log_every=log_every,
    )
    fused = train_model(kernels=True, **shared).with_overrides(name="train-with-kernels")
    baseline = train_model(kernels=False, **shared).with_overrides(name="train-without-kernels")
    return summarize_comparison(with_kernels=fused.metrics, without_kernels=baseline.metrics)


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
                eval_fraction=eval_fraction, eval_every=eval_every, kernels=kernels, dtype="fp32", warmup_steps=5)
    answers = sample_model(model=out.model, prompts=prompts)
    return DemoOutput(metrics=out.metrics, model=out.model, answers=answers)
