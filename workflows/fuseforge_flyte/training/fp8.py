"""FP8 matmuls for the linear layers (TrainSpec.fp8), through torchao's float8 training.

torchao swaps each chosen nn.Linear for its Float8Linear, which keeps the same weight and bias
parameters (same names, same fp32 values: checkpoints, export and the optimizer do not change) and
casts input, weight and output gradient to float8 with dynamic tensorwise scales around each matmul.
Which layers: those whose in and out features are multiples of 16 (the FP8 GEMM's requirement),
never the lm_head (fuseforge's fused loss reads lm_head.weight directly, at full precision) nor a
mixture-of-experts router (its top-k choice is sensitive to rounding).

FSDP2: the weights are all-gathered in bf16 and cast to float8 inside each layer (torchao's
enable_fsdp_float8_all_gather stays off: it turns the weights into a tensor subclass, which the
export and checkpoint paths do not handle, and needs a scale pre-computation after every optimizer
step). DeepSpeed is refused (not verified with torchao's Float8Linear).
"""

from __future__ import annotations

import logging
from typing import List

import torch

log = logging.getLogger("fuseforge.training")

FP8_EXTRA = "fp8"  # pyproject.toml's extra that installs torchao
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have FP8 tensor cores
FP8_DIM_MULTIPLE = 16


def import_float8():
    """torchao.float8, or an ImportError naming the pip extra to install (permanent: a restart cannot fix it)."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise ImportError(f"TrainSpec.fp8 needs torchao, an optional extra: pip install "
                          f"'fuseforge[{FP8_EXTRA}]' ({err})") from err
    return float8


def check_fp8_device(device: torch.device) -> None:
    """Refuse FP8 where no FP8 tensor cores run it (the CPU, GPUs older than compute capability 8.9).

    ValueError: a setting this machine cannot run, which a restart does not change (training/permanent.py)."""
    if device.type != "cuda":
        raise ValueError(f"TrainSpec.fp8 needs a GPU with FP8 tensor cores (compute capability >= 8.9, e.g. "
                         f"L4, L40S, H100, H200); this run is on the {device.type.upper()}: set fp8 false")
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < MIN_CAPABILITY:
        raise ValueError(f"TrainSpec.fp8 needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                         f"(FP8 tensor cores); {torch.cuda.get_device_name(device)} has "
                         f"{capability[0]}.{capability[1]}: set fp8 false")


def _is_router(name: str) -> bool:
    """MoE routers: Mixtral/Qwen-MoE `gate`, Qwen-MoE `shared_expert_gate`, `router` (not an MLP's gate_proj)."""
    parts = name.split(".")
    return parts[-1] == "gate" or parts[-1].endswith("_gate") or any("router" in part for part in parts)


def fp8_linear_names(model: torch.nn.Module) -> List[str]:
    """The nn.Linear layers that convert_to_fp8 converts: dims multiples of 16, not lm_head, not a router."""
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head and not _is_router(name)
            and module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0]


def convert_to_fp8(model: torch.nn.Module, *, log_it: bool = False) -> List[str]:
    """Swap the chosen nn.Linear layers of `model` (in place) for torchao's Float8Linear; their names.

    Raises ValueError when no layer qualifies (FP8 would silently do nothing).
    """
    float8 = import_float8()
    chosen = set(fp8_linear_names(model))
    if not chosen:
        raise ValueError(f"TrainSpec.fp8: {type(model).__name__} has no nn.Linear layer with in/out features that "
                         f"are multiples of {FP8_DIM_MULTIPLE} (besides lm_head and routers): set fp8 false")
    float8.convert_to_float8_training(model, module_filter_fn=lambda module, name: name in chosen,
                                      config=float8.Float8LinearConfig())
    if log_it:
        skipped = [name for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name not in chosen]
        log.info("fp8: %d linear layers compute in float8 (torchao); not converted: %s", len(chosen),
                 ", ".join(skipped) or "none")
    return sorted(chosen)
