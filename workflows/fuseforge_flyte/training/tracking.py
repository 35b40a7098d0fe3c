"""Optional experiment tracking: rank 0 sends the metrics the engine logs to TensorBoard or Weights & Biases.

Configured in platform.toml's [tracking] table (off by default), which whoever runs the engine reads and
hands in as TrackingSettings: the engine itself never reads the platform config. What is logged is what the
progress lines print (train/loss, train/lr, train/tokens_per_s, train/step_time_s, train/data_wait_fraction,
train/peak_memory_gib) at the same steps, eval/loss and eval/perplexity after each eval, and the run's summary
at the end. The backend's library is looked up when the run starts, on every rank, so a missing one fails
before any data is opened or model built rather than in a step (and is not retried: ImportError is permanent).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import sys
from typing import Any, Dict, Mapping, Optional

from fuseforge_flyte.training.outputs import default_run_name
from fuseforge_flyte.training.spec import TrainMetrics, TrainSpec

log = logging.getLogger("fuseforge.training")

# backend -> the pip package it needs (also its top-level module); torch.utils.tensorboard needs `tensorboard`
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


@dataclasses.dataclass(frozen=True)
class TrackingSettings:
    """platform.toml's [tracking] table as plain values (fuseforge_flyte.config checks and documents them), and
    `source`, the file or variable it was read from, for error messages."""

    backend: str  # "", "tensorboard" or "wandb"; "": off
    project: str
    entity: str
    run_name: str
    log_dir: str
    mode: str
    source: str


class TrackingUnavailable(ImportError):
    """[tracking].backend names a library that is not installed where training runs."""


class Tracker:
    """No tracking: the default, and what every rank but 0 gets."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record `values` (name -> number) at training step `step`."""

    def finish(self, metrics: Optional[TrainMetrics] = None) -> None:
        """End the run: with the final metrics after a completed run, without them after a failure or a
        preemption. Only the first call counts, so the engine can call it again on its way out. A failure
        path's error is logged, not raised, so it cannot hide the error that ended the training."""
        if getattr(self, "_finished", False):
            return
        self._finished = True
        try:
            self._close(metrics)
        except Exception:
            if metrics is not None:
                raise
            log.warning("experiment tracking: closing the run after a failure failed", exc_info=True)

    def _close(self, metrics: Optional[TrainMetrics]) -> None:
        pass


def summary_values(metrics: TrainMetrics) -> Dict[str, float]:
    """The end-of-run numbers a tracker keeps as the run's summary."""
    values = {"tokens_per_s": metrics.tokens_per_s, "mfu": metrics.mfu, "peak_memory_gib": metrics.peak_memory_gib,
              "final_loss": metrics.final_loss, "steps": metrics.steps}
    if metrics.eval_loss is not None:
        values.update(eval_loss=metrics.eval_loss, eval_perplexity=metrics.eval_perplexity)
    return values


class TensorBoardTracker(Tracker):
    """Event files under <log_dir>/<run_name> (a local directory or an fsspec URI); the summary is written as
    summary/* scalars at the last step."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: imported on use

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def _close(self, metrics: Optional[TrainMetrics]) -> None:
        if metrics is not None:
            for name, value in summary_values(metrics).items():
                self.writer.add_scalar(f"summary/{name}", value, metrics.steps)
        self.writer.close()


class WandbTracker(Tracker):
    """One W&B run per training attempt, through wandb's own API; the TrainSpec is the run's config. A run
    that ends without metrics (failure, preemption) is finished with exit code 1, so W&B shows it failed."""

    def __init__(self, wandb: Any, *, project: str, entity: str, name: str, mode: str, spec: TrainSpec):
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity or None, name=name, mode=mode,
                              config=dataclasses.asdict(spec))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.wandb.log(dict(values), step=step)

    def _close(self, metrics: Optional[TrainMetrics]) -> None:
        if metrics is not None:
            self.run.summary.update(summary_values(metrics))
        self.wandb.finish(exit_code=0 if metrics is not None else 1)


def _require(backend: str, source: str) -> None:
    """Fail now, naming the key and the package, if the backend's library is missing (cheap: no import)."""
    package = _PACKAGES[backend]
    if sys.modules.get(package) is not None or importlib.util.find_spec(package) is not None:
        return
    raise TrackingUnavailable(
        f"{source}: [tracking].backend = {backend!r} needs the {package!r} package, which is not installed: "
        f"pip install {package} (on the cluster add {package!r} to [image].extra_packages), "
        f'or turn tracking off with backend = ""'
    )


def start(spec: TrainSpec, is_main: bool, settings: Optional[TrackingSettings] = None) -> Tracker:
    """The tracker of this rank for `spec`, from platform.toml's [tracking] as `settings` (None: no tracking;
    the Flyte task passes the config the task was registered with, PlatformConfig.tracking_settings())."""
    if settings is None or not settings.backend:
        return Tracker()
    _require(settings.backend, settings.source)
    if not is_main:
        return Tracker()
    name = settings.run_name or default_run_name(spec.model)
    tracker: Tracker
    if settings.backend == "tensorboard":
        where = f"{settings.log_dir.rstrip('/')}/{name}"
        tracker = TensorBoardTracker(where)
    else:
        tracker = WandbTracker(importlib.import_module("wandb"), project=settings.project, entity=settings.entity,
                               name=name, mode=settings.mode, spec=spec)
        where = f"W&B project {settings.project!r} ({settings.mode})"
    log.info("experiment tracking: %s run %r -> %s", settings.backend, name, where)
    return tracker
