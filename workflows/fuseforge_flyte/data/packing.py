"""Packing documents into fixed-length rows without leakage between them.

Best-fit-decreasing: documents are taken longest first (ties by index, so the result is
deterministic) and each goes into the open row with the least room that still fits it, found in
O(log seq_len) through a tree of counts over the remaining room; O(n log n) overall.

A row is its documents back to back, then padding. `position_ids` restart at 0 at every document
start (transformers turns restarting positions into a block-diagonal causal mask when no
attention_mask is given; flash attention reads them directly), labels are the documents' own (so
IGNORE_INDEX at every document start) and the padding is one more segment with positions 0, 1, ...,
pad_token_id inputs and IGNORE_INDEX labels.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from fuseforge_flyte.data.formats import IGNORE_INDEX


class _RoomTree:
    """Counts of open rows per amount of free room 0..capacity; finds the smallest room >= n."""

    def __init__(self, capacity: int):
        self.size = 1
        while self.size < capacity + 1:
            self.size *= 2
        self.counts = [0] * (2 * self.size)

    def add(self, room: int, delta: int) -> None:
        i = room + self.size
        while i:
            self.counts[i] += delta
            i //= 2

    def smallest_at_least(self, n: int) -> int:
        """The least room >= n that some open row has, or -1."""
        counts, i = self.counts, n + self.size
        if counts[i]:
            return n
        while i > 1:
            if i % 2 == 0 and counts[i + 1]:
                i += 1
                while i < self.size:
                    i = 2 * i if counts[2 * i] else 2 * i + 1
                return i - self.size
            i //= 2
        return -1


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Groups of document indices, each group's total length <= capacity (zero lengths are skipped)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.max() > capacity:
        raise ValueError(f"a document of {int(lengths.max())} tokens does not fit seq_len {capacity}")
    order = np.lexsort((np.arange(lengths.size), -lengths))  # longest first, then by index
    tree = _RoomTree(capacity)
    rows: List[List[int]] = []
    open_by_room: List[List[int]] = [[] for _ in range(capacity + 1)]
    for doc in order.tolist():
        n = int(lengths[doc])
        if n == 0:
            break  # sorted: the rest are empty too
        room = tree.smallest_at_least(n)
        if room < 0:
            row, room = len(rows), capacity
            rows.append([])
        else:
            row = open_by_room[room].pop()
            tree.add(room, -1)
        rows[row].append(doc)
        room -= n
        if room > 0:
            open_by_room[room].append(row)
            tree.add(room, 1)
    return rows


def one_per_row(lengths: Sequence[int]) -> List[List[int]]:
    """packing=False: each non-empty document alone in its row, in order."""
    return [[i] for i, n in enumerate(lengths) if n > 0]


def build_rows(docs: Sequence[Tuple[np.ndarray, np.ndarray]], seq_len: int,
               pad_token_id: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, labels, position_ids), each [seq_len] int32, for one row of (ids, labels) documents."""
    total = sum(len(ids) for ids, _ in docs)
    if total > seq_len:
        raise ValueError(f"documents of {total} tokens do not fit one row of seq_len {seq_len}")
    input_ids = np.full(seq_len, pad_token_id, dtype=np.int32)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
    position_ids = np.empty(seq_len, dtype=np.int32)
    at = 0
    for ids, labs in docs:
        n = len(ids)
        input_ids[at:at + n] = ids
        labels[at:at + n] = labs
        labels[at] = IGNORE_INDEX
        position_ids[at:at + n] = np.arange(n, dtype=np.int32)
        at += n
    position_ids[at:] = np.arange(seq_len - at, dtype=np.int32)
    return input_ids, labels, position_ids
