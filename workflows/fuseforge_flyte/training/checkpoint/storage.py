"""Where checkpoints live: a root on any fsspec store, with atomic JSON writes and fsync on a local filesystem.

On a local filesystem a save goes into a hidden temp directory that is renamed into place once its manifest is
in it (after an fsync of every file), so a kill at any point leaves the previous checkpoint loadable; object
stores have no rename, so each rank uploads its files and rank 0 writes the manifest last (an object PUT is
atomic). For several nodes, a local path must be a shared filesystem.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Dict, List, Optional

from fuseforge_flyte.training.checkpoint.layout import MARKER, SKIPPED, Entry, step_of


class Store:
    """A checkpoint root on fsspec; `local` when it is a plain filesystem path (renames are atomic)."""

    def __init__(self, root: str):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.given = root  # as the user wrote it, for messages
        self.fs, path = fsspec.core.url_to_fs(root)
        self.root = path.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def list(self) -> List[Entry]:
        if not self.fs.exists(self.root):
            return []
        entries = []
        for item in self.fs.ls(self.root, detail=True):  # directories only: a file is never a checkpoint
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            step = step_of(name)
            if step is not None and item.get("type") == "directory":
                entries.append(Entry(step, name, self.fs.exists(self.path(name, MARKER)),
                                     self.fs.exists(self.path(name, SKIPPED))))
        return sorted(entries, key=lambda e: e.step)

    def read_json(self, *parts: str) -> Dict:
        with self.fs.open(self.path(*parts), "r") as handle:
            return json.load(handle)

    def write_json(self, obj: Dict, *parts: str) -> None:
        target = self.path(*parts)
        if not self.local:  # an object PUT is atomic
            with self.fs.open(target, "w") as handle:
                json.dump(obj, handle)
            return
        tmp = f"{target}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)

    def unwritable(self) -> Optional[OSError]:
        """Local filesystem: what writing into the root meets (a read-only filesystem, no permission), or None.
        The probe is a temp name of write_json's, so a kill cannot leave anything that is not cleaned up."""
        if not self.local:
            return None
        probe = f"{self.path('probe.json')}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(probe, "w", encoding="utf-8"):
                pass
            os.unlink(probe)
        except OSError as err:
            return err
        return None

    def names(self, *parts: str) -> List[str]:
        """The names directly under root/parts."""
        return [item.rstrip("/").rsplit("/", 1)[-1] for item in self.fs.ls(self.path(*parts), detail=False)]

    def remove(self, name: str) -> None:
        """Remove checkpoint directory `name` (never a file: pruning removes only what a save wrote)."""
        if not self.fs.isdir(self.path(name)):
            raise NotADirectoryError(f"{self.path(name)} is not a checkpoint directory")
        self.fs.rm(self.path(name), recursive=True)


def local_files(directory: str) -> Dict[str, int]:
    """{path relative to `directory`, with "/": size} of every file under it."""
    files = {}
    for base, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(base, name)
            files[os.path.relpath(full, directory).replace(os.sep, "/")] = os.path.getsize(full)
    return files


def fsync_tree(directory: str) -> None:
    """Flush every file under `directory`, and its parent directory, to disk (before the rename commits it)."""
    for base, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(os.path.dirname(os.path.abspath(directory)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
