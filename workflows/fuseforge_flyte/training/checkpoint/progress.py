"""progress.json: the furthest step a run reached and the steps it has redone after restarts (its lost work)."""

from __future__ import annotations

import logging
import time
from typing import Dict

from fuseforge_flyte.training.checkpoint.layout import PROGRESS
from fuseforge_flyte.training.checkpoint.storage import Store
from fuseforge_flyte.training.distributed import DistContext

log = logging.getLogger("fuseforge.training")

_REMOTE_PROGRESS_INTERVAL_S = 5.0  # object-store writes cost tens of ms: throttle progress updates


class Progress:
    """The run's progress record next to its checkpoints; rank 0 writes it (all ranks call start)."""

    def __init__(self, store: Store, ctx: DistContext):
        self.store = store
        self.ctx = ctx
        self.steps_redone = 0
        self._furthest = 0
        self._written_at = 0.0

    def start(self, resumed_step: int) -> int:
        """Account for steps lost since the last checkpoint; returns the run's total steps redone."""
        progress = self.ctx.broadcast_object(self._read() if self.ctx.is_main else None)
        furthest = int(progress.get("furthest_step", 0))
        self.steps_redone = int(progress.get("steps_redone", 0)) + max(0, furthest - resumed_step)
        self._furthest = max(furthest, resumed_step)
        if self.ctx.is_main:
            self.store.fs.makedirs(self.store.root, exist_ok=True)
            self._write(force=True)
        return self.steps_redone

    def record(self, step: int) -> None:
        self._furthest = max(self._furthest, step)
        if self.ctx.is_main:
            self._write(force=False)

    def _read(self) -> Dict:
        try:
            return self.store.read_json(PROGRESS)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("ignoring unreadable %s: %s", self.store.path(PROGRESS), err)
            return {}

    def _write(self, force: bool) -> None:
        now = time.monotonic()
        if not force and not self.store.local and now - self._written_at < _REMOTE_PROGRESS_INTERVAL_S:
            return
        self.store.write_json({"furthest_step": self._furthest, "steps_redone": self.steps_redone}, PROGRESS)
        self._written_at = now
