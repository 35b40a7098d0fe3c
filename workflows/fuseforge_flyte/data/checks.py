"""Does prepared data fit a model: token ids within its embedding, seq_len within its positions.

Checked before any training starts, since an id past the embedding fails deep inside a CUDA
kernel and a seq_len past the positions silently extrapolates. A preset is a random-init shape
whose vocabulary is set from the data (the engine sizes it from the manifest), so only its
positions are checked.
"""

from __future__ import annotations

from typing import Mapping, Optional


def _numbers(data) -> Mapping[str, int]:
    if isinstance(data, Mapping):
        return data
    return {k: getattr(data, k) for k in ("vocab_size", "max_token_id", "seq_len") if hasattr(data, k)}


def load_model_config(model: str):
    """The transformers config of DataSpec.model (preset, directory or config.json, HF id)."""
    import os

    from fuseforge_flyte.training.models import load_config

    path = model[len("file://"):] if model.startswith("file://") else model
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"DataSpec.model: {model!r} has no config.json")
    return load_config(path)


def check_fits_model(manifest_or_numbers, model_config, *, preset: Optional[bool] = None) -> None:
    """Raise ValueError naming both sides when the data does not fit the model.

    manifest_or_numbers: a DataManifest or a mapping with vocab_size, max_token_id, seq_len (any may
    be left out). model_config: a transformers config, or a model name (preset/dir/HF id),
    in which case `preset` defaults to whether it is a preset name. Presets skip the vocabulary check.
    """
    from fuseforge_flyte.training.models import PRESETS

    config = model_config
    if isinstance(model_config, str):
        if preset is None:
            preset = model_config in PRESETS
        config = load_model_config(model_config)
    numbers = _numbers(manifest_or_numbers)
    n_vocab = getattr(config, "vocab_size", None)
    if not preset and n_vocab is not None and "vocab_size" in numbers:
        vocab, top = int(numbers["vocab_size"]), int(numbers.get("max_token_id", numbers["vocab_size"] - 1))
        if vocab > n_vocab or top >= n_vocab:
            raise ValueError(f"the tokenizer's ids go up to {top} (vocabulary {vocab}) but the model's vocab_size "
                             f"is {n_vocab}: use the model's own tokenizer (DataSpec.tokenizer='') or resize the "
                             "model's embeddings")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and "seq_len" in numbers and int(numbers["seq_len"]) > int(positions):
        raise ValueError(f"seq_len {numbers['seq_len']} is above the model's max_position_embeddings {positions}")
