"""Run outputs on Flyte's side: local or cluster run, the directories tasks return, flytekit's temporary ones.

Locally (`pyflyte run` without --remote) a training run writes into `output_dir` (its layout: training/outputs.py;
left empty, launch.py names a new ./outputs/<model>-<UTC time>). Directories that tasks return are used where they
are (not copied into flytekit's temporary sandbox), the outputs of cached tasks live in fuseforge's cache (so a
later cache hit finds them), and the temporary directories that flytekit makes in every process of the run are
removed when that process ends. On a cluster the model stays a FlyteDirectory in Flyte's store, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import uuid
from typing import Iterator

from fuseforge_flyte.cache_dirs import cache_root
from fuseforge_flyte.environ import environment

# Set by the launcher of a local run for its workers (they cannot ask flytekit's context reliably).
LOCAL_RUN_ENV = "FUSEFORGE_LOCAL_RUN"


def is_local_run() -> bool:
    """True inside a local Flyte execution (the launching process or its workers), False on a cluster pod."""
    if os.environ.get(LOCAL_RUN_ENV) == "1":
        return True
    from flytekit.core.context_manager import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    return state is not None and state.is_local_execution()


def task_output_dir(kind: str) -> str:
    """A directory for a task's returned files: locally in fuseforge's cache (a cached task's later hit reads
    it after this process ended), on a cluster a temporary one (flytekit uploads it)."""
    if not is_local_run():
        return tempfile.mkdtemp(prefix=f"fuseforge-{kind}-")
    path = os.path.join(cache_root("task-outputs"), kind, uuid.uuid4().hex)
    os.makedirs(path)
    return path


def local_outputs_identity() -> str:
    """Locally, the identity of the folder that holds the cached tasks' outputs (a random id kept in it, made when
    missing); "" on a cluster. It joins the key prepare_data is cached on, so that a cache entry whose folder was
    removed (a cleaned cache, another FUSEFORGE_CACHE) is a miss instead of a hit on files that are gone."""
    if not is_local_run():
        return ""
    root = cache_root("task-outputs")
    marker = os.path.join(root, ".identity")
    if not os.path.exists(marker):  # the first run under this root: one id for as long as the folder lives
        os.makedirs(root, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=root, prefix=".identity.", delete=False) as f:
            f.write(uuid.uuid4().hex)
        with contextlib.suppress(FileExistsError):  # runs started at once: the first link wins, whole
            os.link(f.name, marker)
        os.unlink(f.name)
    with open(marker) as f:
        return f.read().strip()


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
    path = tempfile.mkdtemp(prefix="fuseforge-run-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    previous = tempfile.tempdir
    tempfile.tempdir = path
    try:
        with environment({"TMPDIR": path}):
            yield path
    finally:
        tempfile.tempdir = previous
