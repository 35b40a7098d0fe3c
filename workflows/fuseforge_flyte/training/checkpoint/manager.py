"""Saving and resuming one strategy's training state, on every rank together.

Save: every rank writes its part (sharded state is written sharded: DCP for FSDP, DeepSpeed's own format for ZeRO;
gathering a full state on rank 0 would need the whole model + optimizer in one host's memory), every file is
hashed once right after it is written (integrity.py; on a local filesystem the files are shared out over the
ranks, for an object store each rank hashes its local files before uploading them), and rank 0 writes the signed
manifest last (storage.py says why a kill at any point leaves the previous checkpoint loadable). The free space
is checked first (space.py).

Resume: the newest complete checkpoint whose manifest authenticates (reader.py) and that fits this run
(compatibility.py) is checked file by file against its manifest before anything is loaded: on a local filesystem
in place (shared out over the ranks, and no file outside the manifest may be there, since a loader could pick it up
by name); from an object store only the listed files are downloaded, into a private directory, and checked there,
so what is loaded is what was checked. Local filesystems are not defended against a writer racing the resume
(between the check and the load); object stores are (the checked copy is private to the pod).

Corrupt vs incompatible: a checkpoint that fails verification or loading is skipped with a warning naming the
reason (marked SKIPPED, signed and bound to its manifest, once an older one loads; a later resume passes it over
with a warning naming that reason, and ignores, with a warning, a mark that is not signed for its manifest) and the
previous one is tried; if checkpoints exist and none loads, training stops instead of starting fresh over them. A
verified checkpoint of another model, strategy or settings stops the run at once (ResumeMismatch), and so does
one whose files match its manifest but whose DCP metadata or DeepSpeed files would run code (dcp_metadata.py:
changed on purpose).
Pruning removes only what a save wrote (layout.py).

Another root to resume from (TrainSpec.resume_from, e.g. a read-only copy of good checkpoints) is read like
checkpoint_dir and never written: no pruning, no progress record, no skip mark, no temp file. Its checkpoints and
checkpoint_dir's are tried newest first (checkpoint_dir's on a tie), so a restart continues from what this run has
saved since. With checkpoint_dir off (root None) nothing is saved at all.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from fuseforge_flyte.training.checkpoint.collectives import PhaseFailed, first_reason, gather, on_every_rank
from fuseforge_flyte.training.checkpoint.compatibility import (checkpoint_verdict, jsonable, model_config_for_resume,
                                                               parse_allowed_changes)
from fuseforge_flyte.training.checkpoint import dcp_metadata
from fuseforge_flyte.training.checkpoint.errors import CheckpointError, CheckpointUserError, ResumeMismatch
from fuseforge_flyte.training.checkpoint.integrity import check_file, digest_files
from fuseforge_flyte.training.checkpoint.layout import (FORMAT_VERSION, MARKER, SKIPPED, STATE, TMP_PREFIX, Entry,
                                                        checkpoint_name, foreign_names, temp_dir, temp_file)
from fuseforge_flyte.training.checkpoint.progress import Progress
from fuseforge_flyte.training.checkpoint.reader import CheckpointReader, newest_verified
from fuseforge_flyte.training.checkpoint.rng import rng_state, set_rng_state
from fuseforge_flyte.training.checkpoint.schedule import Retarget
from fuseforge_flyte.training.checkpoint.space import estimate_state_bytes, free_bytes, size_text
from fuseforge_flyte.training.checkpoint.storage import fsync_tree, local_files
from fuseforge_flyte.training.distributed import DistContext

log = logging.getLogger("fuseforge.training")


@dataclass
class _Verdict:
    """Rank 0's reading of one checkpoint, broadcast to every rank."""

    reason: Optional[str] = None  # skip it (damaged, unverifiable) and try the previous one
    fatal: Optional[str] = None  # stop: verified, but from another model/strategy/settings
    state: Optional[Dict] = None
    marker: Optional[Dict] = None
    changed: Tuple[str, ...] = ()  # settings that differ, allowed by resume_allow_changes
    notes: List[str] = field(default_factory=list)


