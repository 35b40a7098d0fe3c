"""PEFT (LoRA, QLoRA) under apply_kernels: what is fused, what is left to peft, and NF4 base weights.

A `peft.PeftModel` is patched like the model inside it (norms, RoPE, gated MLP activation between the
LoRA-wrapped projections, the fused loss with the base `lm_head`); on top of that each of peft's
`lora.Linear` layers is swapped for one whose forward is `fuseforge.ops.lora.lora_linear` (the adapter's
term added inside the base matmul's output, no [tokens, out] temporaries), where that computes exactly
what peft's own forward does: verified peft source (fingerprint), one active adapter, plain LoRA (no
DoRA or other variant, no LoRA bias), not merged, no `adapter_names` batch, no autocast, and adapter
weights in the activations' dtype (peft keeps fp32 adapters next to bf16 weights unless
`get_peft_model(..., autocast_adapter_dtype=False)`; then its forward, which casts, runs). Anything else
takes peft's forward, per call.

Frozen base weights get no weight gradients anywhere: autograd skips them in peft's path, `lora_linear`
computes a base weight gradient only when that weight requires one, and the fused loss's `lm_head`
(frozen under LoRA unless in `modules_to_save`) likewise.

QLoRA: `quantize_base_nf4` stores the frozen linear weights as torchao NF4 tensors (4-bit NormalFloat,
blockwise absmax with double-quantized scalers, as in the QLoRA paper). torchao rather than bitsandbytes:
torchao's NF4Tensor is a pure PyTorch tensor subclass, so it runs wherever torch does (the CPU CI
included), shards under FSDP2 (it implements FSDP2's all-gather hooks) and goes through `F.linear`
(dequantize, then the usual matmul), while bitsandbytes' 4-bit layers need its CUDA library and are
their own module class (peft's `lora.bnb.Linear4bit`), which the fused LoRA path does not cover.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from fuseforge.ops.lora import lora_linear
from fuseforge.transformers._fingerprint import matches

# peft's lora.Linear.forward (peft 0.21): base output, then per active adapter
# `result + lora_B(lora_A(dropout(x))) * scaling` after casting x to the adapter's dtype.
PEFT_LORA_LINEAR_FORWARD = frozenset({"10a2e92c4f54"})
TESTED_PEFT = ("0.21.2",)
NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE = 64, 256  # torchao's (and the QLoRA paper's) defaults


def is_peft_model(model) -> bool:
    """True for a peft.PeftModel (without importing peft when nothing has)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def inner_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (the model itself otherwise)."""
    return model.get_base_model() if is_peft_model(model) else model


def _lora_linear_class():
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora.layer import Linear

    return Linear


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every peft LoRA layer in the model (any kind: Linear, Embedding, bnb...)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora.layer import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def plan_lora(module: nn.Module) -> str | None:
    """Why this LoRA layer cannot take the fused forward (None: it can)."""
    linear = _lora_linear_class()
    cls = type(module)
    if linear is None or cls is not linear:
        return f"{cls.__name__} ({cls.__module__}): only peft's lora.Linear is fused"
    if not matches(linear.forward, PEFT_LORA_LINEAR_FORWARD):
        import peft

        return f"peft {peft.__version__}'s lora.Linear.forward is not the verified one (peft {', '.join(TESTED_PEFT)})"
    if "forward" in module.__dict__:
        return "lora.Linear: forward overridden on the instance"
    if getattr(module, "fan_in_fan_out", False):
        return "lora.Linear with fan_in_fan_out (Conv1D-style weights)"
    if type(module.base_layer) is not nn.Linear:
        return f"lora.Linear over {type(module.base_layer).__name__}, not nn.Linear"
    return None


def _fused_adapter(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one adapter this call can run through lora_linear, or None (peft's forward then runs)."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in layer.lora_variant:
        return None
    lora_a, lora_b, base = layer.lora_A[name], layer.lora_B[name], layer.base_layer
    if lora_a.bias is not None or lora_b.bias is not None:
        return None
    if base._forward_hooks or base._forward_pre_hooks or lora_a._forward_pre_hooks or lora_b._forward_pre_hooks:
        return None
    if lora_a.weight.dtype != x.dtype or lora_b.weight.dtype != x.dtype or base.weight.dtype != x.dtype:
        return None  # peft casts x to the adapter's dtype and promotes the sum: its own forward reproduces that
    if torch.is_autocast_enabled(x.device.type):
        return None
    return name


class FusedLoraLinearMixin:
    """peft's lora.Linear whose plain-LoRA calls run base and adapter as one op (fuseforge.ops.lora)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = _fused_adapter(self, x, args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        dropout = self.lora_dropout[name]
        dropped = None if isinstance(dropout, nn.Identity) else dropout(x)
        base = self.base_layer
        return lora_linear(x, base.weight, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name],
                           bias=base.bias, dropped=dropped)


