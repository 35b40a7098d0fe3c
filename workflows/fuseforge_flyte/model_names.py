"""What a model name means: a built-in preset, a config.json, a Hugging Face model directory (local or an fsspec
URI), a peft adapter directory (standing for its base) or a hub id; and the transformers config it names.

Below both the data path (which checks prepared data against the model's config and picks the model's tokenizer)
and the engine (training/models.py builds the model on top of this), so neither imports the other to ask.
Nothing here loads weights or downloads more than a config.json.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Dict, Optional

from fuseforge_flyte import hub

# The vocabulary of the tiny presets: the byte tokenizer's 256 bytes plus BOS, EOS and PAD (data/benchmark.py's
# bench:bytes data, whose ids they hold without a tokenizer).
BYTE_VOCAB_SIZE = 259

_TINY = dict(vocab_size=BYTE_VOCAB_SIZE, num_hidden_layers=2, max_position_embeddings=4096)

# name -> (model_type, config kwargs). Realistic shapes are those of the public checkpoints.
PRESETS: Dict[str, tuple] = {
    "tiny-llama": ("llama", dict(_TINY, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                 num_key_value_heads=2)),
    "tiny-qwen2": ("qwen2", dict(_TINY, hidden_size=96, intermediate_size=240, num_attention_heads=6,
                                 num_key_value_heads=2)),
    "tiny-qwen3": ("qwen3", dict(_TINY, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16)),
    "tiny-mistral": ("mistral", dict(_TINY, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                     num_key_value_heads=1, sliding_window=None)),
    "tiny-gemma2": ("gemma2", dict(_TINY, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                   sliding_window=64, tie_word_embeddings=True)),
    "llama-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               rope_theta=500000.0, max_position_embeddings=131072,
                               tie_word_embeddings=True)),
    "llama3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                rope_theta=500000.0, max_position_embeddings=8192)),
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                   num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                   rope_theta=1000000.0, max_position_embeddings=32768,
                                   tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                 rope_theta=1000000.0, max_position_embeddings=32768)),
    "mistral-7b": ("mistral", dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   rope_theta=1000000.0, max_position_embeddings=32768,
                                   sliding_window=None)),
    "gemma2-2b": ("gemma2", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                                 num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                                 max_position_embeddings=8192, tie_word_embeddings=True)),
}

# files that hold Hugging Face weights; one of them next to config.json makes a directory a pretrained model
SAFETENSORS_SUFFIX = ".safetensors"
BIN_PREFIX, BIN_SUFFIX = "pytorch_model", ".bin"
ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory a peft adapter


# ---------------------------------------------------------------- paths and URIs


def is_uri(source: str) -> bool:
    return "://" in source


def local_path(source: str) -> str:
    """`source` as a local path (file:// stripped); '' for other URIs."""
    if source.startswith("file://"):
        return source[len("file://"):]
    return "" if is_uri(source) else source


def _known_protocol(name: str) -> bool:
    import fsspec

    protocol = name.split("://", 1)[0]
    return protocol in fsspec.available_protocols()


def looks_like_hf_id(name: str) -> bool:
    """'org/name': the shape of a Hugging Face model id."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def is_weight_file(filename: str) -> bool:
    return filename.endswith(SAFETENSORS_SUFFIX) or (filename.startswith(BIN_PREFIX) and filename.endswith(BIN_SUFFIX))


def is_pretrained_dir(path: str) -> bool:
    """A local directory with config.json and Hugging Face weights (safetensors or pytorch_model*.bin)."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(is_weight_file(f) for f in os.listdir(path)))


# ---------------------------------------------------------------- peft adapter directories


def adapter_dir(name: str) -> Optional[str]:
    """The local directory of a peft adapter (adapter_config.json, no full model weights), else None."""
    path = local_path(name) if name else None
    if not path or not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return None
    return None if is_pretrained_dir(path) else path


def adapter_base(directory: str) -> str:
    """The base model an adapter directory was trained on (its base_model_name_or_path)."""
    with open(os.path.join(directory, ADAPTER_CONFIG), encoding="utf-8") as handle:
        base = json.load(handle).get("base_model_name_or_path") or ""
    if not base:
        raise ValueError(f"TrainSpec.model: the adapter in {directory} names no base_model_name_or_path "
                         "(set it in adapter_config.json to the model the adapter was trained on)")
    return base


def base_source(name: str) -> str:
    """The model to build for `name`: an adapter directory's base (training/lora.py adds the adapter), else
    `name` itself."""
    directory = adapter_dir(name)
    return adapter_base(directory) if directory else name


# ---------------------------------------------------------------- known names and their configs


def is_known_model(name: str) -> bool:
    """A preset, an existing local path (or file:// URI), an fsspec URI, or something shaped like an HF id."""
    if name in PRESETS:
        return True
    name = base_source(name)
    local = local_path(name)
    if local:
        return os.path.exists(local) or (not is_uri(name) and looks_like_hf_id(name))
    return is_uri(name) and _known_protocol(name)


def unknown_model_message(name: str, field: str = "model") -> str:
    close = difflib.get_close_matches(name, sorted(PRESETS), n=1)
    if close:
        return f"TrainSpec.{field}: unknown model {name!r}: did you mean {close[0]!r}?"
    return (f"TrainSpec.{field}: unknown model {name!r}: use a preset ({', '.join(sorted(PRESETS))}), "
            f"a Hugging Face model directory or its fsspec URI (s3://, gs://, file://), a path to a config.json, "
            f"or a Hugging Face id like 'org/name'")


def _config_from_dict(raw: dict, where: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = dict(raw)
    model_type = raw.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"TrainSpec.model: {where} has unknown or missing model_type {model_type!r}")
    return CONFIG_MAPPING[model_type].from_dict(raw)


def _remote_config_uri(uri: str) -> str:
    return uri if uri.endswith(".json") else uri.rstrip("/") + "/config.json"


def _read_remote_json(uri: str) -> dict:
    import fsspec

    try:
        with fsspec.open(uri, "r", encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise FileNotFoundError(f"TrainSpec.model: {uri} does not exist (a model directory needs a config.json)") \
            from None


def load_config(name: str, vocab_size: Optional[int] = None, *, option: str = "model"):
    """The transformers config for a preset, a config.json path or URI (or its directory) or an HF id
    (`option`: the input that named it, for the message when the hub cannot be reached).

    `vocab_size` sets a preset's vocabulary (a from-scratch model takes the data tokenizer's); it is
    ignored for everything else, whose vocabulary is fixed by its config (the data layer checks the fit).
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    name = base_source(name)
    if name in PRESETS:
        model_type, kwargs = PRESETS[name]
        if vocab_size is not None:
            if int(vocab_size) < 1:
                raise ValueError(f"load_config({name!r}): vocab_size must be positive, got {vocab_size}")
            kwargs = dict(kwargs, vocab_size=int(vocab_size))
        return CONFIG_MAPPING[model_type](**kwargs)
    local = local_path(name)
    if local and os.path.exists(local):
        path = os.path.join(local, "config.json") if os.path.isdir(local) else local
        if not os.path.isfile(path):
            raise FileNotFoundError(f"TrainSpec.model: {name} is a directory without a config.json")
        with open(path, encoding="utf-8") as handle:
            return _config_from_dict(json.load(handle), path)
    if local and name.startswith("file://"):
        raise FileNotFoundError(f"TrainSpec.model: {name} does not exist")
    if is_uri(name):
        uri = _remote_config_uri(name)
        return _config_from_dict(_read_remote_json(uri), uri)
    if looks_like_hf_id(name):
        return hub.load_hub_id(lambda: AutoConfig.from_pretrained(name), option=option, hub_id=name, what="model")
    raise ValueError(unknown_model_message(name))
