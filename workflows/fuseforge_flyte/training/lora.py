"""LoRA / QLoRA runs of the engine: peft adapters on a frozen base, trained-only state, PEFT-format outputs.

TrainSpec.lora (or qlora, or a `model` that is an adapter directory) trains peft LoRA adapters instead of every
weight: the base model is built as usual, frozen, and wrapped by `peft.get_peft_model` (adapters in the model's
dtype), or `PeftModel.from_pretrained(..., is_trainable=True)` to go on training a saved adapter. QLoRA stores the
frozen projections as torchao NF4 (fuseforge.transformers.lora says why torchao) under strategy ddp. The kernels
are applied to the PeftModel afterwards (apply_kernels fuses norms, RoPE, MLP, the loss and the LoRA linears).

What changes downstream: the optimizer (and DDP's fp32 master weights) hold the adapters only; frozen weights are
cast once to the compute dtype (no masters for them); checkpoints hold the trained parameters only, with the same
signed manifest; the output `model` is an adapter directory in PEFT's format (adapter_config.json and
adapter_model.safetensors, plus the tokenizer) that `PeftModel.from_pretrained(base, dir)` loads without
fuseforge, whose `base_model_name_or_path` is the run's base model; with lora_merge it is instead the merged
model as a Hugging Face directory, the adapter beside it in `adapter/`. Either can be the next run's `model`.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Dict, List, Optional, Union

import torch

from fuseforge_flyte.model_names import (PRESETS, adapter_base, adapter_dir, base_source, is_known_model, is_uri,
                                         load_config, local_path)
from fuseforge_flyte.training import precision

log = logging.getLogger("fuseforge.training")

ADAPTER_SUBDIR = "adapter"  # where a merged export keeps its adapter
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
GATED_MLP = ["gate_proj", "up_proj", "down_proj"]
# The linear layers LoRA adapts by default, per model_type: attention and MLP projections (the usual QLoRA choice:
# every linear layer but the LM head). MoE families: attention and dense MLPs (their experts are fused parameter
# tensors, not linear layers). Others: peft's "all-linear" (every nn.Linear but the output layer).
DEFAULT_TARGETS: Dict[str, List[str]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "smollm3",
                     "olmo2", "olmo3", "exaone4"), ATTENTION + GATED_MLP),
    "glm4": ATTENTION + ["gate_up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    **dict.fromkeys(("mixtral", "qwen3_moe", "gpt_oss", "llama4_text"), ATTENTION + GATED_MLP),
}
ALL_LINEAR = "all-linear"


def lora_on(spec) -> bool:
    """LoRA for this run's settings (a TrainSpec, or the dpo workflow's DPOSettings)."""
    return bool(spec.lora or spec.qlora or adapter_dir(spec.model))


def targets_for(spec, config) -> Union[List[str], str]:
    """spec.lora_target_modules (comma-separated leaf names, or all-linear), else the family's default."""
    given = [t for t in spec.lora_target_modules.replace(",", " ").split() if t]
    if given:
        return ALL_LINEAR if given == [ALL_LINEAR] else given
    return list(DEFAULT_TARGETS.get(getattr(config, "model_type", None), ALL_LINEAR))


