"""Does prepared data fit a model: token ids within its embedding, seq_len within its positions.

Checked before any training starts, since an id past the embedding fails deep inside a CUDA
kernel and a seq_len past the positions silently extrapolates. A preset is a random-init shape
whose vocabulary is set from the data (the engine sizes it from the manifest), so only its
positions are checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fuseforge_flyte.model_names import load_config


@dataclass(frozen=True)
class DataNumbers:
    """What a model must hold of some data: the tokenizer's vocabulary and highest id, the rows' length.
    None: not known (yet), not checked."""

    vocab_size: Optional[int] = None
    max_token_id: Optional[int] = None  # None: vocab_size - 1
    seq_len: Optional[int] = None

    @classmethod
    def of(cls, manifest) -> "DataNumbers":
        """The numbers of prepared data (a data.shards.DataManifest)."""
        return cls(vocab_size=manifest.vocab_size, max_token_id=manifest.max_token_id, seq_len=manifest.seq_len)


def load_model_config(model: str):
    """The transformers config of DataSpec.model (preset, directory or config.json, HF id)."""
    import os

    path = model[len("file://"):] if model.startswith("file://") else model
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"DataSpec.model: {model!r} has no config.json")
    return load_config(path)


def check_fits_model(numbers: DataNumbers, config, *, preset: bool = False) -> None:
    """Raise ValueError naming both sides when the data does not fit the model (`config`: its transformers
    config). A preset (`preset`) takes its vocabulary from the data, so only its positions are checked."""
    n_vocab = getattr(config, "vocab_size", None)
    if not preset and n_vocab is not None and numbers.vocab_size is not None:
        vocab = int(numbers.vocab_size)
        top = int(numbers.max_token_id if numbers.max_token_id is not None else vocab - 1)
        if vocab > n_vocab or top >= n_vocab:
            raise ValueError(f"the tokenizer's ids go up to {top} (vocabulary {vocab}) but the model's vocab_size "
                             f"is {n_vocab}: use the model's own tokenizer (DataSpec.tokenizer='') or resize the "
                             "model's embeddings")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and numbers.seq_len is not None and int(numbers.seq_len) > int(positions):
        raise ValueError(f"seq_len {numbers.seq_len} is above the model's max_position_embeddings {positions}")


# Attention implementations that honour restarting position_ids as document boundaries in transformers:
# sdpa/eager/flex through masking_utils' packed-sequence mask, flash attention through its varlen path.
_PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def packing_unsupported_reason(config) -> Optional[str]:
    """Why packed rows would leak attention across examples for this model, or None when they do not.

    transformers builds a block-diagonal mask from restarting `position_ids` (attention_mask None, no
    cache) in `masking_utils`, which a model's code reaches through `create_causal_mask` (or the sliding-
    window variant); a model whose modeling code does not call it, or an attention implementation outside
    those known to take the packed mask, would attend across the packed examples.
    """
    import importlib
    import inspect

    try:
        from transformers import masking_utils
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as err:  # pragma: no cover - an older transformers
        return f"this transformers has no packed-sequence masks ({err})"
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return "this transformers does not detect packed sequences from position_ids"
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation not in _PACKING_ATTENTION:
        return f"attention implementation {implementation!r} is not known to take packed-sequence masks"
    model_type = getattr(config, "model_type", "")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model type {model_type!r} has no causal-LM class in transformers"
    try:
        module = importlib.import_module(f"transformers.models.{model_type.replace('-', '_')}.modeling_"
                                         f"{model_type.replace('-', '_')}")
        source = inspect.getsource(module)
    except (ImportError, OSError, TypeError) as err:
        return f"the modeling code of {model_type!r} cannot be inspected ({type(err).__name__})"
    if "create_causal_mask" not in source and "create_sliding_window_causal_mask" not in source:
        return f"the modeling code of {model_type!r} does not build its mask through transformers' masking_utils"
    return None
