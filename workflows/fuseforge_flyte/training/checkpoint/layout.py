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
    *.json.<token>.tmp        a JSON file being written (storage.Store.write_json; renamed into place)

Only these names are ever removed (pruning, leftovers): a regular file, or a folder holding anything else, is
the user's and stays.
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
_TMP_DIR = re.compile(r"^\.tmp-step_\d{8}-[0-9a-f]{12}$")
_TMP_FILE = re.compile(r"^[A-Za-z_]+\.json\.[0-9a-f]{8}\.tmp$")
# what a save puts at the top of a checkpoint directory (every strategy), besides temp files
WRITTEN = frozenset({MARKER, SKIPPED, STATE, "rng", "model.pt", "optimizer.pt", "scheduler.pt", "scaler.pt", "dcp",
                     "deepspeed"})
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name, or None when `name` is not one."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def temp_dir(name: str) -> bool:
    """Whether `name` is a save in progress (a local filesystem's hidden directory)."""
    return bool(_TMP_DIR.match(name))


def temp_file(name: str) -> bool:
    """Whether `name` is a JSON file being written (Store.write_json's temp name)."""
    return bool(_TMP_FILE.match(name))


def foreign_names(names) -> list:
    """The top-level names in a step_NNNNNNNN directory that no save writes (then it is not ours to remove)."""
    return sorted(n for n in names if n not in WRITTEN and not temp_file(n))


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
