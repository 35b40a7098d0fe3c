"""DCP's ``.metadata`` read without running code: an unpickler that admits only what that metadata is made of.

torch's FileSystemReader reads ``.metadata`` with a plain ``pickle.load``, so a checkpoint that is loaded under
``allow_unsigned_checkpoints`` (integrity only, signing.py) could otherwise run code. The allow-list is what a
DCP save of this engine's FSDP state pickles (read off real checkpoints): the dataclasses of
torch.distributed.checkpoint.metadata, the file system writer's _StorageInfo, torch.Size, torch's dtypes,
layouts and memory formats, and the checkpoint's path (pathlib). Anything else is refused, naming the file.
"""

from __future__ import annotations

import os
import pickle
from typing import IO, Any, Dict, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, from torch's own table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32, torch.strided, ...
SUFFIX = ".metadata"


class RefusedPickle(pickle.UnpicklingError):
    """A DCP metadata pickle names something outside the allow-list (it could run code)."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise RefusedPickle(f"it names {module}.{name}, which DCP metadata never holds (a pickle that can run code)")


def load(stream: IO[bytes]) -> Metadata:
    """DCP metadata from `stream`, or RefusedPickle."""
    metadata = _Unpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise RefusedPickle(f"it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def refusal(directory: str, files: Dict[str, Any]) -> Optional[str]:
    """Why a DCP metadata file among `files` (paths relative to `directory`) must not be loaded, or None."""
    for rel in sorted(files):
        if rel.rsplit("/", 1)[-1].endswith(SUFFIX):
            try:
                with open(os.path.join(directory, rel), "rb") as handle:
                    load(handle)
            except RefusedPickle as err:
                return f"file {rel} was refused: {err}"
            except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
                return f"file {rel} is not DCP metadata ({type(err).__name__}: {err})"
    return None


class RestrictedReader(FileSystemReader):
    """torch's FileSystemReader with `load` in place of its plain pickle.load of the metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
