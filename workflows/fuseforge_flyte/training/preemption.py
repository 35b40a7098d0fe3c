"""Preemption: on SIGTERM, finish the step, checkpoint it, and stop so that the restart loses nothing.

Kubernetes evicts a pod (preemption, node drain, spot reclaim) with SIGTERM to the
container's first process, then SIGKILL after `terminationGracePeriodSeconds` (30 s by
default). In an elastic job that process is torch elastic's agent: its SIGTERM handler
raises SignalException, and `_shutdown` sends SIGTERM to every local worker, waits
`TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (30 by default), then SIGKILLs them
(torch/distributed/elastic/agent/server/api.py `run`, multiprocessing/api.py `_close`).
Without a handler a worker dies at once (forked workers inherit the agent's handler, which
raises out of the middle of a step) and everything since the last periodic checkpoint
is redone.

`sigterm_handler()` (installed by `train` around resume and the loop) only sets a flag.
After each step the engine calls `agreed(ctx)`: an all-reduce (MAX) of the flag, so every
rank stops after the same step even when only some of them got the signal (one node of
several evicted); it writes a checkpoint of that step (when checkpoint_dir is set) and
raises `Preempted` on every rank, carrying the step, the checkpoint and the metrics so
far (the metrics are also in the checkpoint's history). The worker exits non-zero, the
agent restarts the worker group (or Flyte retries the task) and the new workers resume
from that step with nothing redone. A second SIGTERM restores the previous disposition and
re-delivers the signal: a stop that is no longer graceful.

Time budget: the step in flight plus one checkpoint write must fit in both
TORCH_ELASTIC_SHUTDOWN_TIMEOUT and the pod's grace period (set the grace period above it).

FUSEFORGE_SIGNAL_INJECT="rank:step[:target][,...]" (tests only): after `step`, that rank
sends SIGTERM to itself (target "self", default) or to its parent, the elastic agent
("parent"), like an eviction; first attempt only (TORCHELASTIC_RESTART_COUNT 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator, Optional

log = logging.getLogger("fuseforge.training")

SIGNAL_ENV = "FUSEFORGE_SIGNAL_INJECT"

_requested = False  # set by the handler; read after each step
_previous = None  # the disposition the handler replaced


class Preempted(RuntimeError):
    """Training stopped on SIGTERM after `step`; `checkpoint` holds it (None without checkpoint_dir).

    A retriable failure: the restarted workers (or the retried task) resume from `checkpoint`.
    `metrics` is the run's TrainMetrics up to `step` (set by `train`).
    """

    def __init__(self, step: int, checkpoint: Optional[str]):
        where = (f"checkpoint {checkpoint} holds it; a restart resumes there" if checkpoint else
                 "no checkpoint_dir is set, so a restart starts over")
        super().__init__(f"preempted (SIGTERM) after step {step}: {where}")
        self.step = step
        self.checkpoint = checkpoint
        self.metrics = None


def requested() -> bool:
    """Whether this process got SIGTERM since the handler was installed."""
    return _requested


def agreed(ctx) -> bool:
    """True on every rank when any rank got SIGTERM (collective: every rank calls it after every step)."""
    if ctx.world_size > 1 and ctx.distributed:
        return ctx.any(_requested)
    return _requested


def _handle(signum, frame) -> None:
    global _requested
    if _requested:  # the second one: stop now, as without the handler
        signal.signal(signum, _previous if _previous is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _requested = True
    log.warning("SIGTERM received: finishing the current step, then checkpointing and stopping")


@contextlib.contextmanager
def sigterm_handler() -> Iterator[None]:
    """Turn SIGTERM into a stop request for the duration (main thread only; elsewhere a no-op)."""
    global _requested, _previous
    if threading.current_thread() is not threading.main_thread():
        log.debug("not in the main thread: SIGTERM keeps its default behaviour")
        yield
        return
    _requested = False
    _previous = signal.signal(signal.SIGTERM, _handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
        _previous = None
        _requested = False


def maybe_inject(rank: int, step: int, restart_count: int) -> None:
    """Send SIGTERM as FUSEFORGE_SIGNAL_INJECT says (tests only; first attempt only)."""
    raw = os.environ.get(SIGNAL_ENV, "").strip()
    if not raw or restart_count > 0:
        return
    for item in filter(None, (part.strip() for part in raw.split(","))):
        fields = item.split(":")
        if len(fields) not in (2, 3) or not fields[0].isdigit() or not fields[1].isdigit() or \
                (len(fields) == 3 and fields[2] not in ("self", "parent")):
            raise ValueError(f"{SIGNAL_ENV}={raw!r}: expected 'rank:step[:self|parent]' items separated by commas")
        if (int(fields[0]), int(fields[1])) == (rank, step):
            target = os.getppid() if len(fields) == 3 and fields[2] == "parent" else os.getpid()
            os.kill(target, signal.SIGTERM)
