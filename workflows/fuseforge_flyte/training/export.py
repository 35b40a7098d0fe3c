"""The trained model as a Hugging Face directory that plain transformers loads, without fuseforge.

The live model cannot be saved as it is: FSDP2 shards it and renames its class (`FSDPLlamaForCausalLM`),
ZeRO-3 leaves empty placeholders, fuseforge swaps module classes and the causal LM's forward, and the
engine built it with `use_cache=False`. So rank 0 takes the strategy's gathered full state dict, puts it
(without copying) into a fresh instance of the model's real transformers class built on the meta device,
re-ties tied weights, and lets transformers' own `save_pretrained` write it (its safetensors sharding, its
tied-weight and weight-format rules, config.json, generation_config.json). The live model is only read.

Every export is written into a temporary sibling directory, checked (config, and the safetensors headers
cover every tensor of the model with the right shape and dtype), then renamed into place: a crash leaves
no half-written model where a model is expected. A remote (fsspec) `out_dir` is written locally, checked,
then uploaded with config.json last (a directory without it is not loadable, so a partial upload is
never mistaken for a model).

Weights are saved in fp32 for every strategy: the weights the optimizer updates are fp32 (DDP and FSDP2
parameters, DeepSpeed's master copies), and a bf16 export would round away updates when training continues
from it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import sys
import tempfile
import uuid
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from fuseforge_flyte.training.distributed import DistContext

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# files of a tokenizer directory that must not overwrite the model's own
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")
_MODEL_FILE_NAMES = {CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, "pytorch_model.bin.index.json"}

_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class ExportError(RuntimeError):
    """The model directory could not be written, or what was written does not hold the whole model."""


# ---------------------------------------------------------------- what to save


def transformers_class(model: torch.nn.Module) -> type:
    """The model's real transformers class, looking through FSDP2's and fuseforge's dynamic subclasses.

    `config.architectures` must name a class that transformers can import by that name, so the first
    class of the MRO that is a PreTrainedModel reachable as `<its module>.<its name>` is taken:
    dynamic classes (`FSDPLlamaForCausalLM`, `Fused...`) are not attributes of any module.
    """
    from transformers import PreTrainedModel

    for cls in type(model).__mro__:
        if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)) or cls is PreTrainedModel:
            continue
        module = sys.modules.get(cls.__module__)
        if module is not None and getattr(module, cls.__name__, None) is cls:
            return cls
    raise ExportError(f"cannot find the transformers class of {type(model).__name__} "
                      f"(MRO: {[c.__name__ for c in type(model).__mro__]}): only transformers models can be exported")


def export_config(model: torch.nn.Module, cls: type):
    """A copy of the live config as a user of the saved model wants it: real class name, KV cache on."""
    config = copy.deepcopy(model.config)
    config.use_cache = True  # build_model turned it off for training; generation needs it
    config.architectures = [cls.__name__]
    if getattr(config, "distributed_config", None) is not None:
        config.distributed_config = None  # the export is a plain, unsharded model
    return config


def export_generation_config(model: torch.nn.Module, config):
    """The live model's generation config (a pretrained model's own settings are kept), cache on."""
    from transformers import GenerationConfig

    generation = getattr(model, "generation_config", None)
    generation = copy.deepcopy(generation) if generation is not None else GenerationConfig.from_model_config(config)
    generation.use_cache = True
    return generation


def _tied_pairs(model) -> List[Tuple[str, str]]:
    """(target, source) of the weights transformers ties in `model` (e.g. lm_head.weight -> embed_tokens)."""
    mapping = getattr(model, "all_tied_weights_keys", None)
    if mapping is None and hasattr(model, "get_expanded_tied_weights_keys"):
        mapping = model.get_expanded_tied_weights_keys(all_submodels=True)
    return list((mapping or {}).items())


def _model_for_saving(live: torch.nn.Module, state: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fresh, unpatched, unwrapped instance of the live model's class holding `state` (no copies)."""
    cls = transformers_class(live)
    config = export_config(live, cls)
    with torch.device("meta"):  # no memory, no init compute
        model = cls(config)
    for target, source in _tied_pairs(model):
        if target in state and source in state and not torch.equal(state[target], state[source]):
            raise ExportError(f"{target} and {source} are tied in {cls.__name__} (tie_word_embeddings) but "
                              f"the trained weights differ")
    result = model.load_state_dict(state, strict=False, assign=True)
    tied_targets = {target for target, _ in _tied_pairs(model)}
    missing = [k for k in result.missing_keys if k not in tied_targets]
    if missing or result.unexpected_keys:
        raise ExportError(f"the gathered state dict does not match {cls.__name__}: missing {missing[:8]} "
                          f"({len(missing)}), unexpected {result.unexpected_keys[:8]} "
                          f"({len(result.unexpected_keys)})")
    model.tie_weights()
    still_meta = [n for n, t in model.state_dict().items() if t.device.type == "meta"]
    if still_meta:
        raise ExportError(f"no weights for {still_meta[:8]} ({len(still_meta)} tensors)")
    model.generation_config = export_generation_config(live, config)
    return model