def _linear_names(config) -> List[str]:
    """Leaf names of the nn.Linear layers of the model `config` builds (on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is torch.nn.Linear and m is not head})


def check(spec, where: str = "TrainSpec") -> None:
    """LoRA settings, before any worker starts: ValueError naming the field (`where`: TrainSpec or DPO)."""
    try:
        _check(spec)
    except ValueError as err:
        raise ValueError(str(err).replace("TrainSpec.", f"{where}.")) from None


def _check(spec) -> None:
    if not lora_on(spec):
        if getattr(spec, "lora_merge", False):
            raise ValueError("TrainSpec.lora_merge merges LoRA adapters into the model: it needs lora (or qlora) on")
        return
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise ValueError(f"TrainSpec.lora needs peft (pip install 'fuseforge[lora]'; for the cluster's image, "
                         f"'lora' in platform.toml's [image].extras): {err}") from None
    if spec.lora_rank < 1:
        raise ValueError(f"TrainSpec.lora_rank must be >= 1 (the adapters' rank), got {spec.lora_rank}")
    if not (math.isfinite(spec.lora_alpha) and spec.lora_alpha > 0):
        raise ValueError(f"TrainSpec.lora_alpha must be > 0 (the adapters' scale is alpha / rank), got {spec.lora_alpha}")
    if not (math.isfinite(spec.lora_dropout) and 0 <= spec.lora_dropout < 1):
        raise ValueError(f"TrainSpec.lora_dropout must be in [0, 1), got {spec.lora_dropout}")
    for name in ("fp8", "compile"):
        if getattr(spec, name, False):
            raise ValueError(f"TrainSpec.{name} is not supported with LoRA (not verified on peft's layers): set "
                             f"{name} false, or lora false")
    strategy = getattr(spec, "strategy", "ddp")
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"TrainSpec.lora: strategy {strategy!r} is not supported with LoRA: use 'ddp' or 'fsdp'")
    if spec.qlora:
        from fuseforge.transformers.lora import nf4_available

        reason = nf4_available()
        if reason is not None:
            raise ValueError(f"TrainSpec.qlora: no supported 4-bit backend: {reason}")
        if strategy != "ddp":
            raise ValueError(f"TrainSpec.qlora runs under strategy 'ddp' (NF4 base weights are replicated), got "
                             f"strategy={strategy!r}")
    directory = adapter_dir(spec.model)
    if directory:
        base = adapter_base(directory)
        if not is_known_model(base):
            raise ValueError(f"TrainSpec.model: the adapter's base model {base!r} (adapter_config.json) is unknown")
        return  # the adapter's own config decides rank, alpha and targets
    config = _local_config(spec.model)
    targets = targets_for(spec, config) if config is not None else None
    if config is None or targets == ALL_LINEAR:
        return
    linear = _linear_names(config)
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ValueError(f"TrainSpec.lora_target_modules: {', '.join(repr(t) for t in missing)} is not a linear layer "
                         f"of the {config.model_type} model; its linear layers are {', '.join(linear)} (or all-linear)")


def _local_config(name: str):
    """The model's config when it is known without a download (preset, local path); else None."""
    local = local_path(name)
    if name in PRESETS or (local and os.path.exists(local) and not is_uri(name)):
        return load_config(name)
    return None


def peft_config(spec, config):
    import peft

    return peft.LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                           target_modules=targets_for(spec, config), task_type="CAUSAL_LM")


def frozen_dtype(spec, device: torch.device) -> Optional[torch.dtype]:
    """The dtype the frozen weights are stored in: the compute dtype where the trainable ones are kept apart in
    fp32 (DDP's master weights; FSDP2, whose all-gather casts the fp32 adapters and reduces their gradients in
    fp32, and needs a uniform dtype among trainable parameters only); None keeps them as built (fp32 runs,
    fp16 autocast)."""
    if spec.strategy == "ddp":
        return precision.master_dtype_for(precision.compute_dtype(spec, device), device)
    if spec.strategy == "fsdp" and precision.compute_dtype(spec, device) == "bf16":
        return precision.compute_torch_dtype(spec, device)
    return None


def attach(model: torch.nn.Module, spec, *, frozen_dtype: Optional[torch.dtype], log_it: bool) -> torch.nn.Module:
    """`model` (the base, fp32) as a peft.PeftModel with trainable adapters; its frozen floating weights cast to
    `frozen_dtype` (the compute dtype where the strategy keeps fp32 masters, which then cover the adapters only);
    QLoRA: the frozen projections as NF4 (after that cast, so they dequantize to the compute dtype)."""
    import peft

    directory = adapter_dir(spec.model)
    if directory:
        model = peft.PeftModel.from_pretrained(model, directory, is_trainable=True, autocast_adapter_dtype=False)
    else:
        model = peft.get_peft_model(model, peft_config(spec, model.config), autocast_adapter_dtype=False)
    # the base a saved adapter names: the model this run was built from
    for config in model.peft_config.values():
        config.base_model_name_or_path = base_source(spec.model)
    if frozen_dtype is not None:
        with torch.no_grad():
            for param in model.parameters():
                if not param.requires_grad and param.is_floating_point() and param.dtype != frozen_dtype:
                    param.data = param.data.to(frozen_dtype)
    quantized = []
    if spec.qlora:
        from fuseforge.transformers.lora import quantize_base_nf4

        quantized = quantize_base_nf4(model)
    if log_it:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info("LoRA: %s, %d trainable parameters%s", ", ".join(sorted(model.peft_config)), trainable,
                 f", {len(quantized)} NF4 base weights" if quantized else "")
    return model


