"""Flyte workflows: `train` (one run) and `compare` (the same run with and without the kernels).

Input defaults come from platform.toml's [training] and [checkpoint] tables (read at import).
Run locally:   pyflyte run workflows/train.py train --model tiny-llama --steps 20
On a cluster:  pyflyte run --remote workflows/train.py train --model meta-llama/Llama-3.2-1B --steps 200
"""

from __future__ import annotations

from typing import Optional

from flytekit import workflow

from fuseforge_flyte.comparison import Comparison
from fuseforge_flyte.tasks import DEFAULTS, summarize_comparison, train_model
from fuseforge_flyte.training.spec import TrainMetrics


@workflow
def train(
    model: str = DEFAULTS.model,
    dataset: str = DEFAULTS.dataset,
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
    nonfinite_policy: str = DEFAULTS.nonfinite_policy,
    log_every: int = DEFAULTS.log_every,
) -> TrainMetrics:
    """Train a causal LM (optionally with the fuseforge kernels); returns throughput, memory and loss metrics."""
    return train_model(
        model=model,
        dataset=dataset,
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
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep_last=keep_last,
        nonfinite_policy=nonfinite_policy,
        log_every=log_every,
    )


@workflow
def compare(
    model: str = DEFAULTS.model,
    dataset: str = DEFAULTS.dataset,
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
    shared = dict(
        model=model,
        dataset=dataset,
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
    return summarize_comparison(with_kernels=fused, without_kernels=baseline)
