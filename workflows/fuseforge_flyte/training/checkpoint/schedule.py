"""A restored optimizer and LR schedule, retargeted to what this run asks for.

Allowed changes of lr, weight_decay, steps and warmup_steps (resume_allow_changes) take effect on resume: the
restored state holds the old base lr and weight decay: the scheduler's is edited through its public
state_dict()/load_state_dict(), the optimizer groups' initial_lr and weight_decay through their public
param_groups (see _retarget_optimizer). The schedule's shape (warmup, length) is not in the state: the
LR lambda (transformers' cosine with warmup, training/optim.py) is a functools.partial that LambdaLR's state_dict
does not save, so the scheduler the strategy rebuilt for this run already has the new numbers. Then the current
step's lr is recomputed on that schedule.

A checkpoint written with the former LR schedule (fuseforge's own WarmupCosine, whose state named its `warmup` and
`total`) continues on the new schedule the same way: its step, base lr and optimizer state are restored, and the
current step's lr is recomputed on this run's schedule. (LambdaLR's load_state_dict puts the saved `warmup` and
`total` onto the new lambda as attributes it never reads, so they stay in later checkpoints of that run, and each
of its resumes recomputes the lr again: the same value.)
"""

from __future__ import annotations

import logging
from typing import Dict, List, Sequence

from torch.optim.lr_scheduler import LambdaLR

log = logging.getLogger("fuseforge.training")

SCHEDULE = frozenset({"lr", "weight_decay", "warmup_steps", "steps"})  # applied to the restored optimizer


def former_schedule(scheduler_state: Dict) -> bool:
    """Whether a LambdaLR state dict was written with fuseforge's former WarmupCosine (it saved warmup and total)."""
    return any(isinstance(fn, dict) and "warmup" in fn and "total" in fn
               for fn in scheduler_state.get("lr_lambdas") or ())


class Retarget:
    """Made before a checkpoint is loaded into the strategy, applied after: the restored optimizer and schedule
    take this run's lr, weight decay and schedule where resume_allow_changes allows (`changed`), and a checkpoint
    of the former schedule continues on this run's."""

    def __init__(self, strategy, settings: Dict, changed: Sequence[str]):
        scheduler = getattr(strategy, "scheduler", None)
        self.scheduler = scheduler if isinstance(scheduler, LambdaLR) else None
        self.settings = settings
        self.changed = bool(SCHEDULE & set(changed))
        # optim.param_groups gives the no-decay group weight_decay 0; the decayed group is the one with weight
        # decay in the rebuilt optimizer (this run's settings) or in the restored one (the checkpoint's)
        self._decayed_before: List[bool] = []
        if self.scheduler is not None and self.changed:
            self._decayed_before = [group["weight_decay"] != 0 for group in self.scheduler.optimizer.param_groups]

    def apply(self) -> None:
        if self.scheduler is None:
            return
        state = self.scheduler.state_dict()
        former = former_schedule(state)
        if not (self.changed or former):
            return
        if former:
            log.info("the checkpoint's scheduler state names the former LR schedule's warmup and total (written by "
                     "an earlier fuseforge, or by a run resumed from such a checkpoint): continuing at step %d on "
                     "transformers' cosine schedule with warmup (training/optim.py)", state["last_epoch"])
        if self.changed:
            lr = float(self.settings["lr"])
            self._retarget_optimizer(lr, float(self.settings["weight_decay"]))
            state["base_lrs"] = [lr] * len(state["base_lrs"])
        # this step's lr on the (rebuilt) schedule: load one step back, then step onto it (which writes the
        # optimizer groups' lr); lr_lambdas are not loaded back, the rebuilt schedule's shape stays
        state["lr_lambdas"] = [None] * len(state["lr_lambdas"])
        state["last_epoch"] -= 1
        self.scheduler.load_state_dict(state)
        self.scheduler.step()

    def _retarget_optimizer(self, lr: float, weight_decay: float) -> None:
        """The groups' hyperparameters, through `param_groups` (torch's public handle on them): a whole state_dict()
        round trip cannot serve here, since DeepSpeed ZeRO-3 keeps optimizer state for parameters that are not in
        the optimizer's param_groups at that moment (state_dict() then fails)."""
        for i, group in enumerate(self.scheduler.optimizer.param_groups):
            group["initial_lr"] = lr
            decayed_before = i < len(self._decayed_before) and self._decayed_before[i]
            if group["weight_decay"] != 0 or decayed_before:
                group["weight_decay"] = weight_decay
