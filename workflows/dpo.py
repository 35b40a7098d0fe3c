"""pyflyte entry point for the `dpo` workflow.

    pyflyte run workflows/dpo.py dpo --model tiny-llama --lr 1e-3 --steps 20        # local, CPU ok
    pyflyte run --remote --copy all workflows/dpo.py dpo --model Qwen/Qwen2.5-0.5B-Instruct \
        --dataset trl-lib/ultrafeedback_binarized --max_length 1024 --steps 500

The workflow and its tasks live in the installed fuseforge_flyte package (so that elastic workers
started with "spawn" can import them); this file only re-exports them.
"""

from fuseforge_flyte.posttrain.tasks import dpo_train, prepare_preference_data, reference_logps
from fuseforge_flyte.workflows import dpo

__all__ = ["dpo", "dpo_train", "prepare_preference_data", "reference_logps"]
