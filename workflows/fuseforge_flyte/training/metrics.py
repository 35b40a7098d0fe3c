"""Per-step measurements and their summary: throughput, MFU, memory, step-time percentiles.

The history is part of every checkpoint, so a resumed run reports the whole run's
curves. The first step of each session (start or resume) is a warm-up (allocator,
autotuning, compilation) and is left out of the averages and percentiles.
"""

from __future__ import annotations

import math
import resource
from dataclasses import asdict, dataclass, field
from typing import Dict, List

import numpy as np
import torch


@dataclass
class History:
    loss: List[float] = field(default_factory=list)  # per step, averaged over ranks; NaN when skipped
    step_time: List[float] = field(default_factory=list)  # seconds
    memory_gib: List[float] = field(default_factory=list)  # rank 0's peak during the step
    warmup: List[int] = field(default_factory=list)  # 0-based indices of steps that began a session
    skipped_steps: int = 0
    data_wait: List[float] = field(default_factory=list)  # seconds of each step spent getting its batches
    loss_tokens: List[int] = field(default_factory=list)  # global tokens carrying a loss, per step
    eval_loss: List[float] = field(default_factory=list)  # per eval, mean loss per token
    eval_steps: List[int] = field(default_factory=list)  # the step each eval followed

    def to_dict(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Dict) -> "History":
        return cls(**raw)

    def truncate(self, steps: int) -> None:
        """Forget steps after `steps` (they are redone after a resume)."""
        del self.loss[steps:], self.step_time[steps:], self.memory_gib[steps:]
        del self.data_wait[steps:], self.loss_tokens[steps:]
        self.warmup = [i for i in self.warmup if i < steps]
        kept = [i for i, step in enumerate(self.eval_steps) if step <= steps]
        self.eval_loss = [self.eval_loss[i] for i in kept]
        self.eval_steps = [self.eval_steps[i] for i in kept]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory since the last reset; the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def device_name(device: torch.device) -> str:
    """What the metrics call the device: the GPU's product name, else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def perplexity(loss: float) -> float:
    """exp of a mean per-token loss (inf past what a float holds, NaN for a non-finite loss)."""
    if not math.isfinite(loss):
        return float("nan")
    return math.exp(loss) if loss < 700 else float("inf")  # exp overflows a float past ~709


def percentile(values: List[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


@dataclass
class Summary:
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    step_time_p50_s: float
    step_time_p90_s: float
    step_time_p99_s: float
    tokens_per_s_curve: List[float]
    data_wait_fraction: float  # share of the steady steps' time spent waiting for data
    loss_tokens_per_step: float


def summarize(history: History, *, tokens_per_step: int, samples_per_step: int,
              flops_per_token: float, peak_flops_total: float) -> Summary:
    """Global throughput from the steady-state steps (all steps if every one was a warm-up)."""
    times = history.step_time
    warm = set(history.warmup)
    steady = [t for i, t in enumerate(times) if i not in warm] or list(times)
    mean = sum(steady) / len(steady) if steady else 0.0
    tokens_per_s = tokens_per_step / mean if mean > 0 else 0.0
    samples_per_s = samples_per_step / mean if mean > 0 else 0.0
    mfu = flops_per_token * tokens_per_s / peak_flops_total if peak_flops_total > 0 else 0.0
    curve = [tokens_per_step / t if t > 0 else 0.0 for t in times]
    waits = [w for i, w in enumerate(history.data_wait) if i not in warm] or list(history.data_wait)
    wait_fraction = sum(waits) / sum(steady) if waits and sum(steady) > 0 else 0.0
    loss_tokens = sum(history.loss_tokens) / len(history.loss_tokens) if history.loss_tokens else 0.0
    return Summary(tokens_per_s, samples_per_s, mfu, percentile(steady, 50), percentile(steady, 90),
                   percentile(steady, 99), curve, wait_fraction, loss_tokens)


def final_loss(history: History) -> float:
    """The last step's loss, or the last finite one if that step was skipped."""
    finite = [x for x in history.loss if math.isfinite(x)]
    return finite[-1] if finite else float("nan")
