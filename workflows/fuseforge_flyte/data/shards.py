"""The prepared directory: its layout, writing the split shards, and reading them back for training.

    out_dir/fuseforge_data.json   the DataManifest, written last (atomic rename): its presence
                                  is what makes a directory "prepared"
    out_dir/train/, out_dir/eval/ `datasets.Dataset.save_to_disk` shards, columns input_ids,
                                  labels, position_ids: int32 lists of exactly seq_len
    out_dir/tokenizer/            the tokenizer, `save_pretrained`

The engine reads the splits memory-mapped (`load_from_disk`), so a large dataset costs no RAM.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from fuseforge_flyte.data.formats import IGNORE_INDEX
from fuseforge_flyte.data.packing import build_rows

MANIFEST_NAME = "fuseforge_data.json"
FORMAT_VERSION = 1
SPLITS = ("train", "eval")
COLUMNS = ("input_ids", "labels", "position_ids")
MAX_SHARD_SIZE = "256MB"


@dataclass
class DataManifest:
    """What a prepared directory holds and what a model must fit to train on it.

    Counts per split: *_examples = source examples assigned to the split (before dropping),
    *_sequences = rows, *_tokens = non-padding tokens, *_loss_tokens = labels that are not -100.
    truncated_examples: examples longer than seq_len (both splits). Text documents are cut into
    seq_len pieces, each its own document (nothing lost); SFT examples (messages,
    prompt_completion) are cut at seq_len and their tail is lost.
    dropped_examples: examples with no loss token (left after truncation), or empty texts.
    """

    format_version: int
    data_format: str
    seq_len: int
    packing: bool
    vocab_size: int  # len(tokenizer): the model's embedding needs at least this many rows
    max_token_id: int  # the largest id present in the data
    pad_token_id: int
    tokenizer: str  # where the tokenizer came from (it is saved under tokenizer/)
    train_examples: int
    train_sequences: int
    train_tokens: int
    train_loss_tokens: int
    eval_examples: int
    eval_sequences: int
    eval_tokens: int
    eval_loss_tokens: int
    truncated_examples: int
    source: str  # DataSpec.dataset as given
    dropped_examples: int = 0
    packing_efficiency: float = 0.0  # train tokens / (train sequences * seq_len)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    model: str = ""  # DataSpec.model the data was checked against
    eval_source: str = ""  # DataSpec.eval_dataset, or "eval_fraction=<f>" for a held-out share
    dataset_config: str = ""
    dataset_split: str = "train"
    seed: int = 0

    # The fields that say which data this is, not where it lives: a resumed run must train on the same data
    # (training/checkpoint/compatibility.py compares them).
    IDENTITY: ClassVar[Tuple[str, ...]] = ("source", "dataset_config", "dataset_split", "eval_source", "data_format",
                                           "seq_len", "packing", "tokenizer", "seed", "train_sequences",
                                           "train_tokens", "train_loss_tokens")

    def identity(self) -> Dict[str, object]:
        """{field: value} of the IDENTITY fields."""
        return {name: getattr(self, name) for name in self.IDENTITY}


def manifest_path(data_dir: str) -> str:
    return os.path.join(data_dir, MANIFEST_NAME)


def tokenizer_dir(data_dir: str) -> str:
    """Where the prepared data's tokenizer is saved (save_pretrained format)."""
    return os.path.join(data_dir, "tokenizer")


def split_dir(data_dir: str, split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {list(SPLITS)}")
    return os.path.join(data_dir, split)


def is_prepared_dir(path: str) -> bool:
    """A local directory holding a manifest (so a complete prepare)."""
    return bool(path) and os.path.isfile(manifest_path(path))


def write_manifest(data_dir: str, manifest: DataManifest) -> None:
    """Write the manifest atomically: readers see either none or the whole file."""
    tmp = manifest_path(data_dir) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(asdict(manifest), handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, manifest_path(data_dir))


def read_manifest(data_dir: str) -> DataManifest:
    """The manifest of a prepared directory; FileNotFoundError/ValueError saying what is wrong."""
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"prepared data directory not found: {data_dir!r}")
    path = manifest_path(data_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{data_dir!r} is not a prepared data directory: no {MANIFEST_NAME} "
                                "(prepare it with fuseforge_flyte.data.prepare; an interrupted prepare leaves none)")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version!r}, but this fuseforge reads version {FORMAT_VERSION}; "
                         "prepare the data again")
    names = {f.name for f in fields(DataManifest)}
    required = {f.name for f in fields(DataManifest) if f.default is MISSING}
    missing = sorted(required - set(raw))
    if missing:
        raise ValueError(f"{path}: missing manifest fields {missing}; prepare the data again")
    return DataManifest(**{k: v for k, v in raw.items() if k in names})


