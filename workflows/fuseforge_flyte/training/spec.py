"""The contract between the Flyte tasks and the training engine: what to train, and what comes back.

Both are plain dataclasses so that Flyte can type them as task inputs/outputs and
so that the engine can be driven directly from Python or a CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class TrainSpec:
    """One training run. Defaults come from platform.toml's [training] table (see fuseforge_flyte.config)."""

    model: str = "tiny-llama"  # a built-in preset name, a path to an HF config.json, or an HF model id
    dataset: str = "builtin:synthetic"  # "builtin:synthetic", "builtin:text", or a path/URI to a text or jsonl file
    steps: int = 20
    batch_size: int = 4  # sequences per device per micro-batch
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    kernels: bool = True  # apply fuseforge kernels to the model
    # tokens per chunk of the fused loss head (kernels=True only; ignored without kernels, so `compare`
    # can share it); 0 = fuseforge's default. Bigger chunks: faster, higher peak memory.
    loss_chunk_size: int = 0
    strategy: str = "ddp"  # "ddp" | "fsdp" | "deepspeed"
    zero_stage: int = 2  # DeepSpeed ZeRO stage when strategy == "deepspeed"
    offload: bool = False  # DeepSpeed optimizer/param offload to CPU
    dtype: str = "bf16"  # "fp32" | "bf16" | "fp16" (CPU runs force fp32)
    gradient_checkpointing: bool = False
    seed: int = 0
    checkpoint_dir: Optional[str] = None  # local dir or fsspec URI; None disables checkpointing
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only at the end (needs checkpoint_dir)
    keep_last: int = 2
    nonfinite_policy: str = "raise"  # "raise" | "skip" on a non-finite loss
    log_every: int = 1

    def validate(self) -> "TrainSpec":
        """Raise ValueError/TypeError naming the first bad field; returns self (see training/validation.py)."""
        from fuseforge_flyte.training.validation import validate_spec

        validate_spec(self)
        return self


@dataclass
class TrainMetrics:
    """What a run returns (rank 0): throughput, memory and the loss curve."""

    model: str = ""
    kernels: bool = True
    strategy: str = "ddp"
    device: str = "cpu"
    world_size: int = 1
    steps: int = 0
    tokens_per_s: float = 0.0
    samples_per_s: float = 0.0
    mfu: float = 0.0  # model FLOPs utilisation, 0..1 (0 when the device's peak is unknown, e.g. CPU)
    peak_memory_gib: float = 0.0  # max allocated on the accelerator (process RSS on CPU)
    step_time_p50_s: float = 0.0
    step_time_p90_s: float = 0.0
    step_time_p99_s: float = 0.0
    final_loss: float = 0.0
    loss_curve: List[float] = field(default_factory=list)
    tokens_per_s_curve: List[float] = field(default_factory=list)
    memory_gib_curve: List[float] = field(default_factory=list)
    restarts: int = 0
    steps_redone: int = 0
    skipped_steps: int = 0
    resumed_from_step: int = 0
    dtype: str = "fp32"  # the precision actually used (CPU runs are fp32)
    num_params: int = 0
    flops_per_token: float = 0.0  # training FLOPs per token used for MFU (see training/models.py)
    tokens_per_step: int = 0  # global: world_size * grad_accum * batch_size * seq_len
    step_time_curve: List[float] = field(default_factory=list)
    kernels_patched: List[str] = field(default_factory=list)  # fuseforge kernels apply_kernels swapped in
