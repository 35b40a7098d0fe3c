"""What the engine trains on: a run's prepared data, and the checks that it fits the model and the workers.

Datasets (TrainSpec.dataset):
- a directory written by ``fuseforge_flyte.data.prepare`` (the Flyte data-preparation task's output):
  tokenized with the model's tokenizer, loss-masked, packed; see fuseforge_flyte.data.
- anything else that fuseforge_flyte.data reads (a hub id, files, ``builtin:chat``...): prepared here
  first, by local rank 0 of each node into a cache directory (runs without Flyte).
- ``bench:synthetic``, ``bench:bytes`` (benchmark only; fuseforge_flyte.data.benchmark): nothing to open or check.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

from fuseforge_flyte.data.benchmark import resolve_benchmark
from fuseforge_flyte.model_names import PRESETS, load_config

log = logging.getLogger("fuseforge.training")


@dataclass
class TrainingData:
    """The engine's view of a run's data: the train split, an optional eval split, and what the model must fit."""

    train: object
    eval: Optional[object] = None
    manifest: Optional[object] = None  # fuseforge_flyte.data.shards.DataManifest (None for benchmark data)
    directory: Optional[str] = None  # the prepared directory (its tokenizer/ goes with the trained model)

    @property
    def tokenizer_dir(self) -> Optional[str]:
        if self.directory is None:
            return None
        from fuseforge_flyte.data.shards import tokenizer_dir

        path = tokenizer_dir(self.directory)
        return path if os.path.isdir(path) else None

    def preset_vocab_size(self, preset_vocab: int) -> int:
        """A random-init preset's vocabulary: grown to the tokenizer's when the data needs more ids."""
        if self.manifest is None:
            return preset_vocab
        return max(preset_vocab, int(self.manifest.vocab_size))

    def check_fits(self, config) -> None:
        """Token ids and seq_len within the model's embedding and positions (ValueError naming both)."""
        if self.manifest is not None:
            from fuseforge_flyte.data.checks import DataNumbers, check_fits_model

            check_fits_model(DataNumbers.of(self.manifest), config)


def _cache_dir_for(data_spec) -> str:
    """One directory per DataSpec and source contents, in fuseforge's "data" cache: a rerun with the same
    inputs reuses it."""
    from fuseforge_flyte.cache_dirs import cache_root
    from fuseforge_flyte.data.fingerprint import fingerprint

    contents = fingerprint(data_spec.dataset, data_spec.eval_dataset, data_spec.tokenizer, data_spec.model)
    key = json.dumps([data_spec.__dict__, contents], sort_keys=True, default=str)
    return os.path.join(cache_root("data"), hashlib.sha256(key.encode()).hexdigest()[:20])


def check_prepared_fits(spec) -> None:
    """Before any worker starts: the prepared data's seq_len, token ids and positions fit spec.model.

    Resolving the model's config here also makes an unknown model id fail once, in the launching process.
    """
    if resolve_benchmark(spec.dataset) is not None:
        return
    from fuseforge_flyte.data.checks import DataNumbers, check_fits_model
    from fuseforge_flyte.data.shards import read_manifest

    manifest = read_manifest(spec.dataset)
    _check_seq_len(spec, manifest, spec.dataset)
    if spec.model not in PRESETS:
        check_fits_model(DataNumbers.of(manifest), load_config(spec.model))


def fit_batch_to_data(spec, world_size: int) -> int:
    """The batch_size to train `spec` with on `world_size` workers: as given when the prepared data holds one
    global step (world_size x batch_size x grad_accum sequences), else the largest that it fills, with a message;
    a ValueError naming the numbers when not even batch_size 1 fits."""
    if resolve_benchmark(spec.dataset) is not None:
        return spec.batch_size
    from fuseforge_flyte.data.shards import read_manifest

    sequences = read_manifest(spec.dataset).train_sequences
    per_batch_row = world_size * spec.grad_accum
    if sequences >= per_batch_row * spec.batch_size:
        return spec.batch_size
    needed = f"{world_size} workers x batch_size {spec.batch_size} x grad_accum {spec.grad_accum}"
    if sequences < per_batch_row:
        raise ValueError(
            f"TrainSpec.dataset: the prepared data holds {sequences} training sequences of seq_len {spec.seq_len}, "
            f"fewer than one global step of {needed} = {per_batch_row * spec.batch_size} needs, even with "
            f"batch_size 1 ({per_batch_row}): use more data, a smaller seq_len or grad_accum, or fewer workers")
    fitted = sequences // per_batch_row
    log.warning("the prepared data holds %d training sequences of seq_len %d, fewer than one global step of %s = %d "
                "needs: training with batch_size %d (global batch %d); more data or a smaller seq_len keeps "
                "batch_size %d", sequences, spec.seq_len, needed, per_batch_row * spec.batch_size, fitted,
                fitted * per_batch_row, spec.batch_size)
    return fitted


def _check_seq_len(spec, manifest, directory: str) -> None:
    if manifest.seq_len != spec.seq_len:
        raise ValueError(
            f"TrainSpec.seq_len is {spec.seq_len} but the prepared data in {directory} was packed to "
            f"seq_len {manifest.seq_len}: prepare it again with seq_len={spec.seq_len}, or train with {manifest.seq_len}"
        )


def open_training_data(spec, ctx) -> Optional[TrainingData]:
    """The run's prepared data (preparing it first if needed); None for the benchmark datasets.

    Raw sources are prepared by local rank 0 of each node into the cache (deterministic, so every node
    writes the same shards) while the other ranks wait at a barrier.
    """
    from fuseforge_flyte.data.shards import is_prepared_dir, open_split, read_manifest

    if resolve_benchmark(spec.dataset) is not None:
        return None
    directory = spec.dataset
    if not is_prepared_dir(directory):
        data_spec = spec.data_spec()
        directory = _cache_dir_for(data_spec)
        if ctx.local_rank == 0 and not is_prepared_dir(directory):
            from fuseforge_flyte.data.prepare import prepare

            log.info("preparing %s into %s", spec.dataset, directory)
            prepare(data_spec, directory)
        ctx.barrier()
    manifest = read_manifest(directory)
    _check_seq_len(spec, manifest, directory)
    return TrainingData(open_split(directory, "train"), open_split(directory, "eval"), manifest, directory)