def inner(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PeftModel (the model itself otherwise)."""
    from fuseforge.transformers.lora import inner_model

    return inner_model(model)


def trained_keys(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The entries of `state` (model's state-dict names) that belong to trainable parameters."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    names = {k for k, v in model.state_dict(keep_vars=True).items() if id(v) in trainable}
    return {k: v for k, v in state.items() if k in names}


def load_trained(model: torch.nn.Module, state: Dict[str, torch.Tensor], where: str) -> None:
    """Load a trained-only state dict: every trainable parameter must be in it, frozen ones stay as built."""
    result = model.load_state_dict(state, strict=False)
    trainable = {k for k in trained_keys(model, model.state_dict())}
    missing = sorted(trainable & set(result.missing_keys))
    if missing or result.unexpected_keys:
        raise ValueError(f"{where}: the saved adapters do not match this model's: missing {missing[:4]}, "
                         f"unexpected {list(result.unexpected_keys)[:4]}")


def save_adapter(strategy, ctx, spec, out_dir: str, tokenizer_dir: Optional[str]) -> Optional[str]:
    """Write the adapter (and with spec.lora_merge the merged model) to `out_dir`; its path on rank 0.

    Collective like export.save_pretrained_model (the strategy's state is its trained parameters only, fp32).
    """
    from fuseforge_flyte.training.export import write_on_rank0

    return write_on_rank0(strategy, ctx, out_dir,
                          lambda state: _write_outputs(strategy.inner, state, spec, out_dir, tokenizer_dir))


def _write_outputs(live, state: Dict[str, torch.Tensor], spec, out_dir: str, tokenizer_dir: Optional[str]) -> str:
    import shutil
    import tempfile

    from fuseforge_flyte.training.export import _copy_tokenizer, _place, _upload

    remote = "://" in out_dir and not out_dir.startswith("file://")
    target = out_dir if remote else os.path.abspath(out_dir[len("file://"):] if out_dir.startswith("file://") else out_dir)
    parent = None if remote else os.path.dirname(target) or None
    if parent:  # the run's output folder may not exist yet: the scratch copy lives beside its final place
        os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="fuseforge-adapter-", dir=parent)
    try:
        adapter = os.path.join(work, ADAPTER_SUBDIR) if spec.lora_merge else work
        os.makedirs(adapter, exist_ok=True)
        # embeddings never train here: no lookup of the base config (a hub request) to find out
        live.save_pretrained(adapter, state_dict=_peft_names(live, state), save_embedding_layers=False)
        if tokenizer_dir:
            _copy_tokenizer(tokenizer_dir, adapter)
        if spec.lora_merge:
            merged = _merged_model(live, state, spec)
            merged.save_pretrained(work, safe_serialization=True)
            if tokenizer_dir:
                _copy_tokenizer(tokenizer_dir, work)
        if remote:
            _upload_tree(work, target, _upload)
        else:
            _place(work, target)
    finally:
        if os.path.exists(work):
            shutil.rmtree(work, ignore_errors=True)
    return out_dir


def _upload_tree(local: str, uri: str, upload) -> None:
    for root, _, _ in os.walk(local):
        rel = os.path.relpath(root, local)
        upload(root, uri if rel == "." else f"{uri.rstrip('/')}/{rel}")


def _peft_names(live, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The gathered trained tensors under the PeftModel's own state-dict names (what save_pretrained filters)."""
    names = set(live.state_dict().keys())
    out = {}
    for key, value in state.items():
        if key not in names:
            raise ValueError(f"adapter export: {key!r} is not a parameter name of the PeftModel")
        out[key] = value
    return out


def _merged_model(live, state: Dict[str, torch.Tensor], spec) -> torch.nn.Module:
    """The base rebuilt in fp32 on the CPU from its source (full-precision weights, also under QLoRA), the trained
    adapters loaded into a copy of the run's peft config, merged into the weights and unwrapped."""
    import peft

    from fuseforge_flyte.training.models import build_model

    base = build_model(base_source(spec.model), seed=spec.seed, device=torch.device("cpu"),
                       vocab_size=live.get_input_embeddings().weight.shape[0])
    config = live.peft_config[live.active_adapter]
    model = peft.get_peft_model(base, config, autocast_adapter_dtype=False)
    load_trained(model, {k: v.float() for k, v in state.items()}, "lora_merge")
    merged = model.merge_and_unload()
    trained_config = inner(live).config
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a preset speaks the data's tokenizer
        setattr(merged.config, name, getattr(trained_config, name, None))
    merged.config.use_cache = True
    return merged
