"""With-kernels vs without-kernels: the ratios the compare workflow returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fuseforge_flyte.training.spec import TrainMetrics


@dataclass
class Comparison:
    """Side-by-side result of the same training run with and without the fuseforge kernels."""

    throughput_gain_pct: float = 0.0  # tokens/s with kernels vs without, in % (+ = faster)
    memory_reduction_pct: float = 0.0  # peak memory saved by the kernels, in % (+ = less memory)
    step_time_p50_speedup: float = 0.0  # median step time without / with kernels (> 1 = faster)
    final_loss_diff: float = 0.0  # final loss with kernels minus without (same seed and data: ~0)
    max_loss_curve_diff: float = 0.0  # largest per-step |loss difference| along the curves
    with_kernels: TrainMetrics = field(default_factory=TrainMetrics)
    without_kernels: TrainMetrics = field(default_factory=TrainMetrics)
    note: str = ""  # what the numbers cannot say (e.g. CPU runs through Triton's interpreter)

    def __str__(self) -> str:
        w, wo = self.with_kernels, self.without_kernels
        # one reading order throughout: without -> with, the change the kernels make
        lines = [f"without -> with fuseforge kernels: throughput {self.throughput_gain_pct:+.1f} %, peak memory "
                 f"{-self.memory_reduction_pct:+.1f} %, final loss difference {self.final_loss_diff:+.2e}",
                 f"  tokens/s {wo.tokens_per_s:,.0f} -> {w.tokens_per_s:,.0f}; peak memory {wo.peak_memory_gib:.2f} -> "
                 f"{w.peak_memory_gib:.2f} GiB; step p50 {wo.step_time_p50_s * 1e3:.1f} -> {w.step_time_p50_s * 1e3:.1f} ms"]
        if self.note:
            lines.append(f"  NOTE: {self.note}")
        return "\n".join(lines)

    __repr__ = __str__  # pyflyte prints outputs through repr


CPU_INTERPRETER_NOTE = (
    "both runs ran on the CPU, where fuseforge's Triton kernels go through Triton's interpreter (one kernel "
    "program after another): the throughput and memory changes say nothing about a GPU; run compare on GPUs "
    "(--remote) to measure the kernels"
)


def _positive(value: float, what: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"cannot compare runs: {what} must be a positive finite number, got {value}")
    return value


def compare_metrics(with_kernels: TrainMetrics, without_kernels: TrainMetrics) -> Comparison:
    """Ratios between two runs that differ only in `kernels`; anything else differing is an error."""
    if not with_kernels.kernels or without_kernels.kernels:
        raise ValueError(
            "cannot compare runs: expected with_kernels.kernels=True and without_kernels.kernels=False, "
            f"got {with_kernels.kernels} and {without_kernels.kernels}"
        )
    for name in ("model", "strategy", "world_size", "steps", "device"):
        a, b = getattr(with_kernels, name), getattr(without_kernels, name)
        if a != b:
            raise ValueError(f"cannot compare runs: they differ in {name} ({a!r} with kernels, {b!r} without)")

    tps = _positive(with_kernels.tokens_per_s, "with_kernels.tokens_per_s")
    base_tps = _positive(without_kernels.tokens_per_s, "without_kernels.tokens_per_s")
    mem = _positive(with_kernels.peak_memory_gib, "with_kernels.peak_memory_gib")
    base_mem = _positive(without_kernels.peak_memory_gib, "without_kernels.peak_memory_gib")
    p50 = _positive(with_kernels.step_time_p50_s, "with_kernels.step_time_p50_s")
    base_p50 = _positive(without_kernels.step_time_p50_s, "without_kernels.step_time_p50_s")

    # Steps skipped for a non-finite loss are NaN in the curves: compare the steps both runs took.
    pairs = [(a, b) for a, b in zip(with_kernels.loss_curve, without_kernels.loss_curve) if math.isfinite(a - b)]
    return Comparison(
        throughput_gain_pct=(tps / base_tps - 1.0) * 100.0,
        memory_reduction_pct=(1.0 - mem / base_mem) * 100.0,
        step_time_p50_speedup=base_p50 / p50,
        final_loss_diff=with_kernels.final_loss - without_kernels.final_loss,
        max_loss_curve_diff=max((abs(a - b) for a, b in pairs), default=0.0),
        with_kernels=with_kernels,
        without_kernels=without_kernels,
        note=CPU_INTERPRETER_NOTE if with_kernels.device == "cpu" else "",
    )
