"""pyflyte entry point for the `demo` workflow: the README's main job.

    pyflyte run workflows/demo.py demo                 # SFT of a tiny Llama on builtin:chat, then samples
    pyflyte run workflows/demo.py demo --steps 200     # trains longer

Re-exports the workflow from the installed fuseforge_flyte package (see workflows/train.py).
"""

from fuseforge_flyte.tasks import fingerprint_data, prepare_data, sample_model, train_model
from fuseforge_flyte.workflows import demo

__all__ = ["demo", "fingerprint_data", "prepare_data", "sample_model", "train_model"]
