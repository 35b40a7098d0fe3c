"""Test-only fault injection, driven by environment variables (unset in production: no effect).

FUSEFORGE_FAULT_INJECT="rank:step[:mode][,...]": after finishing `step` (its progress
recorded, before that step's checkpoint would be written), that rank dies: mode "kill" (default) SIGKILLs the process like a preempted pod, mode
"raise" raises InjectedFault (for in-process tests). Only in the first attempt
(TORCHELASTIC_RESTART_COUNT unset or 0), so the restarted workers run through.

FUSEFORGE_NONFINITE_INJECT="rank:step[,...]": that rank's loss in `step` becomes NaN
(its gradients too), to exercise the non-finite loss policy.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Dict, Tuple

import torch

FAULT_ENV = "FUSEFORGE_FAULT_INJECT"
NONFINITE_ENV = "FUSEFORGE_NONFINITE_INJECT"


class InjectedFault(RuntimeError):
    """Raised by a "raise" mode fault injection."""


def _parse(env: str) -> Dict[Tuple[int, int], str]:
    raw = os.environ.get(env, "").strip()
    points = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        fields = item.split(":")
        if len(fields) not in (2, 3) or not fields[0].isdigit() or not fields[1].isdigit():
            raise ValueError(f"{env}={raw!r}: expected 'rank:step[:mode]' items separated by commas")
        mode = fields[2] if len(fields) == 3 else "kill"
        if mode not in ("kill", "raise", "oom"):
            raise ValueError(f"{env}={raw!r}: mode must be 'kill', 'raise' or 'oom', got {mode!r}")
        points[(int(fields[0]), int(fields[1]))] = mode
    return points


def maybe_fail(rank: int, step: int, restart_count: int) -> None:
    """Die here if FUSEFORGE_FAULT_INJECT names (rank, step) and this is the first attempt."""
    mode = _parse(FAULT_ENV).get((rank, step))
    if mode not in ("kill", "raise") or restart_count > 0:
        return
    if mode == "raise":
        raise InjectedFault(f"injected fault on rank {rank} after step {step}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_out_of_memory(rank: int, step: int) -> None:
    """Raise torch.OutOfMemoryError if FUSEFORGE_FAULT_INJECT names (rank, step) with mode "oom"."""
    if _parse(FAULT_ENV).get((rank, step)) == "oom":
        raise torch.OutOfMemoryError(f"injected out of memory on rank {rank} in step {step}")


def maybe_poison(loss: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """NaN loss (and gradients) if FUSEFORGE_NONFINITE_INJECT names (rank, step)."""
    if (rank, step) in _parse(NONFINITE_ENV):
        return loss * float("nan")
    return loss
