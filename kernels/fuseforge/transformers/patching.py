"""The patching of Hugging Face models and model classes (apply_kernels' model side: dispatch.py is the entry).

An instance is patched in place: each recognised module's class is swapped for a
fused subclass (weights untouched), the causal-LM head gets the fused-loss forward
as an instance attribute, and everything done is recorded on the model so that
`unpatch` can undo exactly that. A class is patched by wrapping its `__init__`, so
every instance built afterwards (`from_pretrained`, `from_config`, Trainer's
`model_init`) is patched at construction.
"""

from __future__ import annotations

import functools
import types
import warnings
from dataclasses import dataclass, field, replace

from torch import nn

from fuseforge.loss_args import check_chunk_size
from fuseforge.transformers import rope as rope_patch
from fuseforge.transformers._swap import is_fused, restore, swap
from fuseforge.transformers.families import Family, family_for_model_type
from fuseforge.transformers.layers import plan, plan_decoder_layer
from fuseforge.transformers.lora import FusedLoraLinearMixin, lora_layers, peft_notes, plan_lora
from fuseforge.transformers.loss import (
    LOSS_SPEC_ATTR,
    FusedLossHeadMixin,
    LossSpec,
    causal_lm_loss,
    fused_forward_for,
    head_modules,
    is_stock_loss,
    lm_head_of,
)
from fuseforge.transformers.report import PatchReport

# Where a patched instance (or trainer: trainers/apply.py) keeps what the patch changed; a class, its _ClassPatch.
STATE_ATTR = "_fuseforge_state"
_CLASS_ATTR = "_fuseforge_class_patch"


@dataclass
class _State:
    """Everything a patch changed on one model, for unpatch."""

    options: dict  # apply_kernels' keyword arguments: kernel flags and loss_chunk_size
    report: PatchReport
    swapped: list = field(default_factory=list)  # modules whose class we swapped
    rope_users: list = field(default_factory=list)  # (attention module, its RoPE sites: see rope.py)
    forwards: list = field(default_factory=list)  # causal-LM modules given the fused forward
    loss_functions: list = field(default_factory=list)  # (module, previous _loss_function or _MISSING)


_MISSING = object()


def _new_report(target: str, model_type: str | None, family: Family | None, options: dict) -> PatchReport:
    flags = {name: value for name, value in options.items() if name != "loss_chunk_size"}
    return PatchReport(
        target=target,
        model_type=model_type,
        family=family and family.name,
        flags=flags,
        loss_chunk_size=options["loss_chunk_size"],
    )


def model_type_of(model_or_class) -> str | None:
    config = getattr(model_or_class, "config", None)
    if config is None or isinstance(model_or_class, type):
        config = getattr(model_or_class, "config_class", None)
    return getattr(config, "model_type", None) or None


# --- instances ---------------------------------------------------------------------------------


def _vision_subtrees(model: nn.Module, family: Family | None, report: PatchReport) -> set[int]:
    """ids of the modules of the family's vision tower / projector, which patching leaves as they are."""
    names = set(family.vision_modules) if family else set()
    left = set()
    for qualified, module in model.named_modules():
        if qualified.rsplit(".", 1)[-1] in names and id(module) not in left:
            left.update(id(m) for m in module.modules())
            report.notes.append(f"{qualified} ({type(module).__name__}): vision side, left as it is")
    return left


def _patch_leaves(model: nn.Module, options: dict, state: _State, left: set[int]) -> None:
    report = state.report
    for module in model.modules():
        if is_fused(module) or id(module) in left:
            continue
        decision = plan(module)
        if decision is None or not options[decision.kernel]:
            continue
        if decision.reason is not None:
            report.add_skipped(decision.kernel, decision.reason)
        if decision.mixin is None:
            continue
        if "forward" in module.__dict__:
            report.add_skipped(
                decision.kernel, f"{type(module).__name__}: forward overridden on the instance (e.g. by hooks)"
            )
            continue
        swap(module, decision.mixin)
        state.swapped.append(module)
        report.add_patched(decision.kernel, decision.label)


def _patch_decoder_layers(model: nn.Module, state: _State, left: set[int]) -> None:
    """Second pass, once the norms are fused: residual adds into the post-attention norms."""
    for module in model.modules():
        if is_fused(module) or id(module) in left or "forward" in module.__dict__:
            continue
        decision = plan_decoder_layer(module)
        if decision is not None:
            swap(module, decision.mixin)
            state.swapped.append(module)
            state.report.add_patched(decision.kernel, decision.label)


def _patch_rope(model: nn.Module, family: Family | None, state: _State, left: set[int]) -> None:
    report = state.report
    candidates = [(a, sites) for a, sites in rope_patch.attention_candidates(model) if id(a) not in left]
    limit = family.unfused_reason("rope") if family else None
    if limit is not None:
        if candidates:
            report.add_known_limit("rope", limit)
        return
    for attention, sites in candidates:
        reason = rope_patch.check_sites(sites)
        if reason is not None or "forward" in attention.__dict__:
            report.add_skipped("rope", reason or f"{type(attention).__name__}: forward overridden on the instance")
            continue
        name = type(attention).__name__
        swap(attention, rope_patch.FusedRoPEAttentionMixin)
        if not rope_patch.register(attention, sites):
            restore(attention)
            report.add_skipped("rope", f"{', '.join('.'.join(site) for site in sites)} could not be replaced")
            continue
        state.swapped.append(attention)
        state.rope_users.append((attention, sites))
        report.add_patched("rope", f"{name} ({rope_patch.describe(sites)})")


