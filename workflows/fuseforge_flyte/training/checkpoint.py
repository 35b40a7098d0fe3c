"""Checkpoints: atomic, verified before anything is loaded, resumable; on a local/shared filesystem or any fsspec store.

Layout under ``checkpoint_dir``::

    step_00000040/            one checkpoint (the step count it was taken after)
        COMPLETE.json         the manifest, written last: every file's size and sha256 (+ HMAC); none = incomplete
        trainer_state.json    step, data position, metrics history, model fingerprint and config, run settings
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
rank 0 renames into place once the manifest is in it; on object stores (no rename)
each rank uploads its files and rank 0 writes the manifest last.

Verification. Every file is hashed (sha256) once, right after it is written: on a local
filesystem the files are shared out over the ranks (read back from the page cache); for an
object store each rank hashes its local files before uploading them. With a key, the
manifest carries an HMAC-SHA256 of itself. Before any checkpoint byte reaches a loader
(FSDP's DCP unpickles ``.metadata``; DeepSpeed's engine uses ``torch.load(weights_only=False)``;
so whoever can rewrite a checkpoint could otherwise run code in the training pods), resuming
checks the manifest's HMAC, then every listed file's size and sha256: on a local filesystem in
place (shared out over the ranks, and no file outside the manifest may be there, since a loader
could pick it up by name); from an object store only the listed files are downloaded, into a
private directory, and checked there, so what is loaded is what was checked.

Keys (fuseforge_flyte/training/checkpoint_signing.py): ``FUSEFORGE_CHECKPOINT_KEY`` or
``FUSEFORGE_CHECKPOINT_KEY_FILE``, else a per-user key made once under the user's config directory (none
inside a Kubernetes pod, nor with ``FUSEFORGE_CHECKPOINT_REQUIRE_KEY=1``). Every checkpoint is signed with
it, and one that is unsigned, signed with another key or changed after signing is refused with that
reason, on a local filesystem as on an object store, unless ``allow_unsigned_checkpoints`` is set: then
it is loaded after an integrity check, with a warning logged before any of its bytes are. Local
filesystems are not defended against a writer racing the resume (between the check and the load);
object stores are (the checked copy is private to the pod).

Compatibility. The trainer state records the model config (minus volatile keys) and the run
settings that shape the trajectory (`run_settings`). Resuming with a different value stops the
run, naming each differing field, unless ``TrainSpec.resume_allow_changes`` lists it (e.g.
"lr,steps" to continue training on a new schedule; lr, weight_decay, steps and warmup_steps are
then applied to the restored optimizer and schedule). A checkpoint beyond ``steps`` is an error.

Corrupt vs incompatible: a checkpoint that fails verification or loading is skipped with a
warning naming the reason (marked SKIPPED, signed and bound to its manifest, once an older one
loads; a later resume passes it over with a warning naming that reason, and ignores, with a warning,
a mark that is not signed for its manifest) and the previous one is tried; if checkpoints exist and
none loads, training stops instead of starting fresh over them. A verified checkpoint of another model, strategy or settings stops the run at once:
falling back to an older one would silently throw progress away.

Disk space: before a save on a local filesystem the free space is compared with the size of
the last checkpoint (or, before the first, an estimate from the model and optimizer state);
with keep_last=K the volume holds K+1 checkpoints while the newest is written. A save that
still runs out of space (or an upload refused by a full bucket) is reported as such, with the
free space, and its partial files are removed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from fuseforge_flyte.training.checkpoint_signing import Signing, SigningError
from fuseforge_flyte.training.distributed import DistContext

try:  # derives from BaseException: `except Exception` misses it (a damaged DCP checkpoint)
    from torch.distributed.checkpoint.api import CheckpointException as _DCPError
except ImportError:  # pragma: no cover - torch without distributed checkpointing
    _DCPError = Exception

log = logging.getLogger("fuseforge.training")

MARKER = "COMPLETE.json"
SKIPPED = "SKIPPED.json"
STATE = "trainer_state.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 2  # 1: sizes only, no hashes, no settings (refused: cannot be verified)
_NAME = re.compile(r"^step_(\d{8})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TMP_PREFIX = ".tmp-"
_REMOTE_PROGRESS_INTERVAL_S = 5.0  # object-store writes cost tens of ms: throttle progress updates
_CHUNK = 4 << 20
_ERRORS = (Exception, _DCPError)  # what a failed save/load raises; never KeyboardInterrupt/SystemExit

# Settings that shape the training trajectory; a resume must match them unless resume_allow_changes lists them.
ALLOWABLE_CHANGES = ("seed", "dataset", "seq_len", "global_batch", "lr", "weight_decay", "warmup_steps", "steps",
                     "grad_clip", "dtype", "model_config")
_SCHEDULE = frozenset({"lr", "weight_decay", "warmup_steps", "steps"})  # re-applied to the restored optimizer
# The prepared data's identity (fuseforge_flyte.data.shards.DataManifest fields), not its directory's path.
_DATA_IDENTITY = ("source", "dataset_config", "dataset_split", "eval_source", "data_format", "seq_len", "packing",
                  "tokenizer", "seed", "train_sequences", "train_tokens", "train_loss_tokens")
# model config keys that do not change what is trained (bookkeeping, output switches, dtype: see `dtype`)
_VOLATILE_CONFIG = frozenset({"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
                              "output_attentions", "output_hidden_states", "return_dict", "use_return_dict",
                              "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "torchscript",
                              "tf_legacy_loss", "is_encoder_decoder", "attn_implementation"})
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_FULL_TEXT = ("unexpected pos", "no space left", "disk quota", "file too large", "failed writing",
              "file write failed", "enospc")
_BUCKET_FULL_TEXT = ("quotaexceeded", "quota exceeded", "insufficientstorage", "insufficient storage",
                     "entitytoolarge", "storage quota", "no space left")


class CheckpointError(RuntimeError):
    """No usable checkpoint where some exist, an incompatible one, or a checkpoint cannot be written."""


class ResumeMismatch(CheckpointError, ValueError):
    """A verified checkpoint of another model, strategy or settings: the same run meets it again on every
    restart, so it is not retried (training/permanent.py)."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


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


