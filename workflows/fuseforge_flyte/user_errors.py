"""A user error ends a run with one line naming the option and its fix; the traceback goes to a log file.

pyflyte prints every exception as a rich traceback of 45-390 lines (flytekit's frames, torch elastic's), above a
message that already says what was wrong. For an error in what the user gave (a setting, the data, the model,
the resume settings) the frames add nothing, so under pyflyte (and the engine's CLI) such an error prints:

    full traceback: ~/.cache/fuseforge/logs/<time>.log (pyflyte --verbose run ... prints it)
    error: --model: unknown model 'tiny-lama' (did you mean 'tiny-llama'?) ...

`pyflyte --verbose run ...` keeps pyflyte's own output. Any other exception (a bug, a lost machine) is printed as
pyflyte always did. Messages name settings as the engine's classes do (`TrainSpec.steps`, `DataSpec.dataset`);
the line names the option as the user typed it (`--steps`).
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
from typing import Optional

from fuseforge_flyte.cache_dirs import cache_root


class WorkerUserError(RuntimeError):
    """Raised by a launcher when its workers failed on the user's input (training/permanent.py's PermanentFailure:
    a failure no restart fixes). The message holds a header line, then one 'rank N: Type: message' line per worker
    that recorded its error; the first of those is the line a user sees. Defined here, below the engine, so that
    reporting a user error needs nothing of the engine."""


# What a user's input causes: bad values and types, missing or unreadable files (UnicodeDecodeError is a
# ValueError), and the verdict of workers that failed in a way no restart fixes (WorkerUserError).
USER_ERROR_TYPES = (ValueError, TypeError, FileNotFoundError, WorkerUserError)
_FIELD = re.compile(r"\b(?:TrainSpec|DataSpec|DPOSettings)\.(\w+)")
_WORKER_PREFIX = re.compile(r"^rank \d+: \w+: ")
# flytekit puts this in front of the message of an exception raised by a task (the same exception object)
_FLYTEKIT_PREFIX = re.compile(r"^Error encountered while executing '[^']*':\s*")


def _chain(error: BaseException):
    """The exception and its causes, outermost first (cycles cut)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def user_error_line(error: BaseException) -> Optional[str]:
    """The one line for a user error, or None for other errors: the message of the outermost user error in the
    chain (ours; what it was raised from is the library's detail), with the options named as --name."""
    first = next((e for e in _chain(error) if isinstance(e, USER_ERROR_TYPES)), None)
    if first is None:
        return None
    message = _FLYTEKIT_PREFIX.sub("", str(first))
    if isinstance(first, WorkerUserError):  # the first worker's recorded error, after the verdict's header line
        recorded = [line.strip() for line in message.splitlines() if _WORKER_PREFIX.match(line.strip())]
        message = _WORKER_PREFIX.sub("", recorded[0]) if recorded else message
    message = " ".join(message.split())  # one line
    return _FIELD.sub(lambda m: f"--{m.group(1)}", message)


def log_dir() -> str:
    return cache_root("logs")


def new_log_path(kind: str = "") -> str:
    """A new file name in log_dir(): UTC time, pid and an optional kind ("workers")."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
    return os.path.join(log_dir(), f"{stamp}-{kind}.log" if kind else f"{stamp}.log")


def write_traceback(error: BaseException) -> str:
    """The full traceback in a new log file; its path."""
    os.makedirs(log_dir(), exist_ok=True)
    path = new_log_path()
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(" ".join(sys.argv) + "\n\n")
        handle.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    return path


def report(error: BaseException, rerun_hint: str) -> bool:
    """Print a user error as two lines on stderr (where the traceback went, then the error); False for others."""
    line = user_error_line(error)
    if line is None:
        return False
    path = write_traceback(error)
    print(f"full traceback: {path} ({rerun_hint} prints it)", file=sys.stderr)
    print(f"error: {line}", file=sys.stderr)
    return True


def install_for_pyflyte() -> None:
    """Route pyflyte's exception printer through `report` (only inside a pyflyte process; once)."""
    utils = sys.modules.get("flytekit.clis.sdk_in_container.utils")
    if utils is None or getattr(utils.pretty_print_exception, "fuseforge", False):
        return
    original = utils.pretty_print_exception

    def pretty_print_exception(error: Exception, verbosity: int = 1) -> None:
        if verbosity > 0 or not report(error, "pyflyte --verbose run ..."):
            original(error, verbosity)

    pretty_print_exception.fuseforge = True  # type: ignore[attr-defined]
    utils.pretty_print_exception = pretty_print_exception