def _loss_heads(model: nn.Module, family: Family, chunk_size: int | None) -> list[tuple[nn.Module, LossSpec]]:
    """The family's causal LMs and image-text LMs in the model, each with what its forward does to the loss."""
    causal, multimodal = family.causal_lm_class(), family.multimodal_lm_class()
    text_spec = LossSpec(family.logit_softcap_attr, family.router_aux_loss, chunk_size, family.logit_scale_attr)
    plain_spec = LossSpec(chunk_size=chunk_size)  # multimodal forward: lm_head, then the stock loss
    heads, inside = [], set()
    for module in model.modules():
        if id(module) in inside:
            continue  # an LM within another (Llama 4's language model): the outer one computes the loss
        if causal is not None and isinstance(module, causal):
            heads.append((module, text_spec))
        elif multimodal is not None and isinstance(module, multimodal):
            heads.append((module, plain_spec))
        else:
            continue
        inside.update(id(m) for m in module.modules())
    return heads


def _patch_losses(model: nn.Module, family: Family | None, options: dict, state: _State) -> None:
    report = state.report
    wanted = [k for k in ("fused_linear_cross_entropy", "cross_entropy") if options[k]]
    if not wanted:
        return
    if family is None:
        for kernel in wanted:
            report.add_skipped(
                kernel, f"model type {report.model_type!r} is not a supported family; its loss is left as is"
            )
        return
    heads = _loss_heads(model, family, options["loss_chunk_size"])
    if not heads:
        classes = " or ".join(c for c in (family.causal_lm, family.multimodal_lm) if c)
        for kernel in wanted:
            report.add_skipped(kernel, f"no {classes} in this model; its loss is left as is")
        return
    for lm, spec in heads:
        name = type(lm).__name__
        if not is_stock_loss(lm.loss_function):
            for kernel in wanted:
                report.add_skipped(kernel, f"{name} has a custom loss_function; it is left in charge")
            continue
        if options["cross_entropy"]:
            state.loss_functions.append((lm, lm.__dict__.get("_loss_function", _MISSING)))
            lm.loss_function = causal_lm_loss
            report.add_patched("cross_entropy", f"{name}.loss_function")
        if options["fused_linear_cross_entropy"]:
            heads = head_modules(lm_head_of(lm))
            odd = [h for h in heads if type(h) is not nn.Linear and not isinstance(h, FusedLossHeadMixin)]
            if odd:
                report.add_skipped(
                    "fused_linear_cross_entropy",
                    f"{name}.lm_head is {type(odd[0]).__name__}, not nn.Linear (e.g. wrapped by an adapter)",
                )
                continue
            if "forward" in lm.__dict__:
                report.add_skipped("fused_linear_cross_entropy", f"{name}: forward overridden on the instance")
                continue
            setattr(lm, LOSS_SPEC_ATTR, spec)
            lm.forward = types.MethodType(fused_forward_for(type(lm)), lm)
            for head in heads:  # peft's modules_to_save: the original head and each adapter's trainable copy
                if not isinstance(head, FusedLossHeadMixin):
                    swap(head, FusedLossHeadMixin)
                    state.swapped.append(head)
            state.forwards.append(lm)
            where = "lm_head" if len(heads) == 1 else f"lm_head and its {len(heads) - 1} modules_to_save copies"
            report.add_patched("fused_linear_cross_entropy", f"{name} ({where})")


def _patch_lora(model: nn.Module, options: dict, state: _State) -> None:
    """peft's LoRA linears onto the fused LoRA linear (transformers/lora.py says when it runs); new ones only."""
    if not options["lora"]:
        return
    for name, module in lora_layers(model):
        if is_fused(module):
            continue
        reason = plan_lora(module)
        if reason is not None:
            state.report.add_skipped("lora", f"{name.rsplit('.', 1)[-1]}: {reason}")
            continue
        swap(module, FusedLoraLinearMixin)
        state.swapped.append(module)
        state.report.add_patched("lora", f"lora.Linear ({name.rsplit('.', 1)[-1]})")


def _patched_inside(model: nn.Module) -> list[nn.Module]:
    """Modules below `model` that carry their own patch (a model patched before peft wrapped it)."""
    return [m for m in model.modules() if m is not model and STATE_ATTR in m.__dict__]