# ---------------------------------------------------------------- hashes, manifests


def file_digest(path: str) -> Tuple[int, str]:
    """(size, sha256 hex) of a file, streamed in 4 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(view)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def _digest_files(directory: str, names: List[str]) -> Dict[str, Dict]:
    """{name: {size, sha256}}; a few threads (hashlib and reads release the GIL)."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(4, len(names))) as pool:
        results = pool.map(lambda rel: file_digest(os.path.join(directory, rel)), names)
        return {rel: {"size": size, "sha256": sha} for rel, (size, sha) in zip(names, results)}


def _check_file(path: str, rel: str, expected: Dict) -> Optional[str]:
    """Why the file at `path` does not match its manifest entry, or None."""
    try:
        size = os.path.getsize(path)
        if size == expected["size"]:
            size, sha = file_digest(path)
    except FileNotFoundError:
        return f"file {rel} is missing"
    except OSError as err:
        return f"file {rel} is unreadable ({err})"
    if size != expected["size"]:
        return f"file {rel} is {size} bytes, the manifest recorded {expected['size']} (truncated?)"
    if sha != expected["sha256"]:
        return (f"file {rel} changed since it was written (sha256 {sha[:16]}..., the manifest recorded "
                f"{expected['sha256'][:16]}...)")
    return None


def _check_bytes(rel: str, data: bytes, expected: Dict) -> Optional[str]:
    if len(data) != expected["size"]:
        return f"file {rel} is {len(data)} bytes, the manifest recorded {expected['size']} (truncated?)"
    sha = hashlib.sha256(data).hexdigest()
    if sha != expected["sha256"]:
        return f"file {rel} changed since it was written (sha256 {sha[:16]}..., the manifest recorded " \
               f"{expected['sha256'][:16]}...)"
    return None


