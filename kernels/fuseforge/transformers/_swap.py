"""Swap a live module's class for a fused subclass, and back.

Changing `module.__class__` keeps the module object, its parameters (already-loaded
weights, tied weights, optimizer references, hooks) and `isinstance` checks intact;
only the methods the fused mixin defines change. The fused subclass is built once
per (original class, mixin) pair, so every patched module of a class shares it. It is called
`Fused<Original>`, except for mixins with `keeps_class_name` (decoder layers: FSDP wrap policies, the
models' `_no_split_modules` and checkpointing helpers find those layers by class name).
Plain `copy.deepcopy` works; pickling a whole patched model does not (save weights
with `save_pretrained` / `state_dict`, which are unchanged).
"""

from __future__ import annotations

import threading

from torch import nn

_LOCK = threading.Lock()
_FUSED_CLASSES: dict[tuple[type, type], type] = {}


def fused_class(original: type, mixin: type) -> type:
    """The subclass of `original` whose methods from `mixin` take precedence (cached)."""
    key = (original, mixin)
    with _LOCK:
        cls = _FUSED_CLASSES.get(key)
        if cls is None:
            name = original.__name__ if getattr(mixin, "keeps_class_name", False) else f"Fused{original.__name__}"
            cls = type(
                name,
                (mixin, original),
                {"__module__": mixin.__module__, "__qualname__": name, "_fuseforge_original": original},
            )
            _FUSED_CLASSES[key] = cls
    return cls


def is_fused(module: nn.Module) -> bool:
    return "_fuseforge_original" in type(module).__dict__


def swap(module: nn.Module, mixin: type) -> None:
    """Give `module` the fused class for `mixin` (the caller checks it is not fused yet)."""
    module.__class__ = fused_class(type(module), mixin)


def restore(module: nn.Module) -> bool:
    """Put back the class `swap` replaced; False when the module's class is not ours (anymore)."""
    original = type(module).__dict__.get("_fuseforge_original")
    if original is None:
        return False
    module.__class__ = original
    return True
