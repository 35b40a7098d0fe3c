"""progress.json: the furthest step a run began and the steps it has redone after restarts (its lost work).

The figure is shown to users (the metrics' `steps_redone`, the Deck), so it is counted from facts that verify:

- the record is signed like the manifests (signing.py) and capped at the run's steps; one that does not read,
  or is not signed with this run's key, is ignored with a warning (without a key, under the opt-in to unsigned
  checkpoints, it is read as it is, still capped);
- each checkpoint's trainer state carries the record as it was when it was saved (hashed and signed with it),
  so an ignored record falls back to the resumed checkpoint's figures (a lower bound, said in the warning);
- a step is recorded when it begins, so a kill between a step and any write after it still counts that step;
- each attempt counts only the steps it repeats: those it begins again up to the furthest an earlier attempt
  began, not (furthest - resumed) whether or not it got there.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

from fuseforge_flyte.training.checkpoint.layout import PROGRESS
from fuseforge_flyte.training.checkpoint.signing import Signing
from fuseforge_flyte.training.checkpoint.storage import Store
from fuseforge_flyte.training.distributed import DistContext

log = logging.getLogger("fuseforge.training")

_REMOTE_PROGRESS_INTERVAL_S = 5.0  # object-store writes cost tens of ms: throttle progress updates
STATE_KEY = "progress"  # the record as saved in a checkpoint's trainer state


def _count(value, cap: Optional[int] = None) -> Optional[int]:
    """A non-negative int from a record (capped), or None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return min(value, cap) if cap is not None else value


class Progress:
    """The run's progress record next to its checkpoints; rank 0 writes it (all ranks call start)."""

    def __init__(self, store: Store, ctx: DistContext, signing: Signing):
        self.store = store
        self.ctx = ctx
        self.signing = signing
        self.steps_redone = 0
        self._base = 0  # steps redone by earlier attempts
        self._resumed = 0  # the step this attempt resumed from
        self._earlier = 0  # the furthest step an earlier attempt began
        self._furthest = 0
        self._written_at = 0.0
        self.read_only = False  # the checkpoint_dir cannot be written: the record is read, not updated

    def start(self, resumed_step: int, steps: int, carried: Optional[Dict] = None) -> int:
        """Begin this attempt at `resumed_step`; `carried`: the record saved in the resumed checkpoint's (verified)
        trainer state. Returns the steps redone by earlier attempts."""
        record = self.ctx.broadcast_object(self._read(steps, carried is not None) if self.ctx.is_main else None)
        facts = [f for f in (record, carried) if isinstance(f, dict)]
        furthest = [_count(f.get("furthest_step"), steps) for f in facts]
        redone = [_count(f.get("steps_redone")) for f in facts]
        self._earlier = max([resumed_step] + [f for f in furthest if f is not None])
        self._base = self.steps_redone = max([0] + [r for r in redone if r is not None])
        self._resumed = self._furthest = resumed_step
        if self.ctx.is_main:
            self._write(force=True)
        return self.steps_redone

    def begin(self, step: int) -> None:
        """Step `step` is about to run: recorded before it runs, so that a kill during or right after it counts."""
        self._furthest = max(self._furthest, step)
        self.steps_redone = self._base + max(0, min(self._furthest, self._earlier) - self._resumed)
        if self.ctx.is_main:
            self._write(force=False)

    def saved(self) -> Dict:
        """The record to carry in a checkpoint's trainer state."""
        return {"furthest_step": max(self._furthest, self._earlier), "steps_redone": self.steps_redone}

    def _read(self, steps: int, has_carried: bool) -> Optional[Dict]:
        """The record when it reads and verifies, else None (said, with what the figure falls back to)."""
        where = self.store.path(PROGRESS)
        fallback = ("the lost-work figure counts from the resumed checkpoint's record (a lower bound)" if has_carried
                    else "the lost-work figure counts from this attempt only (a lower bound)")
        try:
            record = self.store.read_json(PROGRESS)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            log.warning("ignoring unreadable %s (%s): %s", where, type(err).__name__, fallback)
            return None
        if not isinstance(record, dict):
            log.warning("ignoring %s: not a progress record; %s", where, fallback)
            return None
        if self.signing.key is not None:
            problem, _ = self.signing.problem(record, PROGRESS)
            if problem:
                log.warning("ignoring %s: %s; %s", where, problem, fallback)
                return None
        furthest = _count(record.get("furthest_step"))
        if furthest is not None and furthest > steps:
            log.warning("%s records step %d, beyond this run's steps=%d: counted as %d", where, furthest, steps, steps)
        return record

    def _write(self, force: bool) -> None:
        now = time.monotonic()
        throttled = not force and not self.store.local and now - self._written_at < _REMOTE_PROGRESS_INTERVAL_S
        if self.read_only or throttled:
            return
        try:
            self.store.write_json(self.signing.sign(self.saved()), PROGRESS)
        except OSError as err:  # a full or read-only disk fails the next checkpoint, saying so; training goes on
            self.read_only = True
            log.warning("cannot write %s (%s: %s): the lost work of this attempt is not recorded",
                        self.store.path(PROGRESS), type(err).__name__, err)
        self._written_at = now