def patch_instance(model: nn.Module, options: dict) -> PatchReport:
    """apply_kernels on an instance (options: its checked keyword arguments); see dispatch.apply_kernels."""
    for inner in _patched_inside(model):  # patched, then wrapped (peft): patch the whole instead
        unpatch_instance(inner)
    state = model.__dict__.get(STATE_ATTR)
    if state is not None:
        if state.options == options:
            _patch_lora(model, options, state)  # adapters added since
            return state.report
        unpatch_instance(model)
    model_type = model_type_of(model)
    family = family_for_model_type(model_type)
    report = _new_report(type(model).__name__, model_type, family, options)
    state = _State(options=dict(options), report=report)
    try:
        left = _vision_subtrees(model, family, report)
        _patch_leaves(model, options, state, left)
        if options["rms_norm"]:
            _patch_decoder_layers(model, state, left)
        if options["rope"]:
            _patch_rope(model, family, state, left)
        _patch_losses(model, family, options, state)
        _patch_lora(model, options, state)
    except BaseException:
        _undo(state)
        raise
    setattr(model, STATE_ATTR, state)
    report.notes.extend(peft_notes(model))
    if report.needs_warning():
        warnings.warn(report.summary(), UserWarning, stacklevel=3)
    return report


def _undo(state: _State) -> None:
    for lm, previous in state.loss_functions:
        if previous is _MISSING:
            lm.__dict__.pop("_loss_function", None)
        else:
            lm._loss_function = previous
    for lm in state.forwards:
        forward = lm.__dict__.get("forward")
        if getattr(forward, "_fuseforge_fused_forward", False):
            previous = getattr(forward, "_fuseforge_previous_forward", None)  # see trainers/trl_head.py
            if previous is None:
                del lm.forward
            else:
                lm.forward = previous
        lm.__dict__.pop(LOSS_SPEC_ATTR, None)
    for module in state.swapped:
        restore(module)
    for attention, sites in state.rope_users:
        rope_patch.unregister(attention, sites)


# --- classes -----------------------------------------------------------------------------------


@dataclass
class _ClassPatch:
    original_init: object  # the class's own __init__, or _MISSING when it inherited one
    options: dict  # what each new instance is patched with
    report: PatchReport


def patch_class(cls: type, options: dict) -> PatchReport:
    """apply_kernels on a model class: instances built from now on are patched with `options`."""
    model_type = model_type_of(cls)
    family = family_for_model_type(model_type)
    report = _new_report(f"class {cls.__name__}", model_type, family, options)
    existing = cls.__dict__.get(_CLASS_ATTR)
    if existing is not None:
        existing.options = dict(options)
        existing.report.flags, existing.report.loss_chunk_size = report.flags, report.loss_chunk_size
        return existing.report
    report.notes.append("instances created from now on are patched at construction (see get_patch_report)")
    inherited_init = cls.__init__
    patch = _ClassPatch(cls.__dict__.get("__init__", _MISSING), dict(options), report)

    @functools.wraps(inherited_init)
    def __init__(self, *args, **kwargs):
        inherited_init(self, *args, **kwargs)
        patch_instance(self, patch.options)

    cls.__init__ = __init__
    setattr(cls, _CLASS_ATTR, patch)
    if family is None:
        report.notes.append("not a supported family: only modules recognised from their code will be fused")
        warnings.warn(report.summary(), UserWarning, stacklevel=3)
    return report


def unpatch_class(cls: type) -> bool:
    patch = cls.__dict__.get(_CLASS_ATTR)
    if patch is None:
        return False
    if patch.original_init is _MISSING:
        del cls.__init__
    else:
        cls.__init__ = patch.original_init
    delattr(cls, _CLASS_ATTR)
    return True


# --- undo and look-up ---------------------------------------------------------------------------


def unpatch_instance(model: nn.Module) -> bool:
    """Undo patch_instance; True if there was a patch to undo."""
    state = model.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return False
    _undo(state)
    return True


def current_patch(model_or_class) -> _State | _ClassPatch | None:
    """What the patch applied to a model, class or trainer recorded (its `options` and `report`), or None."""
    holder = _CLASS_ATTR if isinstance(model_or_class, type) else STATE_ATTR
    return getattr(model_or_class, "__dict__", {}).get(holder)


def set_loss_chunk_size(model: nn.Module, loss_chunk_size: int | None) -> None:
    """Change the tokens per fused-loss chunk of a patched model in place (None: the op's default rule).

    Cheaper than patching again (nothing is swapped): a planner can try chunk sizes between steps. The
    report and a later `apply_kernels(model, loss_chunk_size=...)` see the new value.
    """
    state = model.__dict__.get(STATE_ATTR) if isinstance(model, nn.Module) else None
    if state is None:
        raise ValueError(f"set_loss_chunk_size: {type(model).__name__} is not patched by apply_kernels")
    if not state.forwards:
        raise ValueError(f"set_loss_chunk_size: {type(model).__name__} has no fused loss head "
                         "(fused_linear_cross_entropy was off or skipped; see get_patch_report)")
    loss_chunk_size = check_chunk_size(loss_chunk_size, "loss_chunk_size")
    for lm in state.forwards:
        setattr(lm, LOSS_SPEC_ATTR, replace(getattr(lm, LOSS_SPEC_ATTR), chunk_size=loss_chunk_size))
    state.options["loss_chunk_size"] = loss_chunk_size
    state.report.loss_chunk_size = loss_chunk_size
