"""The contract between the Flyte tasks and the training engine: what to train, and what comes back.

Both are plain dataclasses so that Flyte can type them as task inputs/outputs and
so that the engine can be driven directly from Python or a CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from fuseforge_flyte.training.plan import Plan

CHECKPOINT_OFF = "off"  # checkpoint_dir value that turns checkpoints off, also where a default location exists


def _setting(default: Any, help: str) -> Any:
    """A TrainSpec field with its help text: the one description the CLI, the Flyte console and docs show."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainSpec:
    """One training run. Defaults come from platform.toml's [training] table (see fuseforge_flyte.config)."""

    model: str = _setting("tiny-llama", "a built-in preset (random init: tiny-llama, llama-1b, ...), a Hugging Face "
                          "model id, a local directory or fsspec URI of a Hugging Face model (e.g. a previous run's "
                          "output, to continue training) or a path to a config.json (random init)")
    dataset: str = _setting("builtin:chat", "what to train on: a directory prepared by fuseforge_flyte.data (the "
                            "workflows pass the preparation task's output), a Hugging Face hub dataset id, a local "
                            "or fsspec .json/.jsonl/.parquet/.csv/.txt file or folder, builtin:chat, builtin:text; "
                            "or the benchmark-only bench:synthetic / bench:bytes (no tokenizer)")
    dataset_config: str = _setting("", "the Hugging Face hub dataset's config name")
    dataset_split: str = _setting("train", "the dataset split to train on (slices such as train[:10%] allowed)")
    data_format: str = _setting("auto", "how rows become training text: auto (from the columns), text, messages "
                                "(chat; loss on assistant turns only) or prompt_completion (loss on completions)")
    tokenizer: str = _setting("", "empty for the model's own; or a Hugging Face id, a directory, an fsspec URI, "
                              "builtin:tiny-bpe")
    packing: bool = _setting(True, "pack examples into seq_len rows (attention never crosses examples)")
    eval_fraction: float = _setting(0.0, "share of the examples held out for evaluation (0 to 1)")
    eval_dataset: str = _setting("", "a separate evaluation dataset (instead of eval_fraction)")
    eval_every: int = _setting(0, "steps between evaluations; 0: only at the end (needs eval data)")
    steps: int = _setting(20, "optimizer steps to train")
    batch_size: int = _setting(4, "sequences per device per micro-batch")
    seq_len: int = _setting(128, "tokens per sequence")
    grad_accum: int = _setting(1, "micro-batches per optimizer step")
    lr: float = _setting(3e-4, "peak learning rate (AdamW; linear warm-up, then cosine decay)")
    weight_decay: float = _setting(0.0, "AdamW weight decay")
    warmup_steps: int = _setting(0, "steps of linear learning-rate warm-up")
    grad_clip: float = _setting(1.0, "max global gradient norm; 0 disables clipping")
    kernels: bool = _setting(True, "swap fuseforge's fused Triton kernels into the model")
    skip_kernels: str = _setting("", "comma-separated kernels to leave out when kernels is on: rms_norm, "
                                 "layer_norm, rope, swiglu, fused_linear_cross_entropy, lora")
    loss_chunk_size: int = _setting(0, "tokens per chunk of the fused loss head (with kernels); 0: fuseforge's "
                                    "default. Bigger chunks: faster, more peak memory")
    teacher: str = _setting("", "distill from this model (a preset, Hugging Face id or directory with the student's "
                            "vocabulary): the loss becomes (1 - distill_weight) * cross-entropy + distill_weight * "
                            "JSD to the teacher, through fused linear JSD (needs kernels); empty: no teacher")
    distill_weight: float = _setting(0.5, "with a teacher: the JSD's share of the loss, 0 to 1")
    distill_beta: float = _setting(0.5, "with a teacher: the generalized JSD's beta, 0 (forward KL, teacher || "
                                   "student) to 1 (reverse KL)")
    distill_temperature: float = _setting(1.0, "with a teacher: softmax temperature of both distributions in the JSD")
    lora: bool = _setting(False, "train LoRA adapters (peft) on the frozen model instead of every weight; the "
                          "output model is then the adapter directory (PEFT format)")
    lora_rank: int = _setting(16, "with lora: the adapters' rank r")
    lora_alpha: float = _setting(32.0, "with lora: the adapters' alpha (their output is scaled by alpha / rank)")
    lora_dropout: float = _setting(0.0, "with lora: dropout on the adapters' input, 0 to <1")
    lora_target_modules: str = _setting("", "with lora: comma-separated names of the linear layers to adapt (e.g. "
                                        "q_proj,v_proj) or all-linear; empty: the family's attention and MLP "
                                        "projections")
    qlora: bool = _setting(False, "LoRA over 4-bit NF4 base weights (torchao; turns lora on; strategy ddp)")
    lora_merge: bool = _setting(False, "with lora: the output model is the base with the adapters merged in (a "
                                "Hugging Face directory), the adapter directory inside it under adapter/")
    strategy: str = _setting("ddp", "data parallelism: ddp, fsdp (FSDP2, sharded) or deepspeed (ZeRO)")
    zero_stage: int = _setting(2, "DeepSpeed ZeRO stage (1, 2 or 3) when strategy is deepspeed")
    offload: bool = _setting(False, "DeepSpeed: offload optimizer state and parameters to CPU memory")
    dtype: str = _setting("bf16", "training precision on GPUs: bf16, fp16 or fp32 (CPU runs use fp32)")
    gradient_checkpointing: bool = _setting(False, "recompute activations in the backward pass to save memory")
    fp8: bool = _setting(False, "FP8 matmuls in the linear layers (torchao float8 training; not lm_head or MoE "
                         "routers): needs dtype bf16, a GPU of compute capability >= 8.9 (H100, H200, L40S...), "
                         "strategy ddp or fsdp, and the fuseforge[fp8] extra")
    compile: bool = _setting(False, "torch.compile each decoder layer (inductor) before wrapping the model; "
                             "strategy ddp or fsdp. The first steps are slower while it compiles")
    plan: str = _setting("auto", "auto: on GPUs, probe a few real micro-batches and train with the fastest layout "
                         "that fits in memory (micro-batch, grad_accum, activation checkpointing, loss chunk), "
                         "keeping the global batch batch_size x grad_accum x GPUs (strategy ddp; CPU runs: off); "
                         "off: use batch_size, grad_accum, gradient_checkpointing and loss_chunk_size as given")
    seed: int = _setting(0, "seed of the model's initialisation, the data order and dropout")
    checkpoint_dir: str = _setting("", "where checkpoints go: a local directory or fsspec URI (s3://, gs://, ...); "
                                   "empty: on a cluster, the task's own Flyte checkpoint (kept across retries, "
                                   "one node only), locally none; off: none")
    checkpoint_every: int = _setting(0, "steps between checkpoints; 0: only at the end and on preemption")
    keep_last: int = _setting(2, "checkpoints kept (older ones are deleted)")
    resume_from: str = _setting("", "a checkpoint folder or URI to resume from when it is not checkpoint_dir, e.g. "
                                "a read-only copy of good checkpoints: never written to, its checkpoints verified "
                                "like any; new checkpoints go to checkpoint_dir (off: none), whose newer ones a "
                                "restart prefers. Empty: checkpoint_dir only")
    resume_allow_changes: str = _setting("", "comma-separated settings a resume may find changed since the "
                                         "checkpoint (e.g. lr,steps to continue on a new schedule); any other "
                                         "difference stops the run")
    allow_unsigned_checkpoints: bool = _setting(False, "resume from checkpoints that are not signed with this "
                                                "run's checkpoint key (unsigned, or another key's) after an "
                                                "integrity check only, with a warning: whoever could write them "
                                                "can run code in the run. Off: they are refused")
    nonfinite_policy: str = _setting("raise", "on a non-finite loss: raise (stop) or skip (drop the step on every "
                                     "rank)")
    log_every: int = _setting(1, "steps between progress lines")
    output_dir: str = _setting("", "where the run's results go: the trained model (model/, Hugging Face format), "
                               "metrics.json and settings.json (the resolved settings); a local directory or "
                               "fsspec URI. Empty: a workflow run locally writes to ./outputs/<model>-<UTC time> "
                               "(printed at the end), on a cluster the model stays in Flyte's store; the engine "
                               "alone saves nothing")

    @property
    def checkpoint_location(self) -> Optional[str]:
        """The directory or URI this worker checkpoints to; None for none ("" reaches a worker only where the
        task found no default location, e.g. a local run)."""
        return None if self.checkpoint_dir in ("", CHECKPOINT_OFF) else self.checkpoint_dir

    @property
    def resume_location(self) -> Optional[str]:
        """resume_from, or None when it is empty or names checkpoint_dir itself."""
        return self.resume_from if self.resume_from and self.resume_from != self.checkpoint_location else None

    @property
    def checkpoints_off(self) -> bool:
        """checkpoint_dir turns checkpoints off altogether (CHECKPOINT_OFF)."""
        return self.checkpoint_dir == CHECKPOINT_OFF

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
    # model FLOPs utilisation, 0..1, against the device's peak for dtype (0 when unknown, e.g. CPU); with fp8
    # still the bf16 peak, so that fp8 and bf16 runs of a model compare (FP8 speed shows as a higher MFU)
    mfu: float = 0.0
    peak_memory_gib: float = 0.0  # max allocated on the accelerator (process RSS on CPU)
    step_time_p50_s: float = 0.0
    step_time_p90_s: float = 0.0
    step_time_p99_s: float = 0.0
    final_loss: float = 0.0
    loss_curve: List[float] = field(default_factory=list)
    tokens_per_s_curve: List[float] = field(default_factory=list)
    memory_gib_curve: List[float] = field(default_factory=list)
    restarts: int = 0  # torch elastic restarts of the worker group within this attempt
    attempt: int = 0  # the Flyte attempt that finished the run (0 = the first; a retry after a lost pod is 1)
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
    output_dir: str = ""  # the run's results: model/, metrics.json, settings.json ("" when not saved)
    fp8_linears: int = 0  # linear layers that computed in FP8 (TrainSpec.fp8; see training/fp8.py)
    # the planner's choice and every probe it measured, as JSON (training/plan.py Plan.from_json);
    # "" when the layout was used as given (plan='off', CPU, unsupported strategy)
    plan: str = ""

    def mfu_text(self) -> str:
        """MFU as a percentage, or "n/a" where the device's peak is unknown (CPU): never a misleading 0.0 %."""
        return f"{self.mfu * 100:.1f} %" if self.mfu else "n/a"

    def __str__(self) -> str:
        """A short summary (what `pyflyte run` prints); the fields hold everything."""
        mfu = self.mfu_text()
        rows = [
            f"{self.model} on {self.dataset or '?'} · {self.strategy} · {self.world_size} x {self.device} · "
            f"{'fuseforge kernels' if self.kernels else 'no kernels'} · {self.dtype}"
            + (f" + fp8 ({self.fp8_linears} linear layers)" if self.fp8_linears else ""),
            f"  steps {self.steps}   tokens/s {self.tokens_per_s:,.0f}   MFU {mfu}   peak memory "
            f"{self.peak_memory_gib:.2f} GiB   step p50 {self.step_time_p50_s * 1e3:.1f} ms   "
            f"data wait {self.data_wait_fraction * 100:.2f} %",
            f"  final loss {self.final_loss:.4f}" + (f"   eval loss {self.eval_loss:.4f} (perplexity "
                                                      f"{self.eval_perplexity:.2f})" if self.eval_loss is not None else ""),
        ]
        if self.plan:
            rows.append(f"  plan: {Plan.from_json(self.plan).summary()}")
        if self.output_dir:
            rows.append(f"  output: {self.output_dir} (model/, metrics.json, settings.json)")
        elif self.model_dir:
            rows.append(f"  model: {self.model_dir}")
        return "\n".join(rows)

    __repr__ = __str__  # pyflyte prints outputs (and tuples of them) through repr
