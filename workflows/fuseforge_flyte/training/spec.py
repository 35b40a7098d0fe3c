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

    # a built-in preset (random init), an HF model directory or fsspec URI of one (e.g. a previous run's
    # output, to continue training), a path to a config.json (random init), or an HF model id
    model: str = "tiny-llama"
    # A directory prepared by fuseforge_flyte.data (the Flyte workflows pass the preparation task's output);
    # or what fuseforge_flyte.data reads (an HF hub id, a local/fsspec .json/.jsonl/.parquet/.csv/.txt
    # file or folder, "builtin:chat", "builtin:text"), then prepared by the engine itself; or one of the
    # benchmark-only "bench:synthetic" / "bench:bytes" (no tokenizer, never for fine-tuning).
    dataset: str = "builtin:chat"
    dataset_config: str = ""  # HF hub dataset config name
    dataset_split: str = "train"
    data_format: str = "auto"  # "auto" | "text" | "messages" | "prompt_completion"
    tokenizer: str = ""  # "" = the model's own; or an HF id, a directory, an fsspec URI, "builtin:tiny-bpe"
    packing: bool = True  # pack examples into seq_len rows (no attention across them)
    eval_fraction: float = 0.0  # share of the examples held out for eval
    eval_dataset: str = ""  # a separate eval dataset (exclusive with eval_fraction)
    eval_every: int = 0  # steps between evals (0: only at the end); needs eval data
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
    # settings a resume may find changed since the checkpoint, comma-separated (e.g. "lr,steps" to continue
    # training on a new schedule); any other difference stops the run. Names: see checkpoint.ALLOWABLE_CHANGES
    resume_allow_changes: str = ""
    nonfinite_policy: str = "raise"  # "raise" | "skip" on a non-finite loss
    log_every: int = 1
    # where rank 0 writes the trained model as a Hugging Face directory at the end; None = not saved
    output_dir: Optional[str] = None

    def data_spec(self):
        """The fuseforge_flyte.data.DataSpec this run's dataset is prepared with."""
        from fuseforge_flyte.data.spec import DataSpec

        return DataSpec(dataset=self.dataset, model=self.model, seq_len=self.seq_len, tokenizer=self.tokenizer,
                        data_format=self.data_format, dataset_config=self.dataset_config,
                        dataset_split=self.dataset_split, eval_fraction=self.eval_fraction,
                        eval_dataset=self.eval_dataset, packing=self.packing, seed=self.seed)

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
    # held-out loss per token and its exp; None when the run had no eval data
    eval_loss: Optional[float] = None
    eval_perplexity: Optional[float] = None
    eval_loss_curve: List[float] = field(default_factory=list)
    eval_steps: List[int] = field(default_factory=list)  # the step after which each eval_loss_curve entry was taken
    # time the steps spent getting their batches onto the device, as a share of step time (the GPU must not starve)
    data_wait_fraction: float = 0.0
    loss_tokens_per_step: float = 0.0  # tokens that carry a loss, per step on average (packing and masking)
    dataset: str = ""  # what the run trained on (the prepared data's source)
    model_dir: str = ""  # where the trained model was written ("" when not saved)

    def __str__(self) -> str:
        """A short summary (what `pyflyte run` prints); the fields hold everything."""
        mfu = f"{self.mfu * 100:.1f} %" if self.mfu else "n/a"
        rows = [
            f"{self.model} on {self.dataset or '?'} · {self.strategy} · {self.world_size} x {self.device} · "
            f"{'fuseforge kernels' if self.kernels else 'no kernels'} · {self.dtype}",
            f"  steps {self.steps}   tokens/s {self.tokens_per_s:,.0f}   MFU {mfu}   peak memory "
            f"{self.peak_memory_gib:.2f} GiB   step p50 {self.step_time_p50_s * 1e3:.1f} ms   "
            f"data wait {self.data_wait_fraction * 100:.2f} %",
            f"  final loss {self.final_loss:.4f}" + (f"   eval loss {self.eval_loss:.4f} (perplexity "
                                                      f"{self.eval_perplexity:.2f})" if self.eval_loss is not None else ""),
        ]
        if self.model_dir:
            rows.append(f"  model: {self.model_dir}")
        return "\n".join(rows)

    __repr__ = __str__  # pyflyte prints outputs (and tuples of them) through repr
