"""A checkpoint on disk: its directory names, the files every checkpoint has, and the manifest's shape.

Layout under ``checkpoint_dir``::

    step_00000040/            one checkpoint (the step count it was taken after)
        COMPLETE.json         the manifest, written last: every file's size and sha256 (+ HMAC); none = incomplete
        trainer_state.json    step, data position, metrics history, model fingerprint and config, run settings
        rng/rank_00000.pt     torch/cuda/python/numpy RNG states, one file per rank
        model.pt, optimizer.pt, scheduler.pt        ddp: full state, written by rank 0
        dcp/, scheduler.pt                          fsdp: torch.distributed.checkpoint shards
        deepspeed/state/                            deepspeed: save_checkpoint's per-rank files
        SKIPPED.json          added if this checkpoint failed to load and an older one was used
    progress.json             furthest step begun, steps redone so far (signed like the manifest; progress.py)
    .tmp-step_...-<token>/    a save in progress on a local filesystem (renamed into place when complete)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Optional

MARKER = "COMPLETE.json"
SKIPPED = "SKIPPED.json"
STATE = "trainer_state.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 2  # 1: sizes only, no hashes, no settings (refused: cannot be verified)
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step_(\d{8})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name, or None when `name` is not one."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


@dataclass
class Entry:
    step: int
    name: str
    complete: bool
    marked: bool  # a SKIPPED.json is there; trusted only once its signature checks out (skip_reason)
    skip_reason: Optional[str] = None  # why an earlier attempt passed it over, from a valid skip mark

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None


def _safe_relpath(rel: Any) -> bool:
    return (isinstance(rel, str) and rel != "" and not rel.startswith(("/", "\\")) and "\\" not in rel
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def manifest_shape_problem(marker: Dict) -> Optional[str]:
    """Why an authenticated manifest cannot be used (a path outside the checkpoint, an entry without a size and
    sha256, no trainer state), or None."""
    files = marker.get("files")
    if not isinstance(files, dict) or STATE not in files:
        return f"the manifest lists no {STATE}"
    for rel, entry in files.items():
        if not _safe_relpath(rel) or rel in (MARKER, SKIPPED):
            return f"the manifest lists an invalid path {rel!r}"
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])):
            return f"the manifest's entry for {rel} has no valid size and sha256"
    return None
