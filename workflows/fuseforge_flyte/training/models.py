"""Models to train: built-in presets, config files or Hugging Face ids, and their FLOPs for MFU.

Presets are built from configs (random init, seeded, no download): tiny ones whose
vocabulary fits the byte tokenizer, for CPU runs, and the shapes of public models
for GPU benchmarks (weights are irrelevant to throughput and memory).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict

import torch

from fuseforge_flyte.training.data import BYTE_VOCAB_SIZE

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

# Dense (no sparsity) peak tensor-core FLOP/s per GPU, by substring of torch.cuda.get_device_name(),
# most specific first. fp32 training is rated against the TF32 peak. Vendor data sheets.
PEAK_FLOPS = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 418e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("H800", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("GH200", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("A800", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12}),
    ("L40", {"bf16": 181e12, "fp16": 181e12, "fp32": 90e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12}),
]
PEAK_TFLOPS_ENV = "FUSEFORGE_PEAK_TFLOPS"  # override for GPUs missing from the table


def is_known_model(name: str) -> bool:
    """A preset, an existing config path, or something shaped like an HF id ("org/name")."""
    return name in PRESETS or os.path.exists(name) or _looks_like_hf_id(name)


def _looks_like_hf_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def unknown_model_message(name: str) -> str:
    return (f"TrainSpec.model: unknown model {name!r}: use a preset ({', '.join(sorted(PRESETS))}), "
            f"a path to a config.json, or a Hugging Face id like 'org/name'")


def load_config(name: str):
    """The transformers config for a preset, a config.json path (or its directory) or an HF id."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if name in PRESETS:
        model_type, kwargs = PRESETS[name]
        return CONFIG_MAPPING[model_type](**kwargs)
    if os.path.exists(name):
        path = os.path.join(name, "config.json") if os.path.isdir(name) else name
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
        model_type = raw.pop("model_type", None)
        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"TrainSpec.model: {path} has unknown or missing model_type {model_type!r}")
        return CONFIG_MAPPING[model_type].from_dict(raw)
    if _looks_like_hf_id(name):
        return AutoConfig.from_pretrained(name)
    raise ValueError(unknown_model_message(name))


def build_model(name: str, *, seed: int, device: torch.device) -> torch.nn.Module:
    """An fp32 causal LM on `device`: random init from `seed` for presets/configs, pretrained for HF ids."""
    from transformers import AutoModelForCausalLM

    config = load_config(name)
    config.use_cache = False
    torch.manual_seed(seed)
    if name not in PRESETS and not os.path.exists(name):
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=torch.float32)
        return model.to(device)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@dataclass
class ModelFlops:
    """Parameter counts and training FLOPs per token (forward + backward)."""

    num_params: int
    matmul_params: int
    flops_per_token: float


def model_flops(model: torch.nn.Module, seq_len: int) -> ModelFlops:
    """6 * N + 12 * L * d_attn * T per token (the PaLM convention, no causal discount).

    N counts the parameters that take part in matmuls: all parameters minus the input
    embedding table (a lookup), plus the lm_head (counted even when tied to the
    embedding). d_attn = heads * head_dim; the attention term covers QK^T and AV.
    Activation recomputation is not counted (model FLOPs, not hardware FLOPs).
    """
    config = model.config
    num_params = sum(p.numel() for p in model.parameters())  # a tied weight is yielded once
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    matmul = num_params - embed.numel() + (head.numel() if head is embed else 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
    return ModelFlops(num_params, matmul, float(6 * matmul + attn))


def peak_flops(device: torch.device, dtype: str) -> float:
    """Peak FLOP/s of one device for `dtype`; 0 when unknown (CPU, unlisted GPU) so MFU reads 0."""
    override = os.environ.get(PEAK_TFLOPS_ENV)
    if override:
        return float(override) * 1e12
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_FLOPS:
        if key in name:
            return table[dtype]
    return 0.0
