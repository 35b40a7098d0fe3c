"""A plan: the per-rank batch layout the planner chose (training/planner.py) and every probe it measured.

Plain data, JSON in TrainMetrics.plan: what a finished run reports about its layout is read (TrainMetrics, the
Deck) without the planner's machinery (torch, the probes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional


@dataclass(frozen=True)
class Candidate:
    """One per-rank layout. checkpoint_every: 0 none, 1 every decoder layer, k every k-th layer.
    loss_chunk_size: tokens per fused-loss chunk, 0 for fuseforge's default."""

    micro_batch: int
    grad_accum: int
    checkpoint_every: int = 0
    loss_chunk_size: int = 0

    def describe(self) -> str:
        ckpt = {0: "no checkpointing", 1: "checkpointing every layer"}.get(
            self.checkpoint_every, f"checkpointing every {self.checkpoint_every}th layer")
        chunk = f"loss chunk {self.loss_chunk_size}" if self.loss_chunk_size else "default loss chunk"
        return f"micro-batch {self.micro_batch} x accum {self.grad_accum}, {ckpt}, {chunk}"


@dataclass(frozen=True)
class Probe:
    """What one candidate measured: peak bytes allocated (max over ranks), seconds per micro-batch and tokens
    per second per rank; oom when it ran out of memory (then peak/time are 0)."""

    candidate: Candidate
    peak_bytes: int = 0
    seconds_per_micro_batch: float = 0.0
    tokens_per_s: float = 0.0
    oom: bool = False

    def fits(self, budget_bytes: int) -> bool:
        return not self.oom and self.peak_bytes <= budget_bytes

    def describe(self, budget_bytes: Optional[int] = None) -> str:
        if self.oom:
            return f"{self.candidate.describe()}: out of memory"
        over = " (over the budget)" if budget_bytes is not None and self.peak_bytes > budget_bytes else ""
        return (f"{self.candidate.describe()}: peak {format_gib(self.peak_bytes)}{over}, "
                f"{self.tokens_per_s:,.0f} tok/s per rank")

    @classmethod
    def from_dict(cls, raw: Dict) -> "Probe":
        return cls(**{**raw, "candidate": Candidate(**raw["candidate"])})


@dataclass
class Plan:
    """The chosen layout and everything measured to choose it (JSON-able: to_json/from_json)."""

    choice: Candidate
    world_size: int
    global_batch: int  # sequences per optimizer step over all ranks
    budget_bytes: int  # what a probe's peak had to stay within
    optimizer_bytes: int  # optimizer state subtracted from the memory for the budget
    probes: List[Probe] = field(default_factory=list)
    probe_seconds: float = 0.0  # wall time spent probing

    @property
    def chosen(self) -> Probe:
        return next(p for p in self.probes if p.candidate == self.choice)

    def summary(self) -> str:
        return (f"{self.choice.describe()} ({self.chosen.tokens_per_s * self.world_size:,.0f} tok/s, peak "
                f"{format_gib(self.chosen.peak_bytes)} + optimizer {format_gib(self.optimizer_bytes)} of budget "
                f"{format_gib(self.budget_bytes + self.optimizer_bytes)}); {len(self.probes)} probes in "
                f"{self.probe_seconds:.1f} s")

    def to_dict(self) -> Dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, raw: Dict) -> "Plan":
        return cls(**{**raw, "choice": Candidate(**raw["choice"]),
                      "probes": [Probe.from_dict(p) for p in raw["probes"]]})

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def format_gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
