"""Where fuseforge keeps its local caches: one root (FUSEFORGE_CACHE, default ~/.cache/fuseforge), one folder per kind.

A module of its own because the data path, the engine, the error reporter and the Flyte layer all keep files
there, and none of them should import another just to find the folder.
"""

from __future__ import annotations

import os

CACHE_ENV = "FUSEFORGE_CACHE"  # root of fuseforge's local caches (default ~/.cache/fuseforge)


def cache_root(kind: str) -> str:
    """One of fuseforge's local caches ("models": downloaded model directories, "data": data prepared by
    the engine itself) under $FUSEFORGE_CACHE."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fuseforge")
    return os.path.join(root, kind)
