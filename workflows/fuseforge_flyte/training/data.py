"""What the engine trains on: prepared shards, two benchmark-only datasets, and deterministic sharding.

Every dataset is a list of fixed-length samples addressed by index, so a step's batch is a pure
function of (seed, epoch, index): resuming from a saved `DataPosition` replays exactly the batches
an uninterrupted run would have seen, and the global batch of a step is the same whatever the
world size (only its split over ranks changes), which is what lets 1 and N processes be compared.
A sample is a dict of [seq_len] tensors: ``input_ids``, ``labels`` (aligned with the inputs, -100
where no loss is taken; the model shifts them) and, for packed data, ``position_ids``.

Datasets (TrainSpec.dataset):
- a directory written by ``fuseforge_flyte.data.prepare`` (the Flyte data-preparation task's output):
  tokenized with the model's tokenizer, loss-masked, packed; see fuseforge_flyte.data.
- anything else that fuseforge_flyte.data reads (a hub id, files, ``builtin:chat``...): prepared here
  first, by local rank 0 of each node into a cache directory (runs without Flyte).
- ``bench:synthetic`` (benchmark only): random phrases over the model's whole vocabulary in which each
  token follows the previous one by a seeded random successor rule. Cheap, unbounded and learnable, so
  the loss falls in a benchmark as it would on text.
- ``bench:bytes`` (benchmark only): the shipped English corpus as bytes (vocabulary 256 + BOS/EOS/PAD =
  259), packed as one stream. No tokenizer needed; never use it to fine-tune a pretrained model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass
from importlib import resources
from typing import Dict, List, Optional, Sequence

import torch

from fuseforge.loss_args import IGNORE_INDEX  # re-exported: engine and tests import it from here
from fuseforge_flyte.model_names import BYTE_VOCAB_SIZE, PRESETS, load_config

log = logging.getLogger("fuseforge.training")

# the byte tokenizer's special ids after the 256 bytes (model_names.BYTE_VOCAB_SIZE counts them)
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258

SYNTHETIC = "bench:synthetic"
BYTES = "bench:bytes"
BENCHMARK_DATASETS = (SYNTHETIC, BYTES)
# A "prepared" directory that only names a benchmark dataset (what the Flyte preparation task returns for one).
BENCH_MARKER = "fuseforge_bench.json"
BYTES_CORPUS_FILE = "tiny_corpus.txt"

_SYNTHETIC_PHRASES = 512
_SYNTHETIC_PHRASE_LEN = 8
_SYNTHETIC_SIZE = 2**31 - 1  # "unbounded": far more sequences than any run consumes

Sample = Dict[str, torch.Tensor]


def encode(text: str) -> List[int]:
    """One document as byte ids wrapped in BOS/EOS."""
    return [BOS_ID, *text.encode("utf-8"), EOS_ID]


def decode(ids: Sequence[int]) -> str:
    """Inverse of `encode` for the byte ids (special ids are dropped)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _lm_sample(ids: torch.Tensor) -> Sample:
    """Plain language modelling on every token: the labels are the inputs."""
    return {"input_ids": ids, "labels": ids}


class PackedBytes:
    """The byte-encoded corpus as one stream cut into consecutive sequences of `seq_len` (tail dropped)."""

    shuffle = True
    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, tokens: torch.Tensor, seq_len: int, source: str):
        self.tokens = tokens
        self.seq_len = seq_len
        self.source = source

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, index: int) -> Sample:
        start = index * self.seq_len
        return _lm_sample(self.tokens[start : start + self.seq_len])


