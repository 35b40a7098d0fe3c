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
- torch elastic's agent logging a failed worker's whole traceback (40-60 lines) on stderr in a local launch: the
  launcher raises that failure right after (a permanent one as one line, any other as ChildFailedError with the
  worker's traceback), so the agent's copy goes to a log file and one line names it (worker_failures_to_log_file).
- click's "The parameter --x is used more than once" from pyflyte (flytekit 1.16 declares every bool input
  twice: --x/--no_x and --x/--no-x; the options work).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import os
import sys
import warnings
from typing import Iterator

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


# The logger of torch elastic's agent that reports a worker's failure with its traceback.
ELASTIC_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
# Where the launch says it stops the other workers after one failed (which ones appear depends on timing).
STOPPING_WORKERS_LOGGERS = (ELASTIC_AGENT_LOGGER, "torch.multiprocessing.spawn")


class _ToFile(logging.Filter):
    """Writes the logger's WARNING and ERROR records to a file instead of letting them reach stderr; an ERROR (a
    worker's failure) is named by one warning. The warnings are the launch stopping the other workers after one
    failed (torch elastic's "Sending process ... closing signal SIGTERM", torch.multiprocessing's "Terminating
    process ... via signal SIGTERM"): whether they appear depends on which worker exits first, so they belong with
    the failure's report, not on the console."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        text = self.formatter.format(record)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(text + "\n")
        if record.levelno < logging.ERROR:
            return False
        from fuseforge_flyte.console import ensure_console_logging

        ensure_console_logging()
        logging.getLogger("fuseforge.training").warning(
            "a worker failed; torch elastic's report with its traceback: %s", self.path)
        return False


@contextlib.contextmanager
def worker_failures_to_log_file() -> Iterator[str]:
    """While a local elastic launch runs: the agent's worker-failure records go to a log file (its path)."""
    from fuseforge_flyte.user_errors import new_log_path

    path = new_log_path("workers")
    loggers, gate = [logging.getLogger(name) for name in STOPPING_WORKERS_LOGGERS], _ToFile(path)
    for logger in loggers:
        logger.addFilter(gate)
    try:
        yield path
    finally:
        for logger in loggers:
            logger.removeFilter(gate)
