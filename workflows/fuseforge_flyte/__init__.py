"""fuseforge on Flyte: config, image, training engine, tasks and workflows.

For your own training code: `training_task` (fuseforge_flyte.user_task) and the metrics helpers
`FuseforgeMetricsCallback` / `StepMeter` (fuseforge_flyte.measure), imported on first use so that
importing any fuseforge_flyte module stays light.
"""

from fuseforge_flyte.quiet import ignore_duplicate_bool_options, keep_torchao_unimported

ignore_duplicate_bool_options()  # pyflyte builds its options after importing the workflows: see quiet.py
keep_torchao_unimported()

_LAZY = {
    "training_task": "fuseforge_flyte.user_task",
    "FuseforgeMetricsCallback": "fuseforge_flyte.measure",
    "StepMeter": "fuseforge_flyte.measure",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fuseforge_flyte' has no attribute {name!r}")
