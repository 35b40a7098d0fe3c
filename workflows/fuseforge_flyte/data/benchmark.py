"""The two benchmark-only datasets (TrainSpec.dataset), which need no tokenizer and no preparation.

- ``bench:synthetic``: random phrases over the model's whole vocabulary in which each token follows the
  previous one by a seeded random successor rule. Cheap, unbounded and learnable, so the loss falls in a
  benchmark as it would on text.
- ``bench:bytes``: the shipped English corpus as bytes (vocabulary 256 + BOS/EOS/PAD = 259), packed as one
  stream. Never use it to fine-tune a pretrained model.

Like prepared data (data.shards), each is a list of fixed-length samples addressed by index, a sample a dict
of [seq_len] tensors ``input_ids`` and ``labels`` (here the inputs themselves: every token is trained on).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

import torch

from fuseforge_flyte.data.builtin import CORPUS_FILE, asset_path
from fuseforge_flyte.model_names import BYTE_VOCAB_SIZE

# the byte tokenizer's special ids after the 256 bytes (model_names.BYTE_VOCAB_SIZE counts them)
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258

SYNTHETIC = "bench:synthetic"
BYTES = "bench:bytes"
BENCHMARK_DATASETS = (SYNTHETIC, BYTES)
# A "prepared" directory that only names a benchmark dataset (what the Flyte preparation task returns for one).
BENCH_MARKER = "fuseforge_bench.json"

_SYNTHETIC_PHRASES = 512
_SYNTHETIC_PHRASE_LEN = 8
_SYNTHETIC_SIZE = 2**31 - 1  # "unbounded": far more sequences than any run consumes


def encode(text: str) -> List[int]:
    """One document as byte ids wrapped in BOS/EOS."""
    return [BOS_ID, *text.encode("utf-8"), EOS_ID]


def decode(ids: Sequence[int]) -> str:
    """Inverse of `encode` for the byte ids (special ids are dropped)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _lm_sample(ids: torch.Tensor) -> Dict[str, torch.Tensor]:
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

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
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

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + index) % 2**63)
        n_phrases = -(-self.seq_len // _SYNTHETIC_PHRASE_LEN)
        picks = torch.randint(0, _SYNTHETIC_PHRASES, (n_phrases,), generator=gen)
        return _lm_sample(self.codebook[picks].reshape(-1)[: self.seq_len].clone())


def bytes_corpus_path() -> str:
    """bench:bytes' text: the shipped corpus (builtin:text's)."""
    return asset_path(CORPUS_FILE)


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


def benchmark_dataset(name: str, *, seq_len: int, vocab_size: int, seed: int):
    """bench:synthetic over the model's vocabulary, or bench:bytes."""
    if name == SYNTHETIC:
        return SyntheticTokens(vocab_size, seq_len, seed)
    if name == BYTES:
        return load_byte_corpus(seq_len, vocab_size)
    raise ValueError(f"TrainSpec.dataset: unknown benchmark dataset {name!r}; use one of {list(BENCHMARK_DATASETS)}")
