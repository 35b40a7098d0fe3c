"""TrainSpec checks: every bad value is rejected before any process group or model exists.

TrainSpec.validate() applies them. They read a spec through its fields only and import nothing of
training/spec.py, so TrainSpec can call them without an import cycle.

Errors name the field (``TrainSpec.<field>``) and the allowed values, so a typo in a
Flyte input or a CLI flag fails in seconds instead of after a cluster job starts.
"""

from __future__ import annotations

import dataclasses
import math
import typing

from fuseforge_flyte.data.benchmark import BENCHMARK_DATASETS, resolve_benchmark
from fuseforge_flyte.data.spec import DATA_FORMATS
from fuseforge_flyte.model_names import is_known_model, unknown_model_message

CHOICES = {
    "strategy": ("ddp", "fsdp", "deepspeed"),
    "dtype": ("fp32", "bf16", "fp16"),
    "nonfinite_policy": ("raise", "skip"),
    "zero_stage": (1, 2, 3),
    "data_format": DATA_FORMATS,
    "plan": ("auto", "off"),  # see training/planner.py
}
POSITIVE = ("steps", "batch_size", "grad_accum", "keep_last", "log_every")
NON_NEGATIVE = ("warmup_steps", "checkpoint_every", "weight_decay", "grad_clip", "seed", "loss_chunk_size",
                "eval_every")  # the lora_* settings: training/lora.py's check


def _check_types(spec) -> None:
    hints = typing.get_type_hints(type(spec))
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        expected = hints[field.name]
        if typing.get_origin(expected) is typing.Union:  # Optional[str]
            if value is None:
                continue
            expected = next(a for a in typing.get_args(expected) if a is not type(None))
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise TypeError(f"TrainSpec.{field.name} must be {expected.__name__}, got {value!r}")


def validate_spec(spec) -> None:
    """Raise ValueError/TypeError on the first invalid TrainSpec field."""
    _check_types(spec)
    for name in POSITIVE:
        if getattr(spec, name) < 1:
            raise ValueError(f"TrainSpec.{name} must be >= 1, got {getattr(spec, name)}")
    for name in NON_NEGATIVE:
        value = getattr(spec, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"TrainSpec.{name} must be a finite value >= 0, got {value}")
    if spec.seq_len < 2:
        raise ValueError(f"TrainSpec.seq_len must be >= 2 (next-token targets need two tokens), got {spec.seq_len}")
    if not math.isfinite(spec.lr) or spec.lr <= 0:
        raise ValueError(f"TrainSpec.lr must be a finite value > 0, got {spec.lr}")
    for name, allowed in CHOICES.items():
        if getattr(spec, name) not in allowed:
            raise ValueError(f"TrainSpec.{name}: {getattr(spec, name)!r} is not one of {list(allowed)}")
    skipped = skipped_kernels(spec)
    switches = kernel_switches() if skipped else ()
    unknown = [name for name in skipped if name not in switches]
    if unknown:
        raise ValueError(f"TrainSpec.skip_kernels: unknown kernel {unknown[0]!r}; use names from "
                         f"{list(switches)}, separated by commas")
    if not spec.model or not is_known_model(spec.model):
        raise ValueError(unknown_model_message(spec.model))
    _check_distillation(spec)
    from fuseforge_flyte.training import lora

    lora.check(spec)
    _check_fp8_and_compile(spec)
    _check_data(spec)
    if spec.checkpoint_every > 0 and spec.checkpoints_off:
        raise ValueError(f"TrainSpec.checkpoint_every > 0 needs checkpoints, but TrainSpec.checkpoint_dir is "
                         f"{spec.checkpoint_dir!r}")
    if spec.offload and spec.strategy != "deepspeed":
        raise ValueError(f"TrainSpec.offload applies to strategy='deepspeed' only, got strategy={spec.strategy!r}")
    if spec.strategy == "fsdp" and spec.dtype == "fp16":
        raise ValueError("TrainSpec.dtype='fp16' is not supported with strategy='fsdp' (no loss scaler): use 'bf16'")
    if spec.strategy == "deepspeed" and spec.nonfinite_policy == "skip" and spec.grad_accum != 1:
        raise ValueError(
            "TrainSpec.nonfinite_policy='skip' with strategy='deepspeed' needs grad_accum=1 "
            "(DeepSpeed owns gradient accumulation, so a step cannot be dropped half-way)"
        )


