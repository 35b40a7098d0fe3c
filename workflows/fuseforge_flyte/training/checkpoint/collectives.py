"""Agreement between ranks: every rank runs a step of a save or a check, and all of them learn whether any failed,
so that they stop, fall back or go on together instead of hanging in the next collective."""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

import torch.distributed as dist

from fuseforge_flyte.training.checkpoint.errors import FAILURES, short
from fuseforge_flyte.training.checkpoint.space import space_kind
from fuseforge_flyte.training.distributed import DistContext

log = logging.getLogger("fuseforge.training")


class PhaseFailed(Exception):
    """A step failed on some rank: every rank's (rank, error text, 'disk'/'bucket'/None), and this rank's error."""

    def __init__(self, failures: List[Tuple[int, str, Optional[str]]], error: Optional[BaseException]):
        super().__init__("; ".join(f"rank {rank}: {text}" for rank, text, _ in failures))
        self.failures = failures
        self.error = error


def gather(ctx: DistContext, obj: Any) -> List[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not (ctx.distributed and ctx.world_size > 1):
        return [obj]
    out: List[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def on_every_rank(ctx: DistContext, fn: Callable[[], Any], remote: bool = False) -> List[Any]:
    """fn() on every rank; every rank's result. A failure on any rank raises PhaseFailed on all of them.

    `remote`: fn writes to the object store, so running out of space there means the bucket.
    """
    result, error = None, None
    try:
        result = fn()
    except FAILURES as err:  # noqa: BLE001 - reported on every rank, then re-raised as CheckpointError
        error = err
    kind = None if error is None else space_kind(error)
    summary = None if error is None else (short(error), "bucket" if remote and kind == "disk" else kind)
    gathered = gather(ctx, (summary, result if error is None else None))
    failures = [(rank, s[0], s[1]) for rank, (s, _) in enumerate(gathered) if s is not None]
    if failures:
        raise PhaseFailed(failures, error)
    return [r for _, r in gathered]


def first_reason(ctx: DistContext, fn: Callable[[], Optional[str]], loading: bool = False) -> Optional[str]:
    """fn() on every rank (a reason, or None); the first rank's reason, on every rank."""
    try:
        reason = fn()
    except FAILURES as err:  # noqa: BLE001 - any failure means "try the previous checkpoint"
        what = "loading failed" if loading else "checking failed"
        reason = f"{what} on rank {ctx.rank} ({short(err, 600)})"
        if not ctx.is_main:
            log.warning("%s", reason)
    return next((r for r in gather(ctx, reason) if r), None)
