"""The environment of a local `pyflyte run` that a test starts as a process of its own.

flytekit keeps its local task cache in `~/.flyte/local-cache`, and a cached preparation's entry names the folder its
shards went to. The tests point FUSEFORGE_CACHE at folders pytest removes later, so an entry left by an earlier
session would send a later run to a folder that is gone: the process gets a home of this session's own (the
in-process runs get their own cache location in conftest.py)."""

from __future__ import annotations

import os
import tempfile

SESSION_HOME = tempfile.mkdtemp(prefix="fuseforge-tests-home-")


def local_run_env(**variables: str) -> dict:
    """os.environ with this session's home and the given variables."""
    return dict(os.environ, HOME=SESSION_HOME, **variables)
