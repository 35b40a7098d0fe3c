"""Failures that a restart cannot fix are not retried.

Torch elastic restarts the whole worker group on any worker failure, `max_restarts` times. That is
right for a lost worker or a flaky network, and wrong for a bad setting or a model that does not fit
in memory at its first step: every round fails the same way and costs the GPU pods' time again.

The agent's restart decision cannot be changed from outside, so the workers keep the verdict on
disk: a worker failing permanently writes the error into a directory the launcher created
(FUSEFORGE_PERMANENT_FAILURE_DIR); the restarted workers find it before doing any work and return
`FailedPermanently` at once, which ends the elastic run successfully (no further rounds), and the
launcher raises `PermanentFailure` with the original error. So a permanent error costs one
restart round of process start-up, not `max_restarts` full attempts. The directory is per node:
in a multi-node job the other nodes' workers fail when the recording node leaves, and the job ends.

Errors launched checks can find (settings, unknown model, data that does not fit) are raised in the
launching process before any worker starts; this module covers what only a worker can see.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TypeVar

import torch

from fuseforge_flyte.environ import environment
from fuseforge_flyte.user_errors import WorkerUserError

PERMANENT_FAILURE_DIR_ENV = "FUSEFORGE_PERMANENT_FAILURE_DIR"

T = TypeVar("T")


class FirstStepOutOfMemory(RuntimeError):
    """Out of memory before the first step of a run finished: the same settings will not fit again."""


class PermanentFailure(WorkerUserError):
    """Raised in the launching process: a worker failed in a way that retrying cannot fix (a user error: one line
    for the user, see user_errors)."""


@dataclass
class FailedPermanently:
    """What restarted workers return instead of their result once a permanent failure is recorded."""

    message: str


# Exception types whose cause is in the inputs or the code, not in the machine: the same run fails again.
PERMANENT_ERRORS = (ValueError, TypeError, KeyError, NotImplementedError, ImportError, FirstStepOutOfMemory)


def is_permanent(error: BaseException) -> bool:
    from fuseforge_flyte.training.checkpoint import ResumeMismatch  # imported here: checkpoint imports much more

    return isinstance(error, PERMANENT_ERRORS + (ResumeMismatch,))


def _directory() -> Optional[str]:
    return os.environ.get(PERMANENT_FAILURE_DIR_ENV) or None


def record(error: BaseException, rank: int) -> None:
    """Write `error` for the restarted workers (a no-op when no launcher set the directory up)."""
    directory = _directory()
    if directory is None:
        return
    text = f"{type(error).__name__}: {error}"
    path = os.path.join(directory, f"rank{rank:05d}.txt")
    with open(path + ".tmp", "w") as handle:
        handle.write(f"rank {rank}: {text}")
    os.replace(path + ".tmp", path)


def recorded() -> Optional[str]:
    """The permanent failures recorded by an earlier round on this node, or None."""
    directory = _directory()
    if directory is None:
        return None
    texts = [open(path).read() for path in sorted(glob.glob(os.path.join(directory, "rank*.txt")))]
    return "\n".join(texts) if texts else None


def run_worker(function: Callable[[], T], rank: int) -> "T | FailedPermanently":
    """Run one elastic worker's body: skip it if an earlier round failed permanently, record it if this one does."""
    earlier = recorded()
    if earlier is not None:
        return FailedPermanently(earlier)
    try:
        return function()
    except BaseException as error:
        if is_permanent(error):
            record(error, rank)
        raise


def raise_if_failed(result: object) -> None:
    """In the launcher: turn a worker's FailedPermanently into PermanentFailure."""
    if isinstance(result, FailedPermanently):
        raise PermanentFailure(f"a worker failed in a way that a restart cannot fix (not retried):\n{result.message}")


@contextlib.contextmanager
def failure_directory() -> Iterator[str]:
    """A fresh directory for one elastic launch (exported to the workers through the environment)."""
    with tempfile.TemporaryDirectory(prefix="fuseforge-failures-") as directory, \
            environment({PERMANENT_FAILURE_DIR_ENV: directory}):
        yield directory


def first_step_out_of_memory(error: torch.OutOfMemoryError, *, what: str) -> FirstStepOutOfMemory:
    return FirstStepOutOfMemory(
        f"out of memory in the first step of {what}, before any step finished: these settings do not fit "
        f"this device. Lower batch_size (raise grad_accum to keep the global "
        f"batch) or seq_len, turn on kernels / gradient_checkpointing, or use a sharded strategy "
        f"(fsdp, deepspeed) or more GPUs. ({str(error).splitlines()[0] if str(error) else 'torch.OutOfMemoryError'})")