# ---------------------------------------------------------------- checking what was written


def _read_safetensors_header(path: str) -> Dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a .safetensors file; checks the data spans it."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ExportError(f"{path}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise ExportError(f"{path}: safetensors header of {header_len} bytes in a {size}-byte file")
        header = json.loads(handle.read(header_len))
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + header_len + end != size:
        raise ExportError(f"{path}: tensor data ends at byte {8 + header_len + end} but the file has {size}")
    return header


def _saved_tensors(directory: str) -> Dict[str, dict]:
    """Every tensor the directory's safetensors files hold (via the index when sharded)."""
    index_path = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as handle:
            weight_map: Dict[str, str] = json.load(handle)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = {}, [SAFE_WEIGHTS_NAME]
    saved: Dict[str, dict] = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ExportError(f"{directory}: weight file {name} is missing")
        for key, info in _read_safetensors_header(path).items():
            if key in saved:
                raise ExportError(f"{directory}: tensor {key} is stored twice")
            if weight_map and weight_map.get(key) != name:
                raise ExportError(f"{directory}: the index puts {key} in {weight_map.get(key)}, it is in {name}")
            saved[key] = info
    if weight_map and set(weight_map) != set(saved):
        raise ExportError(f"{directory}: the index names tensors no file holds: "
                          f"{sorted(set(weight_map) - set(saved))[:8]}")
    return saved


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())


def verify_model_dir(directory: str, model: torch.nn.Module) -> None:
    """Raise ExportError unless `directory` holds config.json and every tensor of `model`.

    Tied tensors (one storage, several names) must be stored under exactly one name. When the
    model's save format renames or merges tensors (transformers' weight conversions) the names no
    longer match one to one, and the stored element count must equal the model's.
    """
    with open(os.path.join(directory, CONFIG_NAME), encoding="utf-8") as handle:
        config = json.load(handle)
    expected_arch = [transformers_class(model).__name__]
    if config.get("architectures") != expected_arch or config.get("use_cache") is not True:
        raise ExportError(f"{directory}/config.json: architectures {config.get('architectures')} "
                          f"(expected {expected_arch}), use_cache {config.get('use_cache')} (expected true)")
    saved = _saved_tensors(directory)
    state = model.state_dict()
    groups: Dict[tuple, List[str]] = defaultdict(list)
    for name, tensor in state.items():
        groups[_storage_key(tensor)].append(name)
    if set(saved) - set(state):  # a converted save format: names differ, sizes must add up
        stored = sum(_numel(info["shape"]) for info in saved.values())
        wanted = sum(state[names[0]].numel() for names in groups.values())
        if stored != wanted:
            raise ExportError(f"{directory}: the safetensors files hold {stored} elements, the model {wanted}")
        return
    for names in groups.values():
        present = [n for n in names if n in saved]
        if len(present) != 1:
            raise ExportError(f"{directory}: tensor {' = '.join(names)} is stored {len(present)} times "
                              f"(expected once)")
        info, tensor = saved[present[0]], state[present[0]]
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if list(info["shape"]) != list(tensor.shape) or (dtype is not None and info["dtype"] != dtype):
            raise ExportError(f"{directory}: {present[0]} is stored as {info['dtype']}{info['shape']}, "
                              f"the model has {dtype}{list(tensor.shape)}")


def _numel(shape: Iterable[int]) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


# ---------------------------------------------------------------- writing


