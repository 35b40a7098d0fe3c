"""Where a run's results go, and what a finished local run leaves behind.

Locally (`pyflyte run` without --remote) a training run writes into `output_dir`: the model (`model/`, a Hugging
Face directory), `metrics.json` and `settings.json` (the run's resolved settings); left empty it is
`./outputs/<model>-<UTC time>`. Directories that tasks return are used where they are (not copied into
flytekit's temporary sandbox), the outputs of cached tasks live in fuseforge's cache (so a later cache hit finds
them), and the temporary directories that flytekit makes in every process of the run are removed when that
process ends. On a cluster the model stays a FlyteDirectory in Flyte's store, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Iterator

OUTPUTS_ROOT = "outputs"
MODEL_SUBDIR = "model"
METRICS_FILE = "metrics.json"
SETTINGS_FILE = "settings.json"
# Set by the launcher of a local run for its workers (they cannot ask flytekit's context reliably).
LOCAL_RUN_ENV = "FUSEFORGE_LOCAL_RUN"


def is_local_run() -> bool:
    """True inside a local Flyte execution (the launching process or its workers), False on a cluster pod."""
    if os.environ.get(LOCAL_RUN_ENV) == "1":
        return True
    from flytekit.core.context_manager import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    return state is not None and state.is_local_execution()


def new_output_dir(output_dir: str, model: str) -> str:
    """The absolute directory a local run writes to: `output_dir`, or a new ./outputs/<model>-<UTC time>."""
    if output_dir:
        return os.path.abspath(os.path.expanduser(output_dir))
    from fuseforge_flyte.training.tracking import default_run_name

    base = os.path.abspath(os.path.join(OUTPUTS_ROOT, default_run_name(model)))
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for attempt in range(1, 1000):  # two runs started in the same second (compare) get their own directory
        candidate = base if attempt == 1 else f"{base}-{attempt}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"output_dir: {base}-* are all taken; name one with output_dir")


def model_dir(output_dir: str) -> str:
    return f"{output_dir.rstrip('/')}/{MODEL_SUBDIR}"


def write_run_record(output_dir: str, metrics: Any, settings: Any) -> None:
    """metrics.json and settings.json (both dataclasses) beside the model: what ran and what it measured.
    `output_dir` is a local directory or an fsspec URI."""
    import fsspec

    for name, value in ((METRICS_FILE, metrics), (SETTINGS_FILE, settings)):
        with fsspec.open(f"{output_dir.rstrip('/')}/{name}", "w", encoding="utf-8", auto_mkdir=True) as handle:
            json.dump(dataclasses.asdict(value), handle, indent=2, default=str)
            handle.write("\n")


def task_output_dir(kind: str) -> str:
    """A directory for a task's returned files: locally in fuseforge's cache (a cached task's later hit reads
    it after this process ended), on a cluster a temporary one (flytekit uploads it)."""
    if not is_local_run():
        return tempfile.mkdtemp(prefix=f"fuseforge-{kind}-")
    from fuseforge_flyte.training.models import cache_root

    path = os.path.join(cache_root("task-outputs"), kind, uuid.uuid4().hex)
    os.makedirs(path)
    return path


def returned_directory(path: str):
    """The FlyteDirectory a task returns for `path`: used where it is locally, uploaded on a cluster."""
    from flytekit.types.directory import FlyteDirectory

    return FlyteDirectory(path=path, remote_directory=False) if is_local_run() else FlyteDirectory(path=path)


def flytekit_temp_dirs() -> list:
    """The temporary directories flytekit made in this process (at import, for its default sandbox)."""
    try:
        from flytekit.configuration import Config
        from flytekit.core import data_persistence
    except ImportError:
        return []
    candidates = [getattr(data_persistence, "flyte_tmp_dir", None),
                  Config.__dataclass_fields__["local_sandbox_path"].default]
    temp_root = os.path.realpath(tempfile.gettempdir())
    return [path for path in candidates if isinstance(path, str) and os.path.basename(path).startswith("flyte")
            and os.path.dirname(os.path.realpath(path)) == temp_root]


_REGISTERED = False


def remove_temp_dirs_at_exit() -> None:
    """Remove flytekit's temporary directories of this process when it exits (registered once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    paths = flytekit_temp_dirs()  # now: the temporary root may change later (private_temp_dir)

    def remove() -> None:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    _REGISTERED = True


@contextlib.contextmanager
def private_temp_dir() -> Iterator[str]:
    """A temporary root for one local launch: the workers (through TMPDIR) and torch elastic's agent make their
    temporary directories there (flytekit's, one set per process; torch elastic's logs). It is removed when this
    process exits, after flytekit has taken the task's outputs (a returned directory may lie there)."""
    from fuseforge_flyte.training.environ import environment

    path = tempfile.mkdtemp(prefix="fuseforge-run-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    previous = tempfile.tempdir
    tempfile.tempdir = path
    try:
        with environment({"TMPDIR": path}):
            yield path
    finally:
        tempfile.tempdir = previous
