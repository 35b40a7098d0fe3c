"""Checkpoint pickles read without running code: DCP's ``.metadata`` and DeepSpeed's ``torch.save`` files.

torch's FileSystemReader reads ``.metadata`` with a plain ``pickle.load``, and DeepSpeed's checkpoint engine
loads its files with ``torch.load(weights_only=False)``, so a checkpoint that is loaded under
``allow_unsigned_checkpoints`` (integrity only, signing.py) could otherwise run code.

DCP: an unpickler whose allow-list is what a DCP save of this engine's FSDP state pickles (read off real
checkpoints): the dataclasses of torch.distributed.checkpoint.metadata, the file system writer's _StorageInfo,
torch.Size, torch's dtypes, layouts and memory formats, and the checkpoint's path (pathlib).

DeepSpeed: ``torch.load(weights_only=True)`` (tensors and plain containers) with DEEPSPEED_GLOBALS allowed for
that load only (torch.serialization.safe_globals): what ZeRO-2 and ZeRO-3 optimizer states pickle besides
(read off real checkpoints), plus the dynamic loss scaler an fp16 run saves in their place (DeepSpeed's
stage_1_and_2.py/stage3.py state_dict). Before anything is loaded, `refusal` lists the globals each file's
pickle names (statically, torch.serialization.get_unsafe_globals_in_checkpoint) so that a planted one stops
the run naming the file; the load itself admits no more.

Anything else is refused, naming the file.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import IO, Any, Dict, List, Optional

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
DEEPSPEED_DIR, DEEPSPEED_SUFFIX = "deepspeed/", ".pt"  # what DeepSpeedStrategy.save writes, loaded by torch.load
DEEPSPEED_GLOBALS = ("deepspeed.utils.tensor_fragment.fragment_address",  # ZeRO-1/2 (and bf16) param mappings
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # fp32 and bf16 runs
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")  # fp16 runs


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


def _deepspeed_globals() -> List[type]:
    import importlib

    found = []
    for dotted in DEEPSPEED_GLOBALS:
        module, name = dotted.rsplit(".", 1)
        found.append(getattr(importlib.import_module(module), name))
    return found


def deepspeed_load(path: str, map_location: Any = None) -> Any:
    """What DeepSpeed's checkpoint engine loads from `path`, through torch.load(weights_only=True) with
    DEEPSPEED_GLOBALS allowed for this load only; RefusedPickle naming the file for anything else."""
    with torch.serialization.safe_globals(_deepspeed_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise RefusedPickle(f"DeepSpeed file {path} was refused by torch.load(weights_only=True): "
                                f"{_weights_only_reason(err)}") from None


def _weights_only_reason(err: Exception) -> str:
    """The line of torch's weights_only error that says what was refused (not its advice around it)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    said = next((line for line in lines[1:] if not line.startswith("Check the documentation")), None)
    if said is None:
        return type(err).__name__
    return re.sub(r"^WeightsUnpickler error: ", "", said).split(" Please ")[0]


def _deepspeed_refusal(path: str) -> Optional[str]:
    """Why DeepSpeed file `path` must not be loaded (a global outside the allow-list, not a torch.save zip), or None."""
    with torch.serialization.safe_globals(_deepspeed_globals()):
        unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    if unsafe:
        return f"it names {unsafe[0]}, which a DeepSpeed checkpoint never holds (a pickle that can run code)"
    return None


def refusal(directory: str, files: Dict[str, Any]) -> Optional[str]:
    """Why a DCP metadata file or a DeepSpeed file among `files` (paths relative to `directory`) must not be
    loaded, or None."""
    for rel in sorted(files):
        path = os.path.join(directory, rel)
        if rel.rsplit("/", 1)[-1].endswith(SUFFIX):
            try:
                with open(path, "rb") as handle:
                    load(handle)
            except RefusedPickle as err:
                return f"file {rel} was refused: {err}"
            except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
                return f"file {rel} is not DCP metadata ({type(err).__name__}: {err})"
        elif rel.startswith(DEEPSPEED_DIR) and rel.endswith(DEEPSPEED_SUFFIX):
            try:
                reason = _deepspeed_refusal(path)
            except (OSError, ValueError, RuntimeError, pickle.UnpicklingError, EOFError) as err:
                return f"file {rel} is not a file DeepSpeed writes ({type(err).__name__}: {err})"
            if reason:
                return f"file {rel} was refused: {reason}"
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