def _check_fp8_and_compile(spec) -> None:
    """FP8 runs its matmuls from bf16 activations (torchao); neither FP8 nor compile is verified under DeepSpeed.
    The GPU and torchao are checked by the worker, where they are known (training/fp8.py)."""
    if spec.fp8 and spec.dtype != "bf16":
        raise ValueError(f"TrainSpec.fp8 needs dtype='bf16' (FP8 matmuls between bf16 activations), "
                         f"got dtype={spec.dtype!r}")
    for name in ("fp8", "compile"):
        if getattr(spec, name) and spec.strategy == "deepspeed":
            raise ValueError(f"TrainSpec.{name} is not supported with strategy='deepspeed' (not verified with "
                             f"DeepSpeed's engine): use strategy 'ddp' or 'fsdp', or set {name} false")


def _check_distillation(spec) -> None:
    """A teacher needs the fused loss head (it computes the JSD); its settings must be in range."""
    for name, low, high in (("distill_weight", 0.0, 1.0), ("distill_beta", 0.0, 1.0)):
        value = getattr(spec, name)
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"TrainSpec.{name} must be in [{low:g}, {high:g}], got {value}")
    if not (math.isfinite(spec.distill_temperature) and spec.distill_temperature > 0):
        raise ValueError(f"TrainSpec.distill_temperature must be > 0, got {spec.distill_temperature}")
    if not spec.teacher:
        return
    if not is_known_model(spec.teacher):
        raise ValueError(unknown_model_message(spec.teacher, "teacher"))
    if not spec.kernels or "fused_linear_cross_entropy" in skipped_kernels(spec):
        raise ValueError("TrainSpec.teacher: distillation runs through the fused loss head (fused linear JSD); "
                         "turn kernels on and keep fused_linear_cross_entropy out of skip_kernels")


def kernel_switches() -> tuple:
    """apply_kernels' switches a run may turn off: fuseforge.transformers.DEFAULT_FLAGS minus cross_entropy (it only
    serves models whose loss computes logits: it is off there by default), the norms first, as TrainSpec.skip_kernels'
    help lists them. Imported when a run names kernels to skip, not with this module: fuseforge.transformers
    defines the Triton kernels, which a launching process leaves to its workers (launch.py's interpreter decision)."""
    from fuseforge.transformers import DEFAULT_FLAGS

    switches = [name for name in DEFAULT_FLAGS if name != "cross_entropy"]
    return tuple(sorted(switches, key=lambda name: not name.endswith("_norm")))


def skipped_kernels(spec) -> list:
    """The kernel names in spec.skip_kernels (commas and spaces separate them)."""
    return [name for name in spec.skip_kernels.replace(",", " ").split() if name]


def _check_data(spec) -> None:
    """Benchmark data takes no data options; anything else is checked by the data layer's own rules."""
    if resolve_benchmark(spec.dataset) is not None:
        if spec.eval_fraction or spec.eval_dataset or spec.eval_every:
            raise ValueError(f"TrainSpec.dataset: the benchmark dataset {spec.dataset!r} has no eval split: "
                             "drop eval_fraction/eval_dataset/eval_every, or train on real data")
        return
    if spec.dataset.startswith("bench:"):
        raise ValueError(f"TrainSpec.dataset: unknown benchmark dataset {spec.dataset!r}; "
                         f"use one of {list(BENCHMARK_DATASETS)}")
    from fuseforge_flyte.data.shards import is_prepared_dir, read_manifest

    prepared = is_prepared_dir(spec.dataset)
    has_eval = spec.eval_fraction or spec.eval_dataset or (prepared and read_manifest(spec.dataset).eval_sequences)
    if spec.eval_every and not has_eval:  # before the prepared-data return: the task gets prepared data
        raise ValueError(f"TrainSpec.eval_every={spec.eval_every} needs eval data: set eval_fraction (e.g. 0.05) or "
                         f"eval_dataset, or eval_every 0")
    if prepared:
        return  # prepared with its own options, checked then
    try:
        spec.data_spec().validate()
    except (ValueError, FileNotFoundError) as err:  # one error type for every bad TrainSpec value
        raise ValueError(str(err).replace("DataSpec.", "TrainSpec.")) from None
