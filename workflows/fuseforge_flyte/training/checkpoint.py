"""Checkpoints: atomic, verifiable, resumable; on a local/shared filesystem or any fsspec store.

Layout under ``checkpoint_dir``::

    step_00000040/            one checkpoint (the step count it was taken after)
        COMPLETE.json         written last: {file: size} of every file; no marker = incomplete
        trainer_state.json    step, data position, model fingerprint, metrics history
        rng/rank_00000.pt     torch/cuda/python/numpy RNG states, one file per rank
        model.pt, optimizer.pt, scheduler.pt        ddp: full state, written by rank 0
        dcp/, scheduler.pt                          fsdp: torch.distributed.checkpoint shards
        deepspeed/state/                            deepspeed: save_checkpoint's per-rank files
        SKIPPED.json          added if this checkpoint failed to load and an older one was used
    progress.json             furthest step reached, steps redone so far

Sharded state is written sharded (DCP for FSDP, DeepSpeed's own format for ZeRO):
gathering a full state on rank 0 would need the whole model + optimizer in one
host's memory. DCP also reshards on load, so an elastic job may come back with a
different world size. For several nodes, a local path must be a shared filesystem.

Atomicity: on a local filesystem ranks write into a hidden temp directory that
rank 0 renames into place once the marker is in it; on object stores (no rename)
each rank uploads its files and rank 0 writes the marker last. Resuming tries the
newest complete checkpoint first; one that fails verification or loading is
skipped with a log line and the previous one is used. If checkpoints exist and
none loads, training stops with an error instead of starting fresh over them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from fuseforge_flyte.training.distributed import DistContext

log = logging.getLogger("fuseforge.training")

MARKER = "COMPLETE.json"
SKIPPED = "SKIPPED.json"
STATE = "trainer_state.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-"
_REMOTE_PROGRESS_INTERVAL_S = 5.0  # object-store writes cost tens of ms: throttle progress updates


class CheckpointError(RuntimeError):
    """No usable checkpoint where some exist, or a checkpoint cannot be written."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class Entry:
    step: int
    name: str
    complete: bool
    skipped: bool


# ---------------------------------------------------------------- RNG states


def rng_state(device: torch.device) -> Dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
    }


def set_rng_state(state: Dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))


# ---------------------------------------------------------------- storage


class Store:
    """A checkpoint root on fsspec; `local` when it is a plain filesystem path (renames are atomic)."""

    def __init__(self, root: str):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.fs, path = fsspec.core.url_to_fs(root)
        self.root = path.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def list(self) -> List[Entry]:
        if not self.fs.exists(self.root):
            return []
        entries = []
        for item in self.fs.ls(self.root, detail=False):
            name = item.rstrip("/").rsplit("/", 1)[-1]
            match = _NAME.match(name)
            if match:
                entries.append(Entry(int(match.group(1)), name, self.fs.exists(self.path(name, MARKER)),
                                     self.fs.exists(self.path(name, SKIPPED))))
        return sorted(entries, key=lambda e: e.step)

    def read_json(self, *parts: str) -> Dict:
        with self.fs.open(self.path(*parts), "r") as handle:
            return json.load(handle)

    def write_json(self, obj: Dict, *parts: str) -> None:
        target = self.path(*parts)
        if not self.local:  # an object PUT is atomic
            with self.fs.open(target, "w") as handle:
                json.dump(obj, handle)
            return
        tmp = f"{target}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)

    def remove(self, name: str) -> None:
        self.fs.rm(self.path(name), recursive=True)


def _local_files(directory: str) -> Dict[str, int]:
    files = {}
    for base, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(base, name)
            files[os.path.relpath(full, directory)] = os.path.getsize(full)
    return files