def _safe_relpath(rel: Any) -> bool:
    return (isinstance(rel, str) and rel != "" and not rel.startswith(("/", "\\")) and "\\" not in rel
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def _manifest_shape_problem(marker: Dict) -> Optional[str]:
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


# ---------------------------------------------------------------- run settings


def run_settings(spec, data_manifest, *, samples_per_step: int, dtype: str) -> Dict:
    """What a resume must match (TrainSpec names; `global_batch` is samples per step; `dataset` the data's identity).

    `data_manifest` is the prepared data's DataManifest, or None for a benchmark dataset.
    """
    if data_manifest is not None:
        dataset = {name: getattr(data_manifest, name, None) for name in _DATA_IDENTITY}
    else:
        from fuseforge_flyte.training.data import resolve_benchmark

        dataset = {"benchmark": resolve_benchmark(spec.dataset) or spec.dataset}
    settings = {"seed": spec.seed, "dataset": dataset, "seq_len": spec.seq_len,
                "global_batch": samples_per_step, "lr": spec.lr, "weight_decay": spec.weight_decay,
                "warmup_steps": spec.warmup_steps, "steps": spec.steps, "grad_clip": spec.grad_clip,
                "dtype": dtype}
    if getattr(spec, "teacher", ""):  # only then: runs without a teacher resume checkpoints written before it existed
        settings["distillation"] = {"teacher": spec.teacher, "weight": spec.distill_weight,
                                    "beta": spec.distill_beta, "temperature": spec.distill_temperature}
    return _jsonable(settings)


def parse_allowed_changes(value: str) -> FrozenSet[str]:
    """TrainSpec.resume_allow_changes ("lr,steps") as a set; unknown names are an error."""
    names = frozenset(part.strip() for part in (value or "").split(",") if part.strip())
    unknown = sorted(names - set(ALLOWABLE_CHANGES))
    if unknown:
        raise ValueError(f"TrainSpec.resume_allow_changes: unknown setting(s) {unknown}; "
                         f"choose from {list(ALLOWABLE_CHANGES)} (comma-separated)")
    return names


def model_config_for_resume(config: Dict) -> Dict:
    """A model config dict without the keys that do not change what is trained (recursively)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG and not str(k).startswith("_")}
        return value

    return _jsonable(strip(config))


def _jsonable(value: Any) -> Any:
    """The value as it reads back from JSON (tuples become lists, keys strings), so that comparisons are fair."""
    return json.loads(json.dumps(value, default=str))


def _flatten(value: Any, prefix: str) -> Dict[str, Any]:
    if isinstance(value, dict) and (value or not prefix):
        out: Dict[str, Any] = {}
        for key in sorted(value):
            out.update(_flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


_MISSING = "(not recorded)"


def _differences(saved: Dict, current: Dict) -> List[Tuple[str, str]]:
    """[(top-level setting, "path: saved -> current")] for every leaf that differs."""
    old, new = _flatten(saved, ""), _flatten(current, "")
    diffs = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path, _MISSING), new.get(path, _MISSING)
        if a != b:
            diffs.append((path.split(".", 1)[0], f"{path}: {a!r} -> {b!r}"))
    return diffs


_REFUSE = ("refusing to start fresh over it (or to resume a different run from it): use the original settings, "
           "or another checkpoint_dir")


def settings_verdict(state: Dict, settings: Dict, allowed: FrozenSet[str], where: str,
                     extra: Sequence[Tuple[str, str]] = ()) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """(error, allowed differences) of a verified trainer state against this run's `settings` (run_settings'
    keys, or some of them); `extra` are further (setting, "path: old -> new") differences."""
    steps = settings.get("steps")
    if steps is not None and state["step"] > steps:
        return (f"checkpoint {where} is at step {state['step']}, beyond this run's steps={steps}: that run "
                f"already trained further. Use steps >= {state['step']} (steps > {state['step']} with "
                f"resume_allow_changes='steps' continues on the longer schedule), or another checkpoint_dir"), []
    diffs = (_differences(state.get("settings", {}), settings) if settings else []) + list(extra)
    blocked = [(name, line) for name, line in diffs if name not in allowed]
    if blocked:
        names = ",".join(sorted({name for name, _ in blocked}))
        return (f"checkpoint {where} was written by a run with different settings: "
                f"{'; '.join(line for _, line in blocked)}. Resuming would silently continue a different run. "
                f"To continue with the new values on purpose set resume_allow_changes='{names}' (any of "
                f"{', '.join(ALLOWABLE_CHANGES)}); otherwise use the original settings or another "
                f"checkpoint_dir"), []
    return None, diffs


# Settings only a worker knows: the global batch (the planner may choose it) and the compute dtype (the device's).
_DECIDED_BY_WORKERS = ("global_batch", "dtype")


def check_resume_settings(spec) -> None:
    """In the launching process, before any worker starts: ResumeMismatch when spec.checkpoint_location's newest
    verified checkpoint was written with other settings than `spec` asks for (those the spec alone decides; the
    message is the one a worker would give). Anything this cannot read or verify is left to the workers' resume,
    which also compares the model, the strategy and the settings only they know."""
    from fuseforge_flyte.data.shards import is_prepared_dir, read_manifest
    from fuseforge_flyte.training.data import resolve_benchmark

    root = spec.checkpoint_location
    if not root:
        return
    if resolve_benchmark(spec.dataset) is not None:
        data_manifest = None
    elif is_prepared_dir(spec.dataset):
        data_manifest = read_manifest(spec.dataset)
    else:  # data the workers prepare themselves: its identity is theirs to compare
        return
    try:
        reader = CheckpointReader(root, allow_unsigned=spec.allow_unsigned_checkpoints, log_it=False)
        newest = next(reader.verified_states(), None)
    except (CheckpointError, OSError, ValueError):
        return
    if newest is None:
        return
    entry, state = newest
    settings = {k: v for k, v in run_settings(spec, data_manifest, samples_per_step=0, dtype="").items()
                if k not in _DECIDED_BY_WORKERS}
    state = dict(state, settings={k: v for k, v in state.get("settings", {}).items() if k not in _DECIDED_BY_WORKERS})
    error, _ = settings_verdict(state, settings, parse_allowed_changes(spec.resume_allow_changes),
                                reader.store.path(entry.name))
    if error:
        raise ResumeMismatch(error)

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
            files[os.path.relpath(full, directory).replace(os.sep, "/")] = os.path.getsize(full)
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


def _free_bytes(path: str) -> Tuple[int, int]:
    """(free, total) bytes of the filesystem holding `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    usage = shutil.disk_usage(path)
    return usage.free, usage.total


def _size(n: float) -> str:
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


def _space_kind(err: BaseException) -> Optional[str]:
    """'disk' when err means a full disk/quota/file-size limit, 'bucket' for a full object store, else None."""
    for cause in _causes(err):
        text = str(cause).lower()
        if isinstance(cause, OSError) and cause.errno in _FULL_ERRNOS or any(t in text for t in _FULL_TEXT):
            return "disk"
        if any(t in text for t in _BUCKET_FULL_TEXT):
            return "bucket"
    return None


def _short(err: BaseException, limit: int = 400) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[:limit] + "..."


def _estimate_state_bytes(strategy) -> int:
    """fp32 weights + AdamW's two moments: a lower bound of a checkpoint before one was written."""
    numel = 0
    for param in strategy.model.parameters():
        numel += int(getattr(param, "ds_numel", 0) or param.numel())  # ZeRO-3 keeps an empty placeholder
    return numel * 4 * 3


@dataclass
class _Verdict:
    """Rank 0's reading of one checkpoint, broadcast to every rank."""

    reason: Optional[str] = None  # skip it (damaged, unverifiable) and try the previous one
    fatal: Optional[str] = None  # stop: verified, but from another model/strategy/settings
    state: Optional[Dict] = None
    marker: Optional[Dict] = None
    changed: Tuple[str, ...] = ()  # settings that differ, allowed by resume_allow_changes
    notes: List[str] = field(default_factory=list)


class _PhaseFailed(Exception):
    def __init__(self, failures: List[Tuple[int, str, Optional[str]]], error: Optional[BaseException]):
        super().__init__("; ".join(f"rank {rank}: {text}" for rank, text, _ in failures))
        self.failures = failures
        self.error = error


# ---------------------------------------------------------------- manager


class CheckpointReader:
    """Reads a checkpoint root and trusts only what verifies: signed manifests, hashed trainer states, signed
    skip marks. The workers' CheckpointManager builds on it; the launching process uses it alone to look at a
    run's checkpoints before any worker starts (check_resume_settings)."""

    def __init__(self, root: str, *, allow_unsigned: bool, log_it: bool):
        self.store = Store(root)
        try:
            self.signing = Signing(root, allow_unsigned=allow_unsigned, log_it=log_it)
        except SigningError as err:
            raise CheckpointError(str(err)) from None

    def verified_states(self) -> Iterator[Tuple[Entry, Dict]]:
        """(checkpoint, trainer state) of each complete, unskipped checkpoint that verifies, newest first."""
        for entry in reversed([e for e in self._entries(log_it=False) if e.complete and not e.skipped]):
            _, state, reason = self._read_verified(entry, warn=False)
            if reason is None:
                yield entry, state

    def _entries(self, log_it: bool) -> List[Entry]:
        """Rank 0: the store's checkpoints; a skip mark counts only when it is signed for its manifest."""
        entries = self.store.list()
        for entry in entries:
            if entry.complete and entry.marked:
                entry.skip_reason = self._trusted_skip_reason(entry, log_it)
        return entries

    def _trusted_skip_reason(self, entry: Entry, log_it: bool) -> Optional[str]:
        try:
            marker = json.loads(self.store.fs.cat_file(self.store.path(entry.name, MARKER)))
            mark = json.loads(self.store.fs.cat_file(self.store.path(entry.name, SKIPPED)))
        except (OSError, ValueError) as err:
            reason, problem = None, f"it cannot be read ({type(err).__name__}: {err})"
        else:
            reason, problem = self.signing.skip_reason(entry.name, marker, mark)
        if problem and log_it:
            log.warning("ignoring %s in checkpoint %s: %s", SKIPPED, self.store.path(entry.name), problem)
        return reason

    def _read_verified(self, entry: Entry, warn: bool) -> Tuple[Any, Optional[Dict], Optional[str]]:
        """(manifest, trainer state, None) once the manifest authenticates and the state matches its hash;
        (manifest or None, None, why not) otherwise. `warn`: log the opt-in warning for an unsigned one."""
        try:
            marker = json.loads(self.store.fs.cat_file(self.store.path(entry.name, MARKER)))
        except (OSError, ValueError) as err:
            return None, None, f"unreadable manifest {MARKER} ({type(err).__name__}: {err})"
        reason = self._authenticate(marker, entry, warn)
        if reason:
            return marker, None, reason
        try:
            data = self.store.fs.cat_file(self.store.path(entry.name, STATE))
        except OSError as err:
            return marker, None, f"file {STATE} is unreadable ({type(err).__name__}: {err})"
        reason = _check_bytes(STATE, data, marker["files"][STATE])
        if reason:
            return marker, None, reason
        try:
            state = json.loads(data)
        except ValueError as err:
            return marker, None, f"file {STATE} is not JSON ({err})"
        if not isinstance(state, dict) or state.get("step") != entry.step or state.get("format") != FORMAT_VERSION:
            return marker, None, f"{STATE} does not belong to step {entry.step} in format {FORMAT_VERSION}"
        return marker, state, None

    def _authenticate(self, marker: Any, entry: Entry, warn: bool = True) -> Optional[str]:
        """Why the manifest cannot be trusted, or None: its signature (checkpoint_signing.Signing), then its shape."""
        if not isinstance(marker, dict) or marker.get("format") != FORMAT_VERSION:
            version = marker.get("format", 1) if isinstance(marker, dict) else None
            return (f"manifest format {version!r}, this code reads {FORMAT_VERSION} (written by an older fuseforge "
                    f"without content hashes: it cannot be verified)")
        reason = self.signing.refusal(marker, self.store.path(entry.name), warn=warn)
        if reason:
            return reason
        if marker.get("step") != entry.step:
            return f"the manifest is for step {marker.get('step')!r}, not {entry.step}"
        return _manifest_shape_problem(marker)


class CheckpointManager(CheckpointReader):
    """Saves and resumes the training state of one strategy (all ranks call every method)."""

    def __init__(self, root: str, ctx: DistContext, strategy, *, keep_last: int, fingerprint: Dict[str, list],
                 model_config: Optional[Dict] = None, settings: Optional[Dict] = None, allow_changes: str = "",
                 allow_unsigned: bool = False, after_save: Optional[Callable[[str], None]] = None):
        """allow_unsigned: TrainSpec.allow_unsigned_checkpoints (see checkpoint_signing.py).
        after_save: called on rank 0 with the checkpoint directory once a save is complete (e.g. to upload it)."""
        super().__init__(root, allow_unsigned=allow_unsigned, log_it=ctx.is_main)
        self.after_save = after_save
        self.ctx = ctx
        self.strategy = strategy
        self.keep_last = keep_last
        self.fingerprint = fingerprint
        self.model_config = model_config_for_resume(model_config or {})
        self.settings = _jsonable(settings or {})
        self.allowed = parse_allowed_changes(allow_changes)
        self._progress_written_at = 0.0
        self.steps_redone = 0
        self.last_saved_step: Optional[int] = None
        self._last_total: Optional[int] = None  # bytes of the last checkpoint (rank 0)
        self._last_own: Optional[int] = None  # bytes this rank wrote into it (object stores: local staging)

    def path_of(self, step: int) -> str:
        """Where checkpoint `step` lives, as given (with the store's protocol)."""
        name = checkpoint_name(step)
        return self.store.path(name) if self.store.local else self.store.fs.unstrip_protocol(self.store.path(name))

    # ------------------------------------------------------------ collectives

    def _gather(self, obj: Any) -> List[Any]:
        if not (self.ctx.distributed and self.ctx.world_size > 1):
            return [obj]
        out: List[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj)
        return out

    def _phase(self, fn: Callable[[], Any], remote: bool = False) -> List[Any]:
        """fn() on every rank; every rank's result. A failure on any rank raises _PhaseFailed on all of them.

        `remote`: fn writes to the object store, so running out of space there means the bucket.
        """
        result, error = None, None
        try:
            result = fn()
        except _ERRORS as err:  # noqa: BLE001 - reported on every rank, then re-raised as CheckpointError
            error = err
        kind = None if error is None else _space_kind(error)
        summary = None if error is None else (_short(error), "bucket" if remote and kind else kind)
        gathered = self._gather((summary, result if error is None else None))
        failures = [(rank, s[0], s[1]) for rank, (s, _) in enumerate(gathered) if s is not None]
        if failures:
            raise _PhaseFailed(failures, error)
        return [r for _, r in gathered]

    # ------------------------------------------------------------ save

    def save(self, step: int, trainer_state: Dict) -> str:
        """Write checkpoint `step` (collective), then drop all but the newest keep_last; its path."""
        name = checkpoint_name(step)
        self._check_space(name)
        token = self.ctx.broadcast_object(uuid.uuid4().hex[:12])
        local = self.store.local
        work = (self.store.path(f"{_TMP_PREFIX}{name}-{token}") if local
                else tempfile.mkdtemp(prefix=f"fuseforge-{name}-"))
        try:
            if local:
                self._phase(lambda: os.makedirs(work) if self.ctx.is_main else None)
            self._phase(lambda: self._write(work, step, trainer_state))
            files = self._hash_written(work)
            if local:
                self._phase(lambda: self._commit_local(work, name, step, files) if self.ctx.is_main else None)
            else:
                self._commit_remote(work, name, step, files)
        except _PhaseFailed as failed:
            self._discard(work)
            raise self._save_error(name, failed) from failed.error
        finally:
            if not local:
                shutil.rmtree(work, ignore_errors=True)
        self._last_total = sum(entry["size"] for entry in files.values()) if files else self._last_total
        if self.ctx.is_main:
            try:
                self._prune()
            except OSError as err:
                log.warning("could not remove old checkpoints in %s: %s", self.store.path(""), err)
        if self.ctx.is_main and self.after_save is not None:
            self.after_save(self.store.path(""))
        self.ctx.barrier()
        self.last_saved_step = step
        if self.ctx.is_main:
            log.info("saved checkpoint %s", self.store.path(name))
        return self.path_of(step)

    def _write(self, work: str, step: int, trainer_state: Dict) -> None:
        os.makedirs(os.path.join(work, "rng"), exist_ok=True)
        self.strategy.save(work)
        torch.save(rng_state(self.ctx.device), os.path.join(work, "rng", f"rank_{self.ctx.rank:05d}.pt"))
        if self.ctx.is_main:
            with open(os.path.join(work, STATE), "w", encoding="utf-8") as handle:
                json.dump(dict(trainer_state, format=FORMAT_VERSION, step=step, strategy=self.strategy.name,
                               world_size=self.ctx.world_size, model_fingerprint=self.fingerprint,
                               model_config=self.model_config, settings=self.settings), handle)

    def _hash_written(self, work: str) -> Dict[str, Dict]:
        """{file: {size, sha256}} of the whole checkpoint on rank 0 ({} elsewhere), the hashing shared out."""
        if self.store.local:  # one shared directory: rank 0 deals the files out by size
            sizes = self.ctx.broadcast_object(_local_files(work) if self.ctx.is_main else None)
            loads = [0] * self.ctx.world_size
            share: List[List[str]] = [[] for _ in range(self.ctx.world_size)]
            for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
                rank = loads.index(min(loads))
                share[rank].append(rel)
                loads[rank] += sizes[rel]
            parts = self._phase(lambda: _digest_files(work, share[self.ctx.rank]))
        else:  # each rank's own staging directory, hashed before it is uploaded
            parts = self._phase(lambda: _digest_files(work, sorted(_local_files(work))))
            self._last_own = sum(e["size"] for e in parts[self.ctx.rank].values())
        files: Dict[str, Dict] = {}
        for rank, part in enumerate(parts):
            for rel, entry in part.items():
                if rel in files:
                    raise CheckpointError(f"two ranks wrote {rel} into the same checkpoint")
                files[rel] = entry
        return files if self.ctx.is_main else {}

    def _marker(self, step: int, files: Dict[str, Dict]) -> Dict:
        body: Dict[str, Any] = {"format": FORMAT_VERSION, "step": step, "strategy": self.strategy.name,
                                "world_size": self.ctx.world_size, "time": time.time(), "files": files}
        return self.signing.sign(body)

    def _commit_local(self, work: str, name: str, step: int, files: Dict[str, Dict]) -> None:
        with open(os.path.join(work, MARKER), "w", encoding="utf-8") as handle:
            json.dump(self._marker(step, files), handle)
        _fsync_tree(work)
        final = self.store.path(name)
        if os.path.exists(final):  # an incomplete or skipped leftover of an earlier attempt
            shutil.rmtree(final)
        os.replace(work, final)

    def _commit_remote(self, work: str, name: str, step: int, files: Dict[str, Dict]) -> None:
        fs, final = self.store.fs, self.store.path(name)

        def clear():
            if self.ctx.is_main and fs.exists(final):
                fs.rm(final, recursive=True)

        def upload():  # every rank uploads what it wrote
            for rel in sorted(_local_files(work)):
                fs.makedirs(os.path.dirname(f"{final}/{rel}"), exist_ok=True)
                fs.put_file(os.path.join(work, rel), f"{final}/{rel}")

        self._phase(clear, remote=True)
        self._phase(upload, remote=True)
        self._phase(lambda: self.store.write_json(self._marker(step, files), name, MARKER)
                    if self.ctx.is_main else None, remote=True)

    def _discard(self, work: str) -> None:
        """Remove a failed save's partial files (they may be what filled the disk)."""
        if self.store.local:
            if self.ctx.is_main:
                shutil.rmtree(work, ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)

    def _save_error(self, name: str, failed: _PhaseFailed) -> CheckpointError:
        kinds = {kind for _, _, kind in failed.failures}
        rank, first, _ = failed.failures[0]
        where = self.store.root if self.store.local else tempfile.gettempdir()
        if "disk" in kinds:
            free, total = _free_bytes(self.store.root if self.store.local else tempfile.gettempdir())
            need = self._expected_total()
            return CheckpointError(
                f"writing checkpoint {name} failed: the disk holding {where} is full (or a quota or file-size "
                f"limit was hit): {_size(free)} free of {_size(total)}, and a checkpoint takes about {_size(need)}. "
                f"keep_last={self.keep_last} needs room for {self.keep_last + 1} checkpoints while the newest is "
                f"written: free space, lower keep_last, or use a bigger volume. (rank {rank}: {first})")
        if "bucket" in kinds:
            return CheckpointError(
                f"uploading checkpoint {name} to {self.store.fs.unstrip_protocol(self.store.root)} failed: the store "
                f"is full or over its quota: free space or raise the quota, or lower keep_last. "
                f"(rank {rank}: {first})")
        return CheckpointError(f"writing checkpoint {name} failed on rank {rank}: {first}")

    def _expected_total(self) -> int:
        return self._last_total if self._last_total else _estimate_state_bytes(self.strategy)

    def _check_space(self, name: str) -> None:
        """Refuse to start a save that cannot fit: the size of the last checkpoint (or an estimate)."""
        need_total = self._expected_total()
        basis = "the size of the last one" if self._last_total else "estimated from the model and optimizer state"
        problem = None
        if self.store.local:
            if self.ctx.is_main:
                free, total = _free_bytes(self.store.root)
                if free < need_total:
                    problem = (f"not enough free space for checkpoint {name} in {self.store.root}: {_size(free)} "
                               f"free of {_size(total)}, and a checkpoint takes about {_size(need_total)} ({basis}). "
                               f"keep_last={self.keep_last} holds {self.keep_last + 1} checkpoints while the newest "
                               f"is written (about {_size((self.keep_last + 1) * need_total)}): free space, lower "
                               f"keep_last, or use a bigger volume")
            problem = self.ctx.broadcast_object(problem)
        else:  # the bucket's space is unknown; the local staging directory's is not
            need = self._last_own if self._last_own is not None else need_total // self.ctx.world_size
            free, total = _free_bytes(tempfile.gettempdir())
            if free < need:
                problem = (f"rank {self.ctx.rank}: not enough free space in {tempfile.gettempdir()} to stage "
                           f"checkpoint {name} before uploading it: {_size(free)} free of {_size(total)}, about "
                           f"{_size(need)} needed (set TMPDIR to a bigger volume)")
            problem = next((p for p in self._gather(problem) if p), None)
        if problem:
            raise CheckpointError(problem)

    def _prune(self) -> None:
        entries = self._entries(log_it=False)
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
        """Verify, then load, the newest loadable complete checkpoint into the strategy; its trainer state, or None.

        Raises CheckpointError when complete checkpoints exist but none can be loaded, or when a
        verified one belongs to another model, strategy or settings.
        """
        entries = self.ctx.broadcast_object(self._scan() if self.ctx.is_main else None)
        complete = [e for e in entries if e.complete]
        failures: List[Tuple[Entry, Any, str]] = []  # (checkpoint, its manifest if read, why it failed)
        for entry in reversed(complete):
            if entry.skipped:
                if self.ctx.is_main:
                    log.warning("skipping checkpoint %s: marked %s by an earlier attempt (%s)",
                                self.store.path(entry.name), SKIPPED, entry.skip_reason)
                continue
            verdict: _Verdict = self.ctx.broadcast_object(self._verify(entry) if self.ctx.is_main else None)
            if verdict.fatal:
                raise ResumeMismatch(verdict.fatal)
            reason = verdict.reason or self._load(entry, verdict.marker, verdict.changed)
            if reason is None:
                if self.ctx.is_main:
                    for failed, marker, why in failures:
                        self._mark_skipped(failed, marker, why)
                    for note in verdict.notes:
                        log.warning("%s", note)
                    log.info("resumed from checkpoint %s", self.store.path(entry.name))
                self._last_total = sum(e["size"] for e in verdict.marker["files"].values())
                self.last_saved_step = entry.step
                return verdict.state
            if self.ctx.is_main:
                log.warning("skipping checkpoint %s: %s", self.store.path(entry.name), reason)
            failures.append((entry, verdict.marker, reason))
        if complete:
            detail = "; ".join(f"{e.name}: {why}" for e, _, why in failures) or \
                "all were marked SKIPPED by an earlier attempt"
            raise CheckpointError(
                f"checkpoint_dir {self.store.path('')!r} holds checkpoints but none can be loaded ({detail}); "
                f"refusing to start fresh over them: fix or move them, or use another checkpoint_dir"
            )
        return None

    def saved_global_batch(self) -> Optional[int]:
        """The global batch (sequences per step) of the newest complete checkpoint, or None; read before
        resuming so that a planned run keeps it on another world size. Only a hint: resume() verifies."""

        def read() -> Optional[int]:  # only from a trainer state whose manifest verifies
            for _, state in self.verified_states():
                try:
                    return int(state["settings"]["global_batch"])
                except (ValueError, KeyError, TypeError):
                    pass
            return None

        return self.ctx.broadcast_object(read() if self.ctx.is_main else None)

    def _scan(self) -> List[Entry]:
        entries = self._entries(log_it=True)
        if self.store.local and os.path.isdir(self.store.root):
            for name in os.listdir(self.store.root):
                if name.startswith(_TMP_PREFIX):
                    log.warning("removing unfinished checkpoint write %s", self.store.path(name))
                    shutil.rmtree(self.store.path(name), ignore_errors=True)
        for entry in entries:
            if not entry.complete:
                log.warning("ignoring incomplete checkpoint %s (no %s marker)", self.store.path(entry.name), MARKER)
        return entries

    def _verify(self, entry: Entry) -> _Verdict:
        """Rank 0: authenticate the manifest, check the trainer state's hash, then its fit to this run."""
        marker, state, reason = self._read_verified(entry, warn=True)
        if reason:
            return _Verdict(reason=reason, marker=marker)
        fatal, changed = self._compatibility(state, self.store.path(entry.name))
        if fatal:
            return _Verdict(fatal=fatal)
        notes = []
        if changed:
            notes.append(f"resuming with changed settings (allowed by resume_allow_changes): "
                         f"{', '.join(line for _, line in changed)}")
        return _Verdict(state=state, marker=marker, changed=tuple(sorted({name for name, _ in changed})), notes=notes)

    def _compatibility(self, state: Dict, where: str) -> Tuple[Optional[str], List[Tuple[str, str]]]:
        """(error, allowed differences): a verified checkpoint of another model/strategy/settings is an error."""
        if state.get("strategy") != self.strategy.name:
            return (f"checkpoint {where} was written with strategy {state.get('strategy')!r}, this run uses "
                    f"{self.strategy.name!r} (checkpoint formats differ per strategy); {_REFUSE}"), []
        mismatch = _fingerprint_mismatch(state.get("model_fingerprint", {}), self.fingerprint)
        if mismatch:
            return f"checkpoint {where} was written for a different model: {mismatch}; {_REFUSE}", []
        diffs = []
        if self.model_config:
            diffs = [("model_config", f"model_config.{line}")
                     for _, line in _differences(state.get("model_config", {}), self.model_config)]
        return settings_verdict(state, self.settings, self.allowed, where, extra=diffs)

    def _load(self, entry: Entry, marker: Dict, changed: Tuple[str, ...]) -> Optional[str]:
        """Check every file against the manifest, then load on every rank; the first reason it failed, or None."""
        files = marker["files"]
        staging = None
        try:
            if self.store.local:
                directory = self.store.path(entry.name)
                reason = self._first_reason(lambda: self._check_in_place(directory, files))
            else:
                staging = directory = tempfile.mkdtemp(prefix=f"fuseforge-{entry.name}-")
                reason = self._first_reason(lambda: self._download_checked(entry, files, staging))
            if reason is None:
                reason = self._first_reason(lambda: self._load_checked(directory, changed), loading=True)
        finally:
            if staging:
                shutil.rmtree(staging, ignore_errors=True)
        return reason

    def _first_reason(self, fn: Callable[[], Optional[str]], loading: bool = False) -> Optional[str]:
        """fn() on every rank (a reason, or None); the first rank's reason, on every rank."""
        try:
            reason = fn()
        except _ERRORS as err:  # noqa: BLE001 - any failure means "try the previous checkpoint"
            what = "loading failed" if loading else "checking failed"
            reason = f"{what} on rank {self.ctx.rank} ({_short(err, 600)})"
            if not self.ctx.is_main:
                log.warning("%s", reason)
        return next((r for r in self._gather(reason) if r), None)

    def _check_in_place(self, directory: str, files: Dict[str, Dict]) -> Optional[str]:
        names = sorted(files)
        for rel in names[self.ctx.rank::self.ctx.world_size]:
            reason = _check_file(os.path.join(directory, rel), rel, files[rel])
            if reason:
                return reason
        if self.ctx.is_main:  # a loader may pick a file up by name (another world size's shard, say)
            extra = sorted(rel for rel in _local_files(directory) if rel not in files and rel != MARKER
                           and not rel.startswith(SKIPPED))
            if extra:
                return f"file {extra[0]} is not in the manifest"
        return None

    def _download_checked(self, entry: Entry, files: Dict[str, Dict], staging: str) -> Optional[str]:
        names = sorted(files)
        local = [os.path.join(staging, *rel.split("/")) for rel in names]
        for path in local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            self.store.fs.get([self.store.path(entry.name, rel) for rel in names], local)
        except FileNotFoundError as err:
            return f"a file of the manifest is missing from the store ({err})"
        for rel, path in zip(names, local):
            reason = _check_file(path, rel, files[rel])
            if reason:
                return reason
        return None

    def _load_checked(self, directory: str, changed: Tuple[str, ...]) -> None:
        self.strategy.load(directory)
        rng_file = os.path.join(directory, "rng", f"rank_{self.ctx.rank:05d}.pt")
        if os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=True), self.ctx.device)
        else:
            log.warning("rank %d: no RNG state in %s (world size changed?); keeping the seeded RNG",
                        self.ctx.rank, directory)
        if _SCHEDULE & set(changed):
            self._apply_schedule()

    def _apply_schedule(self) -> None:
        """Allowed lr/weight_decay/steps/warmup changes: the restored optimizer and schedule take the new values.

        (Their state dicts hold the old base lr, weight decay and schedule length.)
        """
        scheduler = getattr(self.strategy, "scheduler", None)
        if scheduler is None or not hasattr(scheduler, "lr_lambdas"):
            return
        optimizer = scheduler.optimizer
        lr, wd = float(self.settings["lr"]), float(self.settings["weight_decay"])
        for fn in scheduler.lr_lambdas:
            if hasattr(fn, "warmup") and hasattr(fn, "total"):
                fn.warmup, fn.total = int(self.settings["warmup_steps"]), int(self.settings["steps"])
        scheduler.base_lrs = [lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["initial_lr"] = lr
        optimizer.param_groups[0]["weight_decay"] = wd  # optim.param_groups: the decayed group comes first
        for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * fn(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

    def _mark_skipped(self, entry: Entry, marker: Any, reason: str) -> None:
        """Record, signed and bound to its manifest, that `entry` failed and an older checkpoint was used, so that
        later resumes pass it over without checking it again (none without a key or a readable manifest)."""
        mark = self.signing.skip_mark(entry.name, marker, reason)
        if mark is None:
            return
        try:
            self.store.write_json(mark, entry.name, SKIPPED)
        except OSError as err:
            log.warning("could not mark %s as skipped: %s", entry.name, err)

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
