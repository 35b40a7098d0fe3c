"""pyflyte entry point for the `train` workflow.

    pyflyte run workflows/train.py train --model tiny-llama --dataset builtin:chat --steps 40    # local, CPU ok
    pyflyte run --remote --copy all workflows/train.py train --model meta-llama/Llama-3.2-1B --dataset ./chat.jsonl

The workflow and its tasks live in the installed fuseforge_flyte package (so that elastic workers
started with "spawn" can import them); this file only re-exports them.
"""

from fuseforge_flyte.tasks import fingerprint_data, prepare_data, train_model
from fuseforge_flyte.workflows import train

__all__ = ["fingerprint_data", "prepare_data", "train", "train_model"]