def _fsync_tree(directory: str) -> None:
    for base, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(os.path.dirname(os.path.abspath(directory)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- manager


class CheckpointManager:
    """Saves and resumes the training state of one strategy (all ranks call every method)."""

    def __init__(self, root: str, ctx: DistContext, strategy, *, keep_last: int, fingerprint: Dict[str, list]):
        self.store = Store(root)
        self.ctx = ctx
        self.strategy = strategy
        self.keep_last = keep_last
        self.fingerprint = fingerprint
        self._progress_written_at = 0.0
        self.steps_redone = 0

    # ------------------------------------------------------------ save

    def save(self, step: int, trainer_state: Dict) -> None:
        """Write checkpoint `step` (collective), then drop all but the newest keep_last."""
        name = checkpoint_name(step)
        token = self.ctx.broadcast_object(uuid.uuid4().hex[:12])
        if self.store.local:
            work = self.store.path(f"{_TMP_PREFIX}{name}-{token}")
            if self.ctx.is_main:
                os.makedirs(work)
            self.ctx.barrier()
        else:
            work = tempfile.mkdtemp(prefix=f"fuseforge-{name}-")
        os.makedirs(os.path.join(work, "rng"), exist_ok=True)
        self.strategy.save(work)
        torch.save(rng_state(self.ctx.device), os.path.join(work, "rng", f"rank_{self.ctx.rank:05d}.pt"))
        if self.ctx.is_main:
            with open(os.path.join(work, STATE), "w", encoding="utf-8") as handle:
                json.dump(dict(trainer_state, format=FORMAT_VERSION, step=step, strategy=self.strategy.name,
                               world_size=self.ctx.world_size, model_fingerprint=self.fingerprint), handle)
        self.ctx.barrier()
        if self.store.local:
            if self.ctx.is_main:
                self._commit_local(work, name, step)
        else:
            self._commit_remote(work, name, step)
        if self.ctx.is_main:
            self._prune()
        self.ctx.barrier()
        if self.ctx.is_main:
            log.info("saved checkpoint %s", self.store.path(name))

    def _marker(self, step: int, files: Dict[str, int]) -> Dict:
        return {"step": step, "strategy": self.strategy.name, "world_size": self.ctx.world_size,
                "time": time.time(), "files": files}

    def _commit_local(self, work: str, name: str, step: int) -> None:
        marker = self._marker(step, _local_files(work))
        with open(os.path.join(work, MARKER), "w", encoding="utf-8") as handle:
            json.dump(marker, handle)
        _fsync_tree(work)
        final = self.store.path(name)
        if os.path.exists(final):  # an incomplete or skipped leftover of an earlier attempt
            shutil.rmtree(final)
        os.replace(work, final)

    def _commit_remote(self, work: str, name: str, step: int) -> None:
        fs, final = self.store.fs, self.store.path(name)
        if self.ctx.is_main and fs.exists(final):
            fs.rm(final, recursive=True)
        self.ctx.barrier()
        for rel in _local_files(work):  # every rank uploads what it wrote
            fs.makedirs(os.path.dirname(f"{final}/{rel}"), exist_ok=True)
            fs.put_file(os.path.join(work, rel), f"{final}/{rel}")
        shutil.rmtree(work, ignore_errors=True)
        self.ctx.barrier()
        if self.ctx.is_main:
            files = {}
            for path, info in fs.find(final, detail=True).items():
                files[path[len(final) + 1 :] if path.startswith(final) else path] = int(info["size"])
            self.store.write_json(self._marker(step, files), name, MARKER)

    def _prune(self) -> None:
        entries = self.store.list()
        good = [e for e in entries if e.complete and not e.skipped]
        for entry in good[: max(0, len(good) - self.keep_last)]:
            self.store.remove(entry.name)
            log.info("removed old checkpoint %s (keep_last=%d)", entry.name, self.keep_last)
        newest = good[-1].step if good else -1
        for entry in entries:  # incomplete leftovers older than a complete one can never finish
            if not entry.complete and entry.step < newest:
                self.store.remove(entry.name)

    # ------------------------------------------------------------ resume

    def resume(self) -> Optional[Dict]:
        """Load the newest loadable complete checkpoint into the strategy; its trainer state, or None.

        Raises CheckpointError when complete checkpoints exist but none can be loaded.
        """
        entries = self.ctx.broadcast_object(self._scan() if self.ctx.is_main else None)
        complete = [e for e in entries if e.complete]
        candidates = [e for e in reversed(complete) if not e.skipped]
        failures: List[str] = []
        for entry in candidates:
            reason, state = self.ctx.broadcast_object(self._verify(entry) if self.ctx.is_main else None)
            if reason is None:
                reason = self._load(entry)
            if reason is None:
                if self.ctx.is_main:
                    for failed in failures:
                        self._mark_skipped(failed)
                    log.info("resumed from checkpoint %s", self.store.path(entry.name))
                return state
            if self.ctx.is_main:
                log.warning("skipping checkpoint %s: %s", self.store.path(entry.name), reason)
            failures.append(f"{entry.name}: {reason}")
        if complete:
            detail = "; ".join(failures) or "all were marked SKIPPED by an earlier attempt"
            raise CheckpointError(
                f"checkpoint_dir {self.store.path('')!r} holds checkpoints but none can be loaded ({detail}); "
                f"refusing to start fresh over them: fix or move them, or use another checkpoint_dir"
            )
        return None

    def _scan(self) -> List[Entry]:
        entries = self.store.list()
        if self.store.local and os.path.isdir(self.store.root):
            for name in os.listdir(self.store.root):
                if name.startswith(_TMP_PREFIX):
                    log.warning("removing unfinished checkpoint write %s", self.store.path(name))
                    shutil.rmtree(self.store.path(name), ignore_errors=True)
        for entry in entries:
            if not entry.complete:
                log.warning("ignoring incomplete checkpoint %s (no %s marker)", self.store.path(entry.name), MARKER)
        return entries

    def _verify(self, entry: Entry):
        """(None, trainer_state) if the files match the marker and fit this model, else (reason, None)."""
        try:
            marker = self.store.read_json(entry.name, MARKER)
            for rel, size in marker["files"].items():
                path = self.store.path(entry.name, rel)
                if not self.store.fs.exists(path):
                    return f"file {rel} is missing", None
                actual = int(self.store.fs.info(path)["size"])
                if actual != size:
                    return f"file {rel} is {actual} bytes, the marker recorded {size} (truncated?)", None
            state = self.store.read_json(entry.name, STATE)
        except (OSError, ValueError, KeyError) as err:
            return f"unreadable marker or trainer state ({type(err).__name__}: {err})", None
        if state.get("format") != FORMAT_VERSION:
            return f"format version {state.get('format')!r}, this code reads {FORMAT_VERSION}", None
        if state.get("strategy") != self.strategy.name:
            return (f"written with strategy {state.get('strategy')!r}, this run uses {self.strategy.name!r} "
                    f"(checkpoint formats differ per strategy)"), None
        mismatch = _fingerprint_mismatch(state.get("model_fingerprint", {}), self.fingerprint)
        if mismatch:
            return f"written for a different model: {mismatch}", None
        return None, state

    def _load(self, entry: Entry) -> Optional[str]:
        """Load on every rank; the reason it failed on any rank, or None."""
        reason = None
        staging = None
        try:
            if self.store.local:
                directory = self.store.path(entry.name)
            else:
                staging = directory = tempfile.mkdtemp(prefix=f"fuseforge-{entry.name}-")
                self.store.fs.get(self.store.path(entry.name) + "/", staging + "/", recursive=True)
            self.strategy.load(directory)
            rng_file = os.path.join(directory, "rng", f"rank_{self.ctx.rank:05d}.pt")
            if os.path.exists(rng_file):
                set_rng_state(torch.load(rng_file, weights_only=True), self.ctx.device)
            else:
                log.warning("rank %d: no RNG state in %s (world size changed?); keeping the seeded RNG",
                            self.ctx.rank, entry.name)
        except Exception as err:  # noqa: BLE001 - any load failure means "try the previous checkpoint"
            reason = f"loading failed on rank {self.ctx.rank} ({type(err).__name__}: {err})"
            if not self.ctx.is_main:
                log.warning("checkpoint %s: %s", entry.name, reason)
        finally:
            if staging:
                shutil.rmtree(staging, ignore_errors=True)
        if self.ctx.any(reason is not None):
            return reason or "loading failed on another rank"
        return None

    def _mark_skipped(self, failure: str) -> None:
        name, reason = failure.split(": ", 1)
        try:
            self.store.write_json({"reason": reason, "time": time.time()}, name, SKIPPED)
        except OSError as err:
            log.warning("could not mark %s as skipped: %s", name, err)

    # ------------------------------------------------------------ progress

    def start_progress(self, resumed_step: int) -> int:
        """Account for steps lost since the last checkpoint; returns the run's total steps redone."""
        progress = self.ctx.broadcast_object(self._read_progress() if self.ctx.is_main else None)
        furthest = int(progress.get("furthest_step", 0))
        self.steps_redone = int(progress.get("steps_redone", 0)) + max(0, furthest - resumed_step)
        self._furthest = max(furthest, resumed_step)
        if self.ctx.is_main:
            self.store.fs.makedirs(self.store.root, exist_ok=True)
            self._write_progress(force=True)
        return self.steps_redone

    def record_progress(self, step: int) -> None:
        self._furthest = max(self._furthest, step)
        if self.ctx.is_main:
            self._write_progress(force=False)

    def _read_progress(self) -> Dict:
        try:
            return self.store.read_json(PROGRESS)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("ignoring unreadable %s: %s", self.store.path(PROGRESS), err)
            return {}

    def _write_progress(self, force: bool) -> None:
        now = time.monotonic()
        if not force and not self.store.local and now - self._progress_written_at < _REMOTE_PROGRESS_INTERVAL_S:
            return
        self.store.write_json({"furthest_step": self._furthest, "steps_redone": self.steps_redone}, PROGRESS)
        self._progress_written_at = now


def _fingerprint_mismatch(saved: Dict[str, list], current: Dict[str, list]) -> Optional[str]:
    for name, shape in current.items():
        if name not in saved:
            return f"parameter {name} missing"
        if list(saved[name]) != list(shape):
            return f"{name} has shape {list(saved[name])}, the model has {list(shape)}"
    extra = sorted(set(saved) - set(current))
    return f"unexpected parameter {extra[0]}" if extra else None
