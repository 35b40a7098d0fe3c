"""Building the model a name means (fuseforge_flyte.model_names says what names mean); its FLOPs and the GPU's peak.

Presets are built from configs (random init, seeded, no download): tiny ones whose
vocabulary fits the byte tokenizer, for CPU runs, and the shapes of public models
for GPU benchmarks (weights are irrelevant to throughput and memory). A model
directory (config.json + weights, e.g. a previous run's export) loads its weights,
to continue training; a remote one (s3://, gs://, ...) is downloaded once into a
local cache first, since from_pretrained reads local directories and hub ids only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from fuseforge_flyte.cache_dirs import cache_root
from fuseforge_flyte.model_names import (BIN_SUFFIX, PRESETS, SAFETENSORS_SUFFIX, base_source, is_pretrained_dir,
                                         is_uri, is_weight_file, load_config, local_path)
from fuseforge_flyte.quiet import quiet_third_party

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


# never downloaded with a remote model: other formats that can sit in the same directory
_OTHER_WEIGHT_SUFFIXES = (".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


# ---------------------------------------------------------------- remote model directories


def _remote_listing(uri: str):
    """(fs, root, {file name: info}) of the top-level files of a remote directory."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    if not fs.isdir(root):
        raise FileNotFoundError(f"TrainSpec.model: {uri} is not a directory")
    files = {}
    for info in fs.ls(root, detail=True):
        if info.get("type") == "file":
            files[info["name"].rstrip("/").rsplit("/", 1)[-1]] = info
    return fs, root, files


def _wanted_files(names) -> list:
    """What from_pretrained reads: safetensors when there are some (else .bin), config and tokenizer files."""
    names = [n for n in names if not n.endswith(_OTHER_WEIGHT_SUFFIXES)]
    if any(n.endswith(SAFETENSORS_SUFFIX) for n in names):
        names = [n for n in names if not (n.endswith(BIN_SUFFIX) or n == "pytorch_model.bin.index.json")]
    return sorted(names)


def _identity(info: dict) -> dict:
    """What identifies a remote file's contents without reading it (ETag, generation, size, mtime...)."""
    keys = ("etag", "version_id", "generation", "md5hash", "crc32c", "size", "mtime", "last_modified",
            "updated", "lastmodified", "created")
    return {k: str(v) for k, v in sorted(info.items()) if k.lower() in keys}


def fetch_model_dir(uri: str) -> str:
    """A local copy of the remote model directory `uri`, downloaded once into the model cache.

    The cache entry is keyed by the URI and the files' store identities (ETags, sizes, times), so
    a directory that is written again is downloaded again. Concurrent callers (the ranks of a node)
    take a file lock: one downloads into a temporary directory renamed into place, the others wait
    and reuse it.
    """
    import fcntl
    import hashlib
    import shutil
    import uuid

    fs, root, files = _remote_listing(uri)
    wanted = _wanted_files(files)
    if "config.json" not in wanted or not any(is_weight_file(n) for n in wanted):
        raise FileNotFoundError(f"TrainSpec.model: {uri} holds no Hugging Face model (needs config.json and "
                                f"*.safetensors or pytorch_model*.bin; found {sorted(files)})")
    digest = hashlib.sha256(uri.rstrip("/").encode())
    digest.update(json.dumps({n: _identity(files[n]) for n in wanted}, sort_keys=True).encode())
    cache = cache_root("models")
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, digest.hexdigest()[:32])
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(target):
            return target
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        os.makedirs(tmp)
        try:
            for name in wanted:
                fs.get_file(f"{root.rstrip('/')}/{name}", os.path.join(tmp, name))
            with open(os.path.join(tmp, ".source.json"), "w", encoding="utf-8") as handle:
                json.dump({"uri": uri, "files": wanted}, handle)
            os.rename(tmp, target)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remote_is_pretrained(uri: str) -> bool:
    """Whether a remote path is a model directory with weights (else a config.json or a config-only dir)."""
    if uri.endswith(".json"):
        return False
    _, _, files = _remote_listing(uri)
    return any(is_weight_file(n) for n in files)


def _pretrained_dir(name: str) -> Optional[str]:
    """The local directory to load pretrained weights from, or None when `name` means random init / hub id."""
    if name in PRESETS:
        return None
    local = local_path(name)
    if local:
        return local if is_pretrained_dir(local) else None
    if is_uri(name) and _remote_is_pretrained(name):
        return fetch_model_dir(name)
    return None


def _from_pretrained(source: str, config, seed: int, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # any weight the checkpoint lacks is initialised reproducibly
    model, info = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch.float32,
                                                       output_loading_info=True)
    missing = [k for k in info.get("missing_keys", ()) if k]
    if missing or info.get("mismatched_keys"):
        raise ValueError(f"TrainSpec.model: {source} does not hold all the weights of "
                         f"{type(model).__name__}: missing {sorted(missing)[:8]} ({len(missing)}), "
                         f"mismatched {list(info.get('mismatched_keys') or [])[:8]}")
    return model.to(device)


def build_model(name: str, *, seed: int, device: torch.device, vocab_size: Optional[int] = None) -> torch.nn.Module:
    """An fp32 causal LM on `device`, with `use_cache=False` (training).

    Pretrained weights for an HF id, or a directory with config.json + safetensors/pytorch_model*.bin
    (local, file:// or any fsspec URI; remote ones are downloaded once into the model cache).
    Random init from `seed` for presets (`vocab_size` overrides theirs), a config.json, or a
    directory holding only a config.json. `vocab_size` is ignored for everything but presets.
    """
    quiet_third_party(cuda=torch.device(device).type == "cuda")  # before transformers loads its model code
    from transformers import AutoModelForCausalLM

    name = base_source(name)
    pretrained = _pretrained_dir(name)
    if pretrained is not None:
        config = load_config(pretrained)
        config.use_cache = False
        return _from_pretrained(pretrained, config, seed, device)
    config = load_config(name, vocab_size=vocab_size if name in PRESETS else None)
    config.use_cache = False
    if name not in PRESETS and not is_uri(name) and not os.path.exists(name):  # an HF id
        return _from_pretrained(name, config, seed, device)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def decoder_layers(model: torch.nn.Module, purpose: str = "plan") -> list:
    """The model's decoder layers in model order: the modules whose class is in its `_no_split_modules` (what
    FSDP shards, torch.compile compiles and the planner checkpoints one by one); ValueError naming `purpose`
    when there are none."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{purpose}: cannot find the decoder layers of {type(model).__name__} "
                         f"(its _no_split_modules is {sorted(layer_classes)})")
    return layers


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
