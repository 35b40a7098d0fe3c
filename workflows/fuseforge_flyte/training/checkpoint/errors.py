"""What goes wrong with checkpoints: the errors callers see, and what a failed save or load raises."""

from __future__ import annotations

try:  # derives from BaseException: `except Exception` misses it (a damaged DCP checkpoint)
    from torch.distributed.checkpoint.api import CheckpointException as _DCPError
except ImportError:  # pragma: no cover - torch without distributed checkpointing
    _DCPError = Exception

FAILURES = (Exception, _DCPError)  # what a failed save/load raises; never KeyboardInterrupt/SystemExit


class CheckpointError(RuntimeError):
    """No usable checkpoint where some exist, an incompatible one, or a checkpoint cannot be written."""


class CheckpointUserError(CheckpointError, ValueError):
    """A checkpoint problem only the user can fix (none loads, a tampered file, a full or read-only folder): the
    run ends with its one line and the exit status of other user errors (user_errors.py), and is not retried
    (training/permanent.py)."""


class ResumeMismatch(CheckpointUserError):
    """A verified checkpoint of another model, strategy or settings: the same run meets it again on every
    restart, so it is not retried (training/permanent.py)."""


def short(err: BaseException, limit: int = 400) -> str:
    """`err` as one line for a message: its type and text, cut at `limit` characters."""
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[:limit] + "..."
