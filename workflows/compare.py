"""pyflyte entry point for the `compare` workflow (the same training with and without the kernels).

    pyflyte run workflows/compare.py compare --model tiny-llama --steps 20
    pyflyte run --remote --copy all workflows/compare.py compare --model meta-llama/Llama-3.2-1B --steps 200

Re-exports the workflow from the installed fuseforge_flyte package (see workflows/train.py).
"""

from fuseforge_flyte.tasks import fingerprint_data, prepare_data, summarize_comparison, train_model
from fuseforge_flyte.workflows import compare

__all__ = ["compare", "fingerprint_data", "prepare_data", "summarize_comparison", "train_model"]