class SyntheticTokens:
    """Sequences of phrases from a seeded codebook: sample i depends only on (seed, i)."""

    shuffle = False  # samples are already random; an identity order keeps it O(1)

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.source = SYNTHETIC
        gen = torch.Generator().manual_seed(seed)
        successor = torch.randperm(vocab_size, generator=gen)  # one hidden rule: token -> next token
        columns = [torch.randint(0, vocab_size, (_SYNTHETIC_PHRASES,), generator=gen)]
        for _ in range(_SYNTHETIC_PHRASE_LEN - 1):
            columns.append(successor[columns[-1]])
        self.codebook = torch.stack(columns, dim=1)

    def __len__(self) -> int:
        return _SYNTHETIC_SIZE

    def __getitem__(self, index: int) -> Sample:
        gen = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + index) % 2**63)
        n_phrases = -(-self.seq_len // _SYNTHETIC_PHRASE_LEN)
        picks = torch.randint(0, _SYNTHETIC_PHRASES, (n_phrases,), generator=gen)
        return _lm_sample(self.codebook[picks].reshape(-1)[: self.seq_len].clone())


def bytes_corpus_path() -> str:
    return str(resources.files("fuseforge_flyte") / "data" / "assets" / BYTES_CORPUS_FILE)


def load_byte_corpus(seq_len: int, vocab_size: int) -> PackedBytes:
    """bench:bytes: blank-line separated documents of the shipped corpus, byte-encoded and packed."""
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(
            f"TrainSpec.dataset: {BYTES!r} uses the byte tokenizer (vocabulary {BYTE_VOCAB_SIZE}) "
            f"but the model's vocab_size is {vocab_size}"
        )
    with open(bytes_corpus_path(), encoding="utf-8") as handle:
        docs = [block.strip() for block in handle.read().split("\n\n") if block.strip()]
    ids: List[int] = []
    for doc in docs:
        ids.extend(encode(doc))
    return PackedBytes(torch.tensor(ids, dtype=torch.long), seq_len, BYTES)


# ---------------------------------------------------------------- prepared data


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


def write_benchmark_marker(directory: str, name: str) -> None:
    with open(os.path.join(directory, BENCH_MARKER), "w", encoding="utf-8") as handle:
        json.dump({"dataset": name}, handle)


def resolve_benchmark(dataset: str) -> Optional[str]:
    """The benchmark dataset `dataset` names (directly or through a marker directory), else None."""
    if dataset in BENCHMARK_DATASETS:
        return dataset
    marker = os.path.join(dataset, BENCH_MARKER)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as handle:
            return json.load(handle)["dataset"]
    return None


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


def benchmark_dataset(name: str, *, seq_len: int, vocab_size: int, seed: int):
    """bench:synthetic over the model's vocabulary, or bench:bytes."""
    if name == SYNTHETIC:
        return SyntheticTokens(vocab_size, seq_len, seed)
    if name == BYTES:
        return load_byte_corpus(seq_len, vocab_size)
    raise ValueError(f"TrainSpec.dataset: unknown benchmark dataset {name!r}; use one of {list(BENCHMARK_DATASETS)}")


# ---------------------------------------------------------------- batches


def collate(dataset, indices: Sequence[int]) -> Sample:
    """Samples `indices` stacked per field ([len(indices), seq_len] each), in one read where the dataset can."""
    if hasattr(dataset, "batch"):
        return dataset.batch(list(indices))
    samples = [dataset[i] for i in indices]
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


@dataclass
class DataPosition:
    """Where the next global batch starts: epoch and index into that epoch's sample order."""

    epoch: int = 0
    index: int = 0


class ShardedBatches:
    """The micro-batches of each step for one rank, in a world-size independent global order.

    A step consumes `world_size * batch_size * grad_accum` consecutive samples of the
    epoch's order (a seeded permutation for finite data); micro-batch m of rank r takes
    slot (m * world_size + r). A step never straddles epochs: the leftover is dropped.
    """

    def __init__(self, dataset, *, rank: int, world_size: int, batch_size: int, grad_accum: int,
                 seed: int, position: Optional[DataPosition] = None):
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.position = position or DataPosition()
        self.samples_per_step = world_size * batch_size * grad_accum
        if len(dataset) < self.samples_per_step:
            raise ValueError(
                f"TrainSpec.dataset: {dataset.source!r} holds {len(dataset)} sequences of "
                f"seq_len={dataset.seq_len}, fewer than one global step needs "
                f"(world_size*batch_size*grad_accum = {self.samples_per_step}); use a smaller "
                f"seq_len/batch_size or more data"
            )
        self._order_epoch = -1
        self._order: Optional[torch.Tensor] = None

    def _order_for(self, epoch: int) -> Optional[torch.Tensor]:
        if not self.dataset.shuffle:
            return None
        if epoch != self._order_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(len(self.dataset), generator=gen)
            self._order_epoch = epoch
        return self._order

    def next_step(self) -> List[Sample]:
        """This rank's `grad_accum` micro-batches (dicts of [batch_size, seq_len] tensors) for the next step."""
        pos = self.position
        if pos.index + self.samples_per_step > len(self.dataset):
            pos = DataPosition(pos.epoch + 1, 0)
        order = self._order_for(pos.epoch)
        micro_batches = []
        for micro in range(self.grad_accum):
            slot = pos.index + (micro * self.world_size + self.rank) * self.batch_size
            idx = range(slot, slot + self.batch_size)
            micro_batches.append(collate(self.dataset, [int(order[i]) if order is not None else i for i in idx]))
        self.position = DataPosition(pos.epoch, pos.index + self.samples_per_step)
        return micro_batches


class Prefetcher:
    """Gets the next step's micro-batches ready on a background thread while the device runs this step.

    The order is ShardedBatches' own, so runs stay deterministic; `position` is that of the batches handed
    out (not of those read ahead), which is what a checkpoint must record. On CUDA the batches are put in
    pinned memory so that their copy to the device can run asynchronously.
    """

    def __init__(self, batches: ShardedBatches, pin_memory: bool):
        self._batches = batches
        self._pin = pin_memory
        self.position = batches.position
        self._ready: "queue.Queue" = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="fuseforge-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                step = self._batches.next_step()
                if self._pin:
                    step = [{k: v.pin_memory() for k, v in b.items()} for b in step]
                item = (step, self._batches.position, None)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
                item = (None, None, err)
            while not self._stop.is_set():
                try:
                    self._ready.put(item, timeout=0.1)
                    break
                except queue.Full:  # the consumer is still on the step before
                    continue
            if item[2] is not None:
                return

    def next_step(self) -> List[Sample]:
        step, position, error = self._ready.get()
        if error is not None:
            raise error
        self.position = position
        return step

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def eval_batches(dataset, *, rank: int, world_size: int, batch_size: int) -> List[Optional[Sample]]:
    """This rank's share of the whole eval split (sample i goes to rank i % world_size), in micro-batches.

    Every rank gets the same number of entries (sharded models run collectives in each forward);
    an entry is None where this rank has run out of samples.
    """
    total = len(dataset)
    mine = list(range(rank, total, world_size))
    rounds = -(-(-(-total // world_size)) // batch_size)
    return [collate(dataset, mine[i * batch_size : (i + 1) * batch_size]) if i * batch_size < len(mine) else None
            for i in range(rounds)]
