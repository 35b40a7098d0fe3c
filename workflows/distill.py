"""pyflyte entry point for the `distill` workflow.

    pyflyte run workflows/distill.py distill --teacher ./my-teacher --model tiny-llama --steps 40    # local
    pyflyte run --remote --copy all workflows/distill.py distill --teacher meta-llama/Llama-3.1-8B-Instruct \
        --model meta-llama/Llama-3.2-1B-Instruct --dataset ./chat.jsonl --steps 1000

The workflow and its tasks live in the installed fuseforge_flyte package (so that elastic workers
started with "spawn" can import them); this file only re-exports them.
"""

from fuseforge_flyte.tasks import fingerprint_data, prepare_data, train_model
from fuseforge_flyte.workflows import distill

__all__ = ["distill", "fingerprint_data", "prepare_data", "train_model"]
