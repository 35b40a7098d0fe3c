"""The engine's batches: each rank's share of each step, deterministic and world-size independent.

Every dataset (prepared shards, data.shards; or a benchmark one, data.benchmark) is a list of fixed-length
samples addressed by index, so a step's batch is a pure function of (seed, epoch, index): resuming from a
saved `DataPosition` replays exactly the batches an uninterrupted run would have seen, and the global batch
of a step is the same whatever the world size (only its split over ranks changes), which is what lets 1 and
N processes be compared. A sample is a dict of [seq_len] tensors: ``input_ids``, ``labels`` (aligned with
the inputs, -100 where no loss is taken; the model shifts them) and, for packed data, ``position_ids``.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from fuseforge.loss_args import IGNORE_INDEX  # re-exported: engine and tests import it from here

Sample = Dict[str, torch.Tensor]


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
