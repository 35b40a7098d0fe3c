"""Disk space: how much is free, how big a checkpoint will be, and whether a failed write means a full disk.

Before a save on a local filesystem the free space is compared with the size of the last checkpoint (or, before
the first, an estimate from the model and optimizer state); with keep_last=K the volume holds K+1 checkpoints
while the newest is written. A save that still runs out of space (or an upload refused by a full bucket) is
reported as such, with the free space; one that hits a read-only or forbidden folder, as that.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any, List, Optional, Tuple

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_READONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_FULL_TEXT = ("unexpected pos", "no space left", "disk quota", "file too large", "failed writing",
              "file write failed", "enospc")
_BUCKET_FULL_TEXT = ("quotaexceeded", "quota exceeded", "insufficientstorage", "insufficient storage",
                     "entitytoolarge", "storage quota", "no space left")


def free_bytes(path: str) -> Tuple[int, int]:
    """(free, total) bytes of the filesystem holding `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    usage = shutil.disk_usage(path)
    return usage.free, usage.total


def size_text(n: float) -> str:
    """A byte count for a message: "1.50 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"


def _causes(err: BaseException) -> List[BaseException]:
    """err, its chained causes and, for a DCP CheckpointException, every rank's failure."""
    seen: List[BaseException] = []
    stack: List[Any] = [err]
    while stack:
        item = stack.pop()
        if not isinstance(item, BaseException) or any(item is s for s in seen):
            continue
        seen.append(item)
        stack += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return seen


def space_kind(err: BaseException) -> Optional[str]:
    """'disk' when err means a full disk/quota/file-size limit, 'bucket' for a full object store, 'readonly' for a
    folder that cannot be written (read-only filesystem, no permission), else None."""
    for cause in _causes(err):
        if isinstance(cause, OSError) and cause.errno in _READONLY_ERRNOS:
            return "readonly"
        text = str(cause).lower()
        if isinstance(cause, OSError) and cause.errno in _FULL_ERRNOS or any(t in text for t in _FULL_TEXT):
            return "disk"
        if any(t in text for t in _BUCKET_FULL_TEXT):
            return "bucket"
    return None


def estimate_state_bytes(strategy) -> int:
    """fp32 weights + AdamW's two moments: a lower bound of a checkpoint before one was written."""
    numel = 0
    for param in strategy.model.parameters():
        numel += int(getattr(param, "ds_numel", 0) or param.numel())  # ZeRO-3 keeps an empty placeholder
    return numel * 4 * 3