def peft_notes(model: nn.Module) -> list[str]:
    """What the patch report says about a PEFT model: adapters, trainable share, frozen weights, dtypes."""
    layers = lora_layers(model)
    if not is_peft_model(model) and not layers:
        return []
    params = list(model.named_parameters())
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    total = sum(p.numel() for _, p in params)
    adapters = sorted({a for _, m in layers for a in m.lora_A})
    others = [n for n, p in params if p.requires_grad and not _under_adapter(n)]
    also = f"; trainable besides the adapters: {', '.join(others[:4])}{' ...' if len(others) > 4 else ''}" if others else ""
    notes = [f"PEFT: LoRA adapter(s) {', '.join(adapters) or '(none)'} on {len(layers)} modules; "
             f"{trainable:,} of {total:,} parameters trainable{also}; frozen weights get no gradient buffers "
             "(the fused loss's lm_head included)"]
    mixed = sorted({f"{m.lora_A[a].weight.dtype} adapters over {base.dtype} weights"
                    for _, m in layers if (base := getattr(m.get_base_layer(), "weight", None)) is not None
                    for a in m.lora_A if m.lora_A[a].weight.dtype != base.dtype})
    if mixed:
        notes.append(f"PEFT: {', '.join(mixed)}: those layers keep peft's forward (it casts to the adapter dtype); "
                     "get_peft_model(..., autocast_adapter_dtype=False) keeps adapters in the model's dtype")
    nf4 = sum(1 for _, p in params if _is_nf4(p))
    if nf4:
        notes.append(f"QLoRA: {nf4} base weights stored as torchao NF4 (dequantized per matmul)")
    return notes


# --- QLoRA: NF4 base weights --------------------------------------------------------------------


def _is_nf4(tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def nf4_available() -> str | None:
    """Why NF4 base weights cannot be made here (None: torchao's NF4Tensor is importable)."""
    try:
        from torchao.quantization import to_nf4  # noqa: F401
    except ImportError as exc:
        return f"QLoRA needs torchao's NF4 tensor (pip install torchao): {exc}"
    return None


def quantize_base_nf4(model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",), block_size: int = NF4_BLOCK_SIZE,
                      scaler_block_size: int = NF4_SCALER_BLOCK_SIZE) -> list[str]:
    """Store every frozen-to-be nn.Linear weight of `model` as a torchao NF4 tensor, in place; returns the names.

    Run it before or after `get_peft_model`: adapters (lora_A / lora_B), modules named in `skip` (the LM head,
    which the fused loss reads whole and unquantized) and linears of other classes are left alone. The weights
    become frozen parameters (NF4 has no gradient). A weight of numel not divisible by block_size *
    scaler_block_size is a ValueError naming it.
    """
    reason = nf4_available()
    if reason is not None:
        raise ImportError(reason)
    from torchao.quantization import to_nf4

    done = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if type(module) is not nn.Linear or leaf in skip or _under_adapter(name) or _is_nf4(module.weight):
            continue
        weight = module.weight.detach()
        if weight.numel() % block_size:
            raise ValueError(f"quantize_base_nf4: {name}.weight {tuple(weight.shape)} has {weight.numel()} elements, "
                             f"not a multiple of block_size={block_size}")
        scalers = math.gcd(weight.numel() // block_size, scaler_block_size)
        module.weight = nn.Parameter(to_nf4(weight.contiguous(), block_size, scalers), requires_grad=False)
        done.append(name)
    return done


def _under_adapter(name: str) -> bool:
    parts = name.split(".")
    return any(p in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B") for p in parts)


def dequantize_base(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Turn NF4 weights back into plain parameters (of `dtype`, default their original one); returns how many."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and _is_nf4(weight):
            module.weight = nn.Parameter(weight.get_original_weight().to(dtype or weight.dtype), requires_grad=False)
            count += 1
    return count
