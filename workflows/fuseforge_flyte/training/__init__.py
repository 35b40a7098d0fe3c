"""The training engine behind the Flyte tasks: plain PyTorch, usable without Flyte."""

from fuseforge_flyte.training.spec import TrainMetrics, TrainSpec

__all__ = ["TrainMetrics", "TrainSpec"]
