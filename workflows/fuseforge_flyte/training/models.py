"""Models to train: built-in presets, config files, Hugging Face model directories/URIs or hub ids; their FLOPs.

Presets are built from configs (random init, seeded, no download): tiny ones whose
vocabulary fits the byte tokenizer, for CPU runs, and the shapes of public models
for GPU benchmarks (weights are irrelevant to throughput and memory). A model
directory (config.json + weights, e.g. a previous run's export) loads its weights,
to continue training; a remote one (s3://, gs://, ...) is downloaded once into a
local cache first, since from_pretrained reads local directories and hub ids only.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from fuseforge_flyte import hub
from fuseforge_flyte.data.spec import is_uri, local_path
from fuseforge_flyte.quiet import quiet_third_party
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


CACHE_ENV = "FUSEFORGE_CACHE"  # root of fuseforge's local caches (default ~/.cache/fuseforge)
# files that hold Hugging Face weights; one of them next to config.json makes a directory a pretrained model
_WEIGHT_SUFFIX = ".safetensors"
_BIN_PREFIX, _BIN_SUFFIX = "pytorch_model", ".bin"
# never downloaded with a remote model: other formats that can sit in the same directory
_OTHER_WEIGHT_SUFFIXES = (".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


def _known_protocol(name: str) -> bool:
    import fsspec

    protocol = name.split("://", 1)[0]
    return protocol in fsspec.available_protocols()


def is_known_model(name: str) -> bool:
    """A preset, an existing local path (or file:// URI), an fsspec URI, or something shaped like an HF id."""
    if name in PRESETS:
        return True
    local = local_path(name)
    if local:
        return os.path.exists(local) or (not is_uri(name) and _looks_like_hf_id(name))
    return is_uri(name) and _known_protocol(name)


def _looks_like_hf_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def unknown_model_message(name: str, field: str = "model") -> str:
    close = difflib.get_close_matches(name, sorted(PRESETS), n=1)
    if close:
        return f"TrainSpec.{field}: unknown model {name!r}: did you mean {close[0]!r}?"
    return (f"TrainSpec.{field}: unknown model {name!r}: use a preset ({', '.join(sorted(PRESETS))}), "
            f"a Hugging Face model directory or its fsspec URI (s3://, gs://, file://), a path to a config.json, "
            f"or a Hugging Face id like 'org/name'")


def _is_weight_file(filename: str) -> bool:
    return filename.endswith(_WEIGHT_SUFFIX) or (filename.startswith(_BIN_PREFIX) and filename.endswith(_BIN_SUFFIX))


def is_pretrained_dir(path: str) -> bool:
    """A local directory with config.json and Hugging Face weights (safetensors or pytorch_model*.bin)."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(_is_weight_file(f) for f in os.listdir(path)))


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
    if _looks_like_hf_id(name):
        return hub.load_hub_id(lambda: AutoConfig.from_pretrained(name), option=option, hub_id=name, what="model")
    raise ValueError(unknown_model_message(name))


# ---------------------------------------------------------------- remote model directories


def cache_root(kind: str) -> str:
    """One of fuseforge's local caches ("models": downloaded model directories, "data": data prepared by
    the engine itself) under $FUSEFORGE_CACHE."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fuseforge")
    return os.path.join(root, kind)


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
    if any(n.endswith(_WEIGHT_SUFFIX) for n in names):
        names = [n for n in names if not (n.endswith(_BIN_SUFFIX) or n == "pytorch_model.bin.index.json")]
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
    if "config.json" not in wanted or not any(_is_weight_file(n) for n in wanted):
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
    return any(_is_weight_file(n) for n in files)


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