class _DocumentColumn:
    """O(1) numpy views of one list column of an Arrow table, by row (no copy of the data)."""

    def __init__(self, column):
        self.chunks = []
        starts = [0]
        for chunk in column.chunks:
            self.chunks.append((chunk.values.to_numpy(zero_copy_only=False), chunk.offsets.to_numpy()))
            starts.append(starts[-1] + len(chunk))
        self.starts = np.asarray(starts, dtype=np.int64)

    def __getitem__(self, row: int) -> np.ndarray:
        c = int(np.searchsorted(self.starts, row, side="right")) - 1
        values, offsets = self.chunks[c]
        local = row - int(self.starts[c])
        return values[offsets[local]:offsets[local + 1]]

    def _used(self):
        for values, offsets in self.chunks:
            yield values[offsets[0]:offsets[-1]]

    def max_value(self) -> int:
        return max((int(v.max()) for v in self._used() if v.size), default=-1)

    def count_not(self, value: int) -> int:
        return sum(int(np.count_nonzero(v != value)) for v in self._used())


@dataclass
class SplitStats:
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    max_token_id: int = -1


def write_split(documents, groups: List[List[int]], out: str, *, seq_len: int, pad_token_id: int,
                work_file: str, fingerprint: str) -> SplitStats:
    """Rows made of `groups` of documents (a Dataset with input_ids/labels) saved to `out` as shards."""
    import datasets

    ids_col = _DocumentColumn(documents.data.column("input_ids"))
    labels_col = _DocumentColumn(documents.data.column("labels"))
    stats = SplitStats(sequences=len(groups), max_token_id=ids_col.max_value())

    def make(batch: Dict[str, list]) -> Dict[str, np.ndarray]:
        rows = [build_rows([(ids_col[d], labels_col[d]) for d in group], seq_len, pad_token_id)
                for group in batch["docs"]]
        return {name: np.stack([row[k] for row in rows]) for k, name in enumerate(COLUMNS)}

    lengths = np.asarray(documents.data.column("length").to_numpy(), dtype=np.int64)
    stats.tokens = int(sum(int(lengths[g].sum()) for g in groups))
    stats.loss_tokens = labels_col.count_not(IGNORE_INDEX)
    row_list = datasets.List(datasets.Value("int32"), length=seq_len)
    features = datasets.Features({name: row_list for name in COLUMNS})
    group_features = datasets.Features({"docs": datasets.List(datasets.Value("int64"))})
    groups_ds = datasets.Dataset.from_dict({"docs": groups}, features=group_features)
    rows = groups_ds.map(make, batched=True, batch_size=256, remove_columns=["docs"], features=features,
                         cache_file_name=work_file, new_fingerprint=fingerprint,
                         desc=f"packing {os.path.basename(out)}")
    rows.save_to_disk(out, max_shard_size=MAX_SHARD_SIZE)
    return stats


class PreparedSequences:
    """One prepared split, memory-mapped: samples of int64 tensors input_ids, labels, position_ids [seq_len]."""

    shuffle = True

    def __init__(self, path: str, manifest: DataManifest):
        import datasets

        self.path = path
        self.seq_len = manifest.seq_len
        self.source = manifest.source
        self.vocab_size = manifest.vocab_size
        self.pad_token_id = manifest.pad_token_id
        self._data = datasets.load_from_disk(path).with_format("numpy", columns=list(COLUMNS))

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences in {self.path}")
        row = self._data[i]
        return {k: torch.from_numpy(np.asarray(row[k], dtype=np.int64)) for k in COLUMNS}

    def batch(self, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
        """Rows `indices` stacked to [len(indices), seq_len] per field, in one Arrow read."""
        rows = self._data[[int(i) for i in indices]]
        out = {}
        for k in COLUMNS:
            value = rows[k]
            if value.dtype == object:  # only if rows came back ragged
                value = np.stack(value)
            out[k] = torch.from_numpy(np.asarray(value, dtype=np.int64)).reshape(len(indices), self.seq_len)
        return out


def open_split(data_dir: str, split: str) -> Optional[PreparedSequences]:
    """The "train" or "eval" split of a prepared directory; None for an eval split it does not have."""
    manifest = read_manifest(data_dir)
    path = split_dir(data_dir, split)
    if split == "eval" and manifest.eval_sequences == 0:
        return None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{data_dir!r}: the {split} split is missing ({path}); prepare the data again")
    return PreparedSequences(path, manifest)