def _copy_tokenizer(tokenizer_dir: str, directory: str) -> List[str]:
    """Copy the tokenizer's files (not any model files it may sit next to) into `directory`."""
    if not os.path.isdir(tokenizer_dir):
        raise ExportError(f"tokenizer_dir {tokenizer_dir!r} is not a directory")
    copied = []
    for name in sorted(os.listdir(tokenizer_dir)):
        source = os.path.join(tokenizer_dir, name)
        if (not os.path.isfile(source) or name in _MODEL_FILE_NAMES or name.endswith(_MODEL_FILE_SUFFIXES)
                or os.path.exists(os.path.join(directory, name))):
            continue
        shutil.copy2(source, os.path.join(directory, name))
        copied.append(name)
    if not copied:
        raise ExportError(f"tokenizer_dir {tokenizer_dir!r} holds no tokenizer files")
    return copied


def _write_local(directory: str, live: torch.nn.Module, state: Dict[str, torch.Tensor],
                 tokenizer_dir: Optional[str], max_shard_size) -> None:
    model = _model_for_saving(live, state)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    for name in os.listdir(directory):  # safetensors writes owner-only files; readers may be another user
        os.chmod(os.path.join(directory, name), 0o644)
    if tokenizer_dir:
        _copy_tokenizer(tokenizer_dir, directory)
    verify_model_dir(directory, model)


def _is_previous_model(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, CONFIG_NAME))


def _place(tmp: str, out_dir: str) -> None:
    """Rename the finished `tmp` to `out_dir`; an empty `out_dir` or a previous model there is replaced."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not _is_previous_model(out_dir):
            raise ExportError(f"out_dir {out_dir!r} exists and is not empty (and holds no model to replace)")
        aside = f"{out_dir}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, aside)
        os.rename(tmp, out_dir)
        shutil.rmtree(aside, ignore_errors=True)
    elif os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"out_dir {out_dir!r} exists and is a file")
    else:
        os.rename(tmp, out_dir)  # replaces an empty directory atomically


def _upload(local: str, uri: str) -> None:
    """Copy the checked local directory to an fsspec URI, config.json last."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    fs.makedirs(root, exist_ok=True)
    names = sorted(os.listdir(local), key=lambda n: (n == CONFIG_NAME, n))
    for name in names:
        fs.put_file(os.path.join(local, name), f"{root.rstrip('/')}/{name}")


def _write(live: torch.nn.Module, state: Dict[str, torch.Tensor], out_dir: str, tokenizer_dir: Optional[str],
           max_shard_size) -> str:
    if "://" in out_dir and not out_dir.startswith("file://"):
        tmp = tempfile.mkdtemp(prefix="fuseforge-export-")
        try:
            _write_local(tmp, live, state, tokenizer_dir, max_shard_size)
            _upload(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out_dir
    target = os.path.abspath(out_dir[len("file://"):] if out_dir.startswith("file://") else out_dir)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:8]}")  # same filesystem
    try:
        _write_local(tmp, live, state, tokenizer_dir, max_shard_size)
        _place(tmp, target)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def save_pretrained_model(strategy, ctx: DistContext, out_dir: str, tokenizer_dir: Optional[str] = None, *,
                          max_shard_size=None) -> Optional[str]:
    """Write the strategy's model to `out_dir` as a Hugging Face model directory; `out_dir` on rank 0, else None.

    Collective: every rank must call it (FSDP2 and ZeRO gather the full weights). Only rank 0
    writes; the other ranks wait for it and raise if it failed, so no rank goes on alone.
    `out_dir` is a local path (an empty or missing directory, or a previous export, which is
    replaced) or an fsspec URI. `tokenizer_dir`'s files are copied next to the weights.
    `max_shard_size` (e.g. "5GB") overrides transformers' default shard size. The live model stays
    as it is (wrapped, patched, training state untouched).
    """
    if not out_dir:
        raise ValueError("save_pretrained_model: out_dir is empty")
    return write_on_rank0(strategy, ctx, out_dir,
                          lambda state: _write(strategy.inner, state, out_dir, tokenizer_dir, max_shard_size))


def write_on_rank0(strategy, ctx: DistContext, out_dir: str, write) -> Optional[str]:
    """Gather the strategy's full state (collective), `write(state)` on rank 0; the others wait for it and raise
    if it failed, so no rank goes on alone. `write`'s return value on rank 0, else None."""
    state = strategy.full_state_dict()
    failure: Optional[BaseException] = None
    written = None
    if ctx.is_main:
        if state is None:
            failure = ExportError(f"{type(strategy).__name__}.full_state_dict() gave nothing on rank 0")
        else:
            try:
                written = write(state)
            except Exception as err:  # told to the other ranks below, then re-raised here
                failure = err
        del state
    message = ctx.broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise ExportError(f"rank 0 failed to write the model to {out_dir!r}: {message}")
    return written
