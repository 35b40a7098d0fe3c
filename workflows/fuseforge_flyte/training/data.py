"""Training data: tokenization, the built-in datasets, and deterministic per-rank sharding.

Every dataset is a list of fixed-length token sequences addressed by index, so a
step's batch is a pure function of (seed, epoch, index): resuming from a saved
`DataPosition` replays exactly the batches an uninterrupted run would have seen,
and the global batch of a step is the same whatever the world size (only its
split over ranks changes), which is what lets 1 and N processes be compared.

Datasets:
- ``builtin:synthetic``: random phrases over the model's whole vocabulary in which
  each token follows the previous one by a seeded random successor rule; phrases
  start at random. Cheap, unbounded, and learnable (7 of 8 tokens are predictable),
  so the loss falls in a benchmark as it would on text.
- ``builtin:text``: a small English text shipped with the package.
- a local path or fsspec URI to a ``.txt`` file (blank-line separated documents)
  or a ``.jsonl`` file with one ``{"text": ...}`` object per line.

Text is tokenized to bytes (vocabulary 256 + BOS/EOS/PAD = 259), documents are
wrapped in BOS/EOS and packed into one stream that is cut into sequences.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import List, Optional, Sequence

import torch

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_VOCAB_SIZE = 259

SYNTHETIC = "builtin:synthetic"
BUILTIN_TEXT = "builtin:text"
BUILTIN_TEXT_FILE = "tiny_corpus.txt"

_SYNTHETIC_PHRASES = 512
_SYNTHETIC_PHRASE_LEN = 8
_SYNTHETIC_SIZE = 2**31 - 1  # "unbounded": far more sequences than any run consumes


def encode(text: str) -> List[int]:
    """One document as byte ids wrapped in BOS/EOS."""
    return [BOS_ID, *text.encode("utf-8"), EOS_ID]


def decode(ids: Sequence[int]) -> str:
    """Inverse of `encode` for the byte ids (special ids are dropped)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class PackedTokens:
    """A token stream cut into consecutive sequences of `seq_len` (the tail is dropped)."""

    shuffle = True
    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, tokens: torch.Tensor, seq_len: int, source: str):
        self.tokens = tokens
        self.seq_len = seq_len
        self.source = source

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len]


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

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + index) % 2**63)
        n_phrases = -(-self.seq_len // _SYNTHETIC_PHRASE_LEN)
        picks = torch.randint(0, _SYNTHETIC_PHRASES, (n_phrases,), generator=gen)
        return self.codebook[picks].reshape(-1)[: self.seq_len].clone()


def read_documents(uri: str) -> List[str]:
    """Documents from a .txt (split on blank lines) or .jsonl ({"text": ...}) file or URI."""
    import fsspec

    try:
        with fsspec.open(uri, "rt", encoding="utf-8") as handle:
            raw = handle.read()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"TrainSpec.dataset: dataset file not found: {uri!r}") from err
    if uri.endswith(".jsonl"):
        docs = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"TrainSpec.dataset: {uri}:{lineno} is not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'TrainSpec.dataset: {uri}:{lineno} needs a string "text" field')
            docs.append(record["text"])
    else:
        docs = [block.strip() for block in raw.split("\n\n")]
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"TrainSpec.dataset: {uri!r} contains no text")
    return docs


def builtin_text_path() -> str:
    return str(resources.files("fuseforge_flyte") / "data" / "assets" / BUILTIN_TEXT_FILE)


def load_dataset(name: str, *, seq_len: int, vocab_size: int, seed: int):
    """The dataset named by TrainSpec.dataset, checked against the model's vocabulary."""
    if name == SYNTHETIC:
        return SyntheticTokens(vocab_size, seq_len, seed)
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(
            f"TrainSpec.dataset: {name!r} uses the byte tokenizer (vocabulary {BYTE_VOCAB_SIZE}) "
            f"but the model's vocab_size is {vocab_size}"
        )
    uri = builtin_text_path() if name == BUILTIN_TEXT else name
    ids: List[int] = []
    for doc in read_documents(uri):
        ids.extend(encode(doc))
    return PackedTokens(torch.tensor(ids, dtype=torch.long), seq_len, name)


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

    def next_step(self) -> List[torch.Tensor]:
        """This rank's `grad_accum` micro-batches ([batch_size, seq_len] each) for the next step."""
        pos = self.position
        if pos.index + self.samples_per_step > len(self.dataset):
            pos = DataPosition(pos.epoch + 1, 0)
        order = self._order_for(pos.epoch)
        micro_batches = []
        for micro in range(self.grad_accum):
            slot = pos.index + (micro * self.world_size + self.rank) * self.batch_size
            idx = range(slot, slot + self.batch_size)
            samples = [self.dataset[int(order[i]) if order is not None else i] for i in idx]
            micro_batches.append(torch.stack(samples))
        self.position = DataPosition(pos.epoch, pos.index + self.samples_per_step)
        return micro_batches
