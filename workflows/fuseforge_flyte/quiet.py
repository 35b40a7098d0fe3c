"""Third-party start-up noise kept off a clean run: a run prints fuseforge's progress and summary, nothing else.

Each switch removes one message at its source rather than filtering output:
- transformers imports torchao at load whenever it is installed (for torchao-quantized checkpoints, which
  training never loads); that import logs torch's `register_constant() ... deprecated` twice per process, and
  `Failed to load ..._C_mxfp8...so` on a torch it was not built for. FP8 training imports torchao itself
  (training/fp8.py), so torchao is imported only when fp8 asks for it.
- DeepSpeed, imported by accelerate when transformers saves a model, guesses its accelerator and logs
  "Setting accelerator to CPU" on stdout when there is no GPU; naming the CPU accelerator stops the guess.
- the progress bars of transformers ("Writing model shards" on every save) and datasets ("Generating train split",
  "Saving the dataset", map progress) when preparing data; the preparation logs one summary line.
- click's "The parameter --x is used more than once" from pyflyte (flytekit 1.16 declares every bool input
  twice: --x/--no_x and --x/--no-x; the options work).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import warnings

TORCHAO_QUANTIZER = "transformers.quantizers.quantizer_torchao"


def ignore_duplicate_bool_options() -> None:
    warnings.filterwarnings("ignore", message=r"The parameter --\w+ is used more than once", category=UserWarning)


def _torchao_absent(*args, **kwargs) -> bool:
    return False


class _TorchaoGate(importlib.abc.MetaPathFinder):
    """Just before transformers imports its torchao quantizer, tell transformers that torchao is absent.

    A finder that never finds anything: it only notices the import, so importing fuseforge_flyte costs nothing
    and whichever module of a process first loads transformers' model code is covered."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == TORCHAO_QUANTIZER:
            hf_utils, hf_imports = sys.modules.get("transformers.utils"), sys.modules.get("transformers.utils.import_utils")
            for module in (hf_utils, hf_imports):
                if module is not None:
                    module.is_torchao_available = _torchao_absent
        return None


def keep_torchao_unimported() -> None:
    """Install the gate once per process (a no-op if transformers' quantizers are loaded already)."""
    if TORCHAO_QUANTIZER not in sys.modules and not any(isinstance(f, _TorchaoGate) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchaoGate())


def name_deepspeed_accelerator(cuda: bool) -> None:
    """DS_ACCELERATOR for this process and its children, unless the user set it."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")


def disable_progress_bars() -> None:
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets_logging.disable_progress_bar()


def quiet_third_party(cuda: bool) -> None:
    """The switches that need to know the device, for a process about to load models (cuda: it computes on a
    GPU); the import-time ones are set when fuseforge_flyte is imported."""
    name_deepspeed_accelerator(cuda)
    disable_progress_bars()
