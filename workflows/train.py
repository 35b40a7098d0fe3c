"""pyflyte entry point for the `train` workflow.

    pyflyte run workflows/train.py train --model tiny-llama --steps 20            # local, CPU ok
    pyflyte run --remote workflows/train.py train --model tiny-llama --steps 200  # on the cluster

The workflow and its tasks live in the installed fuseforge_flyte package (so that elastic workers
started with "spawn" can import them); this file only re-exports them.
"""

from fuseforge_flyte.tasks import train_model
from fuseforge_flyte.workflows import train

__all__ = ["train", "train_model"]
