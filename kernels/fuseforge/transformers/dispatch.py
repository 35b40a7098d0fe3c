"""apply_kernels / unpatch / patched: the public entry, which sends a model or model class to patching.py and a
built trainer to trainers/ (which patches the trainer's models through patching.py in turn)."""

from __future__ import annotations

import contextlib
import inspect
import types

from torch import nn

from fuseforge.loss_args import check_chunk_size
from fuseforge.transformers.families import FAMILIES, Family
from fuseforge.transformers.patching import (
    current_patch,
    model_type_of,
    patch_class,
    patch_instance,
    unpatch_class,
    unpatch_instance,
)
from fuseforge.transformers.report import PatchReport
from fuseforge.transformers.trainers import apply_kernels_to_trainer, is_trainer, unpatch_trainer


def _check_flags(flags: dict) -> dict:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"kernel flag {name} must be a bool, got {type(value).__name__}")
    return dict(flags)


def _check_loss_chunk_size(loss_chunk_size, fused_linear_cross_entropy: bool) -> int | None:
    """None (the op's default rule) or a positive int of tokens; only the fused loss head has chunks."""
    loss_chunk_size = check_chunk_size(loss_chunk_size, "loss_chunk_size")
    if loss_chunk_size is not None and not fused_linear_cross_entropy:
        raise ValueError(
            f"loss_chunk_size={loss_chunk_size} sizes the chunks of the fused loss head, but "
            "fused_linear_cross_entropy=False turns that head off: drop one of the two"
        )
    return loss_chunk_size


def apply_kernels(
    model_or_class,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    fused_linear_cross_entropy: bool = True,
    cross_entropy: bool = False,
    layer_norm: bool = True,
    lora: bool = True,
    loss_chunk_size: int | None = None,
) -> PatchReport:
    """Swap fuseforge's fused kernels into a Hugging Face model (instance) or model class.

    Flags: rms_norm, layer_norm, rope, swiglu (gated MLPs: SwiGLU and GeGLU, MoE experts),
    fused_linear_cross_entropy (training loss without logits), cross_entropy (the loss
    when logits are computed), lora (peft's LoRA linears as one op each: see transformers/lora.py).

    A peft.PeftModel is patched whole: every kernel as for the model inside, plus `lora`; a model
    patched before peft added adapters keeps its kernels, and apply_kernels on the PeftModel then
    takes over that patch (and fuses the LoRA layers). The report's notes say what PEFT changes.

    loss_chunk_size: tokens per chunk of the fused loss head (None: the op's default,
    64 MiB of logits or the size of the hidden states, at least 256 tokens). Bigger
    chunks trade peak memory for speed: each chunk re-reads the whole lm_head gradient.

    On an instance, already-loaded weights are kept: modules change class, not
    parameters. Patching again with the same options is a no-op; with other options the
    previous patch is undone first. A RoPE patch swaps the family's module-global
    `apply_rotary_pos_emb` for a dispatcher that only runs the fused kernel inside
    patched models; `unpatch` restores it once no patched model uses it.

    With fused_linear_cross_entropy, a causal LM called with `labels` (or `shift_labels`)
    while training returns the loss with `logits=None`; in eval mode, without labels,
    or with `skip_logits=False` logits are computed as usual (`skip_logits=True` forces
    the fused path in eval mode).

    A built `transformers.Trainer` or TRL trainer patches `trainer.model` (and its
    reference / teacher model) and adapts the trainer to the fused loss, or turns the
    fused loss off where the trainer computes its loss itself: see
    `fuseforge.transformers.trainers`. The report is then the trainer's.

    Unknown model types are patched where modules are recognised from their code and
    get a warning naming what was and was not patched. Returns a PatchReport.
    """
    flags = _check_flags(
        dict(
            rms_norm=rms_norm,
            layer_norm=layer_norm,
            rope=rope,
            swiglu=swiglu,
            fused_linear_cross_entropy=fused_linear_cross_entropy,
            cross_entropy=cross_entropy,
            lora=lora,
        )
    )
    options = {**flags, "loss_chunk_size": _check_loss_chunk_size(loss_chunk_size, fused_linear_cross_entropy)}
    if is_trainer(model_or_class):
        return apply_kernels_to_trainer(model_or_class, options)
    if isinstance(model_or_class, type):
        if not issubclass(model_or_class, nn.Module):
            raise TypeError(f"model_or_class must be an nn.Module or an nn.Module class, got {model_or_class!r}")
        return patch_class(model_or_class, options)
    if not isinstance(model_or_class, nn.Module):
        raise TypeError(
            f"model_or_class must be an nn.Module or an nn.Module class, got {type(model_or_class).__name__} "
            "(a built transformers.Trainer or TRL trainer is accepted too)"
        )
    return patch_instance(model_or_class, options)


# Every keyword argument of apply_kernels with its default, and the kernel on/off flags among them.
DEFAULT_OPTIONS = types.MappingProxyType(
    {
        name: param.default
        for name, param in inspect.signature(apply_kernels).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    }
)
DEFAULT_FLAGS = types.MappingProxyType({name: v for name, v in DEFAULT_OPTIONS.items() if isinstance(v, bool)})


def unpatch(model_or_class) -> bool:
    """Undo apply_kernels on an instance, class or trainer; True if there was a patch to undo."""
    if isinstance(model_or_class, type):
        return unpatch_class(model_or_class)
    if is_trainer(model_or_class):
        return unpatch_trainer(model_or_class)
    return unpatch_instance(model_or_class)


def get_patch_report(model_or_class) -> PatchReport | None:
    """The report of the patch currently applied to a model or class, or None."""
    state = current_patch(model_or_class)
    return None if state is None else state.report


def is_patched(model_or_class) -> bool:
    return get_patch_report(model_or_class) is not None


@contextlib.contextmanager
def patched(model_or_class, **options):
    """Patch for the duration of a `with` block, then restore what was there before."""
    previous = current_patch(model_or_class)
    previous_options = None if previous is None else dict(previous.options)
    report = apply_kernels(model_or_class, **options)
    try:
        yield report
    finally:
        unpatch(model_or_class)
        if previous_options is not None:
            apply_kernels(model_or_class, **previous_options)


def _family_function(family: Family):
    def apply(model_or_class, **options) -> PatchReport:
        model_type = model_type_of(model_or_class)
        if model_type not in family.model_types:
            raise ValueError(
                f"apply_kernels_to_{family.name} expects a model with config.model_type in "
                f"{family.model_types}, got {model_type!r}; use apply_kernels for dispatch by model type"
            )
        return apply_kernels(model_or_class, **options)

    apply.__name__ = apply.__qualname__ = f"apply_kernels_to_{family.name}"
    apply.__doc__ = (
        f"apply_kernels for {family.name} models (model_type {', '.join(family.model_types)}); "
        "raises ValueError for other model types."
    )
    return apply


FAMILY_FUNCTIONS = {f"apply_kernels_to_{name}": _family_function(f) for name, f in FAMILIES.items()}