class CheckpointManager(CheckpointReader):
    """Saves and resumes the training state of one strategy (all ranks call every method)."""

    def __init__(self, root: Optional[str], ctx: DistContext, strategy, *, keep_last: int,
                 fingerprint: Dict[str, list], model_config: Optional[Dict] = None, settings: Optional[Dict] = None,
                 allow_changes: str = "", allow_unsigned: bool = False,
                 after_save: Optional[Callable[[str], None]] = None, resume_from: Optional[str] = None):
        """root: checkpoint_dir, where saves go; None: nothing is saved (then resume_from is needed).
        resume_from: TrainSpec.resume_from, another root resumes read from and never write.
        allow_unsigned: TrainSpec.allow_unsigned_checkpoints (see signing.py).
        after_save: called on rank 0 with the checkpoint directory once a save is complete (e.g. to upload it)."""
        if root is None and not resume_from:
            raise ValueError("CheckpointManager needs a checkpoint_dir or a resume_from")
        super().__init__(root or resume_from, allow_unsigned=allow_unsigned, log_it=ctx.is_main)
        self.saves = root is not None  # checkpoint_dir is set: saves, pruning and the progress record go there
        self.origin: Optional[CheckpointReader] = None  # resume_from's root (self when checkpoint_dir is off)
        if resume_from and root is not None:
            self.origin = CheckpointReader(resume_from, allow_unsigned=allow_unsigned, log_it=False)
        elif resume_from:
            self.origin = self
        self.after_save = after_save
        self.ctx = ctx
        self.strategy = strategy
        self.keep_last = keep_last
        self.fingerprint = fingerprint
        self.model_config = model_config_for_resume(model_config or {})
        self.settings = jsonable(settings or {})
        self.allowed = parse_allowed_changes(allow_changes)
        self.progress = Progress(self.store, ctx, self.signing)
        self._carried: Optional[Dict] = None  # the progress record in the resumed checkpoint's trainer state
        self.last_saved_step: Optional[int] = None
        self._last_total: Optional[int] = None  # bytes of the last checkpoint (rank 0)
        self._last_own: Optional[int] = None  # bytes this rank wrote into it (object stores: local staging)

    def path_of(self, step: int) -> str:
        """Where checkpoint `step` lives, as given (with the store's protocol)."""
        name = checkpoint_name(step)
        return self.store.path(name) if self.store.local else self.store.fs.unstrip_protocol(self.store.path(name))

    # ------------------------------------------------------------ save

    def save(self, step: int, trainer_state: Dict) -> str:
        """Write checkpoint `step` (collective), then drop all but the newest keep_last; its path."""
        if not self.saves:
            raise CheckpointError("checkpoint_dir is off: this run saves no checkpoint")
        name = checkpoint_name(step)
        self._check_space(name)
        token = self.ctx.broadcast_object(uuid.uuid4().hex[:12])
        local = self.store.local
        work = (self.store.path(f"{TMP_PREFIX}{name}-{token}") if local
                else tempfile.mkdtemp(prefix=f"fuseforge-{name}-"))
        try:
            if local:
                on_every_rank(self.ctx, lambda: os.makedirs(work) if self.ctx.is_main else None)
            on_every_rank(self.ctx, lambda: self._write(work, step, trainer_state))
            files = self._hash_written(work)
            if local:
                on_every_rank(self.ctx,
                              lambda: self._commit_local(work, name, step, files) if self.ctx.is_main else None)
            else:
                self._commit_remote(work, name, step, files)
        except PhaseFailed as failed:
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
                               progress=self.progress.saved(),
                               world_size=self.ctx.world_size, model_fingerprint=self.fingerprint,
                               model_config=self.model_config, settings=self.settings), handle)

    def _hash_written(self, work: str) -> Dict[str, Dict]:
        """{file: {size, sha256}} of the whole checkpoint on rank 0 ({} elsewhere), the hashing shared out."""
        if self.store.local:  # one shared directory: rank 0 deals the files out by size
            sizes = self.ctx.broadcast_object(local_files(work) if self.ctx.is_main else None)
            loads = [0] * self.ctx.world_size
            share: List[List[str]] = [[] for _ in range(self.ctx.world_size)]
            for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
                rank = loads.index(min(loads))
                share[rank].append(rel)
                loads[rank] += sizes[rel]
            parts = on_every_rank(self.ctx, lambda: digest_files(work, share[self.ctx.rank]))
        else:  # each rank's own staging directory, hashed before it is uploaded
            parts = on_every_rank(self.ctx, lambda: digest_files(work, sorted(local_files(work))))
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
        fsync_tree(work)
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
            for rel in sorted(local_files(work)):
                fs.makedirs(os.path.dirname(f"{final}/{rel}"), exist_ok=True)
                fs.put_file(os.path.join(work, rel), f"{final}/{rel}")

        on_every_rank(self.ctx, clear, remote=True)
        on_every_rank(self.ctx, upload, remote=True)
        on_every_rank(self.ctx, lambda: self.store.write_json(self._marker(step, files), name, MARKER)
                    if self.ctx.is_main else None, remote=True)

    def _discard(self, work: str) -> None:
        """Remove a failed save's partial files (they may be what filled the disk)."""
        if self.store.local:
            if self.ctx.is_main:
                shutil.rmtree(work, ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)

    def _save_error(self, name: str, failed: PhaseFailed) -> CheckpointError:
        kinds = {kind for _, _, kind in failed.failures}
        rank, first, _ = failed.failures[0]
        where = self.store.root if self.store.local else tempfile.gettempdir()
        if "readonly" in kinds:
            return CheckpointUserError(
                f"writing checkpoint {name} failed: {where} is not writable (rank {rank}: {first}): make it "
                f"writable, or set checkpoint_dir to a directory this run can write")
        if "disk" in kinds:
            free, total = free_bytes(self.store.root if self.store.local else tempfile.gettempdir())
            need = self._expected_total()
            return CheckpointUserError(
                f"writing checkpoint {name} failed: the disk holding {where} is full (or a quota or file-size "
                f"limit was hit): {size_text(free)} free of {size_text(total)}, and a checkpoint takes about "
                f"{size_text(need)}. "
                f"keep_last={self.keep_last} needs room for {self.keep_last + 1} checkpoints while the newest is "
                f"written: free space, lower keep_last, or use a bigger volume. (rank {rank}: {first})")
        if "bucket" in kinds:
            return CheckpointUserError(
                f"uploading checkpoint {name} to {self.store.fs.unstrip_protocol(self.store.root)} failed: the store "
                f"is full or over its quota: free space or raise the quota, or lower keep_last. "
                f"(rank {rank}: {first})")
        return CheckpointError(f"writing checkpoint {name} failed on rank {rank}: {first}")

    def _expected_total(self) -> int:
        return self._last_total if self._last_total else estimate_state_bytes(self.strategy)

    def _check_space(self, name: str) -> None:
        """Refuse to start a save that cannot fit: the size of the last checkpoint (or an estimate)."""
        need_total = self._expected_total()
        basis = "the size of the last one" if self._last_total else "estimated from the model and optimizer state"
        problem = None
        if self.store.local:
            if self.ctx.is_main:
                free, total = free_bytes(self.store.root)
                if free < need_total:
                    problem = (f"not enough free space for checkpoint {name} in {self.store.root}: "
                               f"{size_text(free)} free of {size_text(total)}, and a checkpoint takes about "
                               f"{size_text(need_total)} ({basis}). "
                               f"keep_last={self.keep_last} holds {self.keep_last + 1} checkpoints while the newest "
                               f"is written (about {size_text((self.keep_last + 1) * need_total)}): free space, lower "
                               f"keep_last, or use a bigger volume")
            problem = self.ctx.broadcast_object(problem)
        else:  # the bucket's space is unknown; the local staging directory's is not
            need = self._last_own if self._last_own is not None else need_total // self.ctx.world_size
            free, total = free_bytes(tempfile.gettempdir())
            if free < need:
                problem = (f"rank {self.ctx.rank}: not enough free space in {tempfile.gettempdir()} to stage "
                           f"checkpoint {name} before uploading it: {size_text(free)} free of {size_text(total)}, "
                           f"about {size_text(need)} needed (set TMPDIR to a bigger volume)")
            problem = next((p for p in gather(self.ctx, problem) if p), None)
        if problem:
            raise CheckpointUserError(problem)

    def _prune(self) -> None:
        entries = self._entries(log_it=False)
        good = [e for e in entries if e.complete and not e.skipped]
        for entry in good[: max(0, len(good) - self.keep_last)]:
            if not self._ours(entry.name):
                continue
            self.store.remove(entry.name)
            log.info("removed old checkpoint %s (keep_last=%d)", entry.name, self.keep_last)
        for entry in entries:  # incomplete: older ones can never finish, newer ones are an earlier attempt's
            if not entry.complete and self._ours(entry.name):
                self.store.remove(entry.name)
                log.info("removed incomplete checkpoint %s (left by an interrupted save)", self.store.path(entry.name))
        self._remove_temp()

    def _ours(self, name: str) -> bool:
        """Whether directory `name` holds only what a save writes; otherwise it is the user's: kept, and said."""
        foreign = foreign_names(self.store.names(name))
        if foreign:
            log.warning("leaving %s alone: it holds %s, which no checkpoint save writes (move it out of the "
                        "checkpoint_dir)", self.store.path(name), ", ".join(foreign[:3]))
        return not foreign

    def _remove_temp(self) -> None:
        """Rank 0, local filesystem: remove what an interrupted write left (its temp names only), saying so."""
        if not (self.store.local and os.path.isdir(self.store.root)):
            return
        for name in sorted(os.listdir(self.store.root)):
            path = self.store.path(name)
            try:
                if temp_dir(name) and os.path.isdir(path):
                    log.warning("removing unfinished checkpoint write %s", path)
                    shutil.rmtree(path)
                elif temp_file(name) and os.path.isfile(path):
                    log.warning("removing %s, left by an interrupted write", path)
                    os.unlink(path)
            except OSError as err:
                log.warning("could not remove %s: %s", path, err)

    # ------------------------------------------------------------ resume

    def _sources(self) -> List[CheckpointReader]:
        """The roots resumes read: checkpoint_dir (when it is set), then resume_from."""
        return [r for r in ((self if self.saves else None), self.origin) if r is not None]

    def _writable(self, reader: CheckpointReader) -> bool:
        """Whether checkpoints of `reader` may be written to (skip marks, leftovers removed): checkpoint_dir's only."""
        return reader is self and self.saves

    def _option(self, reader: CheckpointReader) -> str:
        return "checkpoint_dir" if self._writable(reader) else "resume_from"

    def resume(self) -> Optional[Dict]:
        """Verify, then load, the newest loadable complete checkpoint into the strategy; its trainer state, or None.

        Raises CheckpointError when complete checkpoints exist but none can be loaded, or when a
        verified one belongs to another model, strategy or settings; CheckpointUserError when resume_from does
        not exist or holds no complete checkpoint.
        """
        sources = self._sources()
        scanned = self.ctx.broadcast_object(self._scan_sources(sources) if self.ctx.is_main else None)
        if isinstance(scanned, str):
            raise CheckpointUserError(scanned)
        # newest first; on a tie checkpoint_dir's (what this run saved) before resume_from's
        candidates = sorted(((index, e) for index, entries in enumerate(scanned) for e in entries if e.complete),
                            key=lambda item: (item[1].step, -item[0]))
        failures: List[Tuple[CheckpointReader, Entry, Any, str]] = []  # (root, checkpoint, manifest if read, why)
        for index, entry in reversed(candidates):
            reader = sources[index]
            where = reader.store.path(entry.name)
            if entry.skipped:
                if self.ctx.is_main:
                    log.warning("skipping checkpoint %s: marked %s by an earlier attempt (%s)",
                                where, SKIPPED, entry.skip_reason)
                continue
            verdict: _Verdict = self.ctx.broadcast_object(self._verify(reader, entry) if self.ctx.is_main else None)
            if verdict.fatal:
                raise ResumeMismatch(verdict.fatal)
            reason = verdict.reason or self._load(reader, entry, verdict.marker, verdict.changed)
            if reason is None:
                if self.ctx.is_main:
                    for failed_reader, failed, marker, why in failures:
                        self._mark_skipped(failed_reader, failed, marker, why)
                    for note in verdict.notes:
                        log.warning("%s", note)
                    log.info("resumed from checkpoint %s%s", where,
                             "" if self._writable(reader) else " (resume_from: read only, nothing is written there)")
                self._last_total = sum(e["size"] for e in verdict.marker["files"].values())
                self.last_saved_step = entry.step if self._writable(reader) else None
                self._carried = verdict.state.get("progress")
                return verdict.state
            if self.ctx.is_main:
                log.warning("skipping checkpoint %s: %s", where, reason)
            failures.append((reader, entry, verdict.marker, reason))
        if candidates:
            held = sorted({index for index, _ in candidates})
            roots = " and ".join(f"{self._option(sources[i])} {sources[i].store.path('')!r}" for i in held)
            detail = "; ".join(f"{e.name if len(held) == 1 else r.store.path(e.name)}: {why}"
                               for r, e, _, why in failures) or "all were marked SKIPPED by an earlier attempt"
            raise CheckpointUserError(
                f"{roots} hold{'s' if len(held) == 1 else ''} checkpoints but none can be loaded ({detail}); "
                f"refusing to start fresh over them: fix or move them, or use another "
                f"{' or '.join(self._option(sources[i]) for i in held)}"
            )
        return None

    def saved_global_batch(self) -> Optional[int]:
        """The global batch (sequences per step) of the newest complete checkpoint, or None; read before
        resuming so that a planned run keeps it on another world size. Only a hint: resume() verifies."""

        def read() -> Optional[int]:  # only from a trainer state whose manifest verifies, the newest of any root
            newest = newest_verified(self._sources())
            try:
                return int(newest[2]["settings"]["global_batch"]) if newest else None
            except (ValueError, KeyError, TypeError):
                return None

        return self.ctx.broadcast_object(read() if self.ctx.is_main else None)

    def _scan_sources(self, sources: List[CheckpointReader]):
        """Rank 0: each root's checkpoints, or (a str) why resume_from cannot be resumed from."""
        scanned = []
        for reader in sources:
            if not self._writable(reader):
                where = reader.store.given
                if not reader.store.fs.exists(reader.store.root):
                    return f"resume_from {where!r} does not exist: set it to a folder or URI that holds checkpoints"
            entries = self._scan(reader)
            if not self._writable(reader) and not any(e.complete for e in entries):
                return (f"resume_from {where!r} holds no checkpoint (no step_* folder with its {MARKER} manifest): "
                        f"set it to a folder that holds this run's checkpoints, or leave it empty")
            scanned.append(entries)
        return scanned

    def _scan(self, reader: CheckpointReader) -> List[Entry]:
        entries = reader._entries(log_it=True)
        if self._writable(reader):
            self._remove_temp()
        for entry in entries:
            if not entry.complete:
                log.warning("ignoring incomplete checkpoint %s (no %s marker)", reader.store.path(entry.name), MARKER)
        return entries

    def _verify(self, reader: CheckpointReader, entry: Entry) -> _Verdict:
        """Rank 0: authenticate the manifest, check the trainer state's hash, then its fit to this run."""
        marker, state, reason = reader._read_verified(entry, warn=True)
        if reason:
            return _Verdict(reason=reason, marker=marker)
        fatal, changed = self._compatibility(state, reader.store.path(entry.name))
        if fatal:
            return _Verdict(fatal=fatal)
        notes = []
        if changed:
            notes.append(f"resuming with changed settings (allowed by resume_allow_changes): "
                         f"{', '.join(line for _, line in changed)}")
        return _Verdict(state=state, marker=marker, changed=tuple(sorted({name for name, _ in changed})), notes=notes)

    def _compatibility(self, state: Dict, where: str) -> Tuple[Optional[str], List[Tuple[str, str]]]:
        """(error, allowed differences): a verified checkpoint of another model/strategy/settings is an error."""
        return checkpoint_verdict(state, where, strategy=self.strategy.name, fingerprint=self.fingerprint,
                                  model_config=self.model_config, settings=self.settings, allowed=self.allowed)

    def _load(self, reader: CheckpointReader, entry: Entry, marker: Dict, changed: Tuple[str, ...]) -> Optional[str]:
        """Check every file against the manifest, then load on every rank; the first reason it failed, or None."""
        files = marker["files"]
        staging = None
        try:
            if reader.store.local:
                directory = reader.store.path(entry.name)
                reason = first_reason(self.ctx, lambda: self._check_in_place(directory, files))
            else:
                staging = directory = tempfile.mkdtemp(prefix=f"fuseforge-{entry.name}-")
                reason = first_reason(self.ctx, lambda: self._download_checked(reader, entry, files, staging))
            if reason is None:
                self._refuse_code(reader.store.path(entry.name), directory, files)
                reason = first_reason(self.ctx, lambda: self._load_checked(directory, changed), loading=True)
        finally:
            if staging:
                shutil.rmtree(staging, ignore_errors=True)
        return reason

    def _refuse_code(self, where: str, directory: str, files: Dict[str, Dict]) -> None:
        """Stop, on every rank, when a checked checkpoint holds a DCP or DeepSpeed pickle that could run code
        (dcp_metadata.py). Its files match its manifest, so no torn write or bit rot made it: falling back to an
        older checkpoint would hide a deliberate change, so the run stops and says where."""
        refused = self.ctx.broadcast_object(dcp_metadata.refusal(directory, files) if self.ctx.is_main else None)
        if refused:
            raise CheckpointUserError(
                f"checkpoint {where}: {refused}; its files match its manifest, so it was changed on purpose, not "
                f"damaged. Nothing of it was loaded and the run stops instead of falling back to an older "
                f"checkpoint: delete {where}, check who can write to the checkpoint_dir, then rerun")

    def _check_in_place(self, directory: str, files: Dict[str, Dict]) -> Optional[str]:
        names = sorted(files)
        for rel in names[self.ctx.rank::self.ctx.world_size]:
            reason = check_file(os.path.join(directory, rel), rel, files[rel])
            if reason:
                return reason
        if self.ctx.is_main:  # a loader may pick a file up by name (another world size's shard, say)
            extra = sorted(rel for rel in local_files(directory) if rel not in files and rel != MARKER
                           and not rel.startswith(SKIPPED))
            if extra:
                return f"file {extra[0]} is not in the manifest"
        return None

    def _download_checked(self, reader: CheckpointReader, entry: Entry, files: Dict[str, Dict],
                          staging: str) -> Optional[str]:
        names = sorted(files)
        local = [os.path.join(staging, *rel.split("/")) for rel in names]
        for path in local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            reader.store.fs.get([reader.store.path(entry.name, rel) for rel in names], local)
        except FileNotFoundError as err:
            return f"a file of the manifest is missing from the store ({err})"
        for rel, path in zip(names, local):
            reason = check_file(path, rel, files[rel])
            if reason:
                return reason
        return None

    def _load_checked(self, directory: str, changed: Tuple[str, ...]) -> None:
        retarget = Retarget(self.strategy, self.settings, changed)
        self.strategy.load(directory)
        retarget.apply()
        rng_file = os.path.join(directory, "rng", f"rank_{self.ctx.rank:05d}.pt")
        if os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=True), self.ctx.device)
        else:
            log.warning("rank %d: no RNG state in %s (world size changed?); keeping the seeded RNG",
                        self.ctx.rank, directory)

    def _mark_skipped(self, reader: CheckpointReader, entry: Entry, marker: Any, reason: str) -> None:
        """Record, signed and bound to its manifest, that `entry` failed and an older checkpoint was used, so that
        later resumes pass it over without checking it again (none without a key or a readable manifest, and none
        in resume_from, which is never written)."""
        if not self._writable(reader):
            return
        mark = self.signing.skip_mark(entry.name, marker, reason)
        if mark is None:
            return
        try:
            self.store.write_json(mark, entry.name, SKIPPED)
        except OSError as err:
            log.warning("could not mark %s as skipped: %s", entry.name, err)

    # ------------------------------------------------------------ progress

    def start_progress(self, resumed_step: int, steps: int) -> int:
        """Begin this attempt's lost-work count (progress.py); returns the steps redone by earlier attempts.

        A checkpoint_dir that cannot be written stops a run that has steps left to train (it would fail at its
        first save) with one line; a run with nothing left resumes from it read-only. With checkpoint_dir off
        (only resume_from) nothing is written: the figure is counted, not recorded."""
        if not self.saves:
            self.progress.read_only = True
            return self.progress.start(resumed_step, steps, self._carried)
        err = self.store.unwritable() if self.ctx.is_main else None
        problem = self.ctx.broadcast_object(None if err is None else f"{type(err).__name__}: {err.strerror or err}")
        if problem and resumed_step < steps:
            raise CheckpointUserError(
                f"checkpoint_dir {self.store.root!r} is not writable ({problem}), and this run saves checkpoints "
                f"there (steps {resumed_step} to {steps} are left): make it writable, or copy its checkpoints to a "
                f"writable directory and set checkpoint_dir to that")
        if problem:
            self.progress.read_only = True
            if self.ctx.is_main:
                log.warning("checkpoint_dir %s is not writable (%s): resumed from it read-only; nothing is left to "
                            "train, so nothing is written there", self.store.root, problem)
        return self.progress.start(resumed_step, steps, self._carried)

    def begin_step(self, step: int) -> None:
        """Step `step` is about to run (recorded first: a kill during it counts it as lost work)."""
        self.progress.begin(step)

    @property
    def steps_redone(self) -> int:
        """Steps this run has computed again after restarts, so far (progress.py says how they are counted)."""
        return self.progress.steps_redone
