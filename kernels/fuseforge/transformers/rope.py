"""Fused RoPE for Hugging Face attention, scoped to the patched model.

transformers' attention forwards call `apply_rotary_pos_emb` through their modeling
module's globals, so the only hook is that global, which every model of the family
in the process shares. To keep the patch per model anyway:

- the global is replaced by a dispatcher that runs the fused kernel only while a
  *patched* attention module is executing (a context variable its forward sets),
  and otherwise calls the original function: unpatched models of the same family
  keep their exact numerics;
- patched attention modules set that variable around their own forward, which also
  covers activation-checkpoint recomputation during backward, and (re)install the
  dispatcher if it is missing (e.g. for a deep copy of a patched model);
- the original global is put back when the last registered attention module of that
  modeling module is unpatched or garbage collected.

If something else replaces the global after us (another patching library), we do
not fight it: the fused path is then not taken, and unpatch leaves it in place.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import threading
import weakref

import torch
from torch import nn

from fuseforge.functional import rope
from fuseforge.transformers._fingerprint import matches

# Verified `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` bodies (rotate-half convention):
# the full-rotary one (Llama and ~120 other models), Phi-3's partial-rotary one, and OLMo 2/3's,
# which computes in the promoted dtype of q/k and cos/sin and casts back to q/k's dtype: what the
# kernel does (fp32 math, q/k's dtype out, cos/sin of any float dtype).
APPLY_ROTARY_POS_EMB = frozenset({"3e306efef1e6", "983e21780d51", "b3cd202ec32b"})
ROTATE_HALF = frozenset({"47a58608bb04"})
# GLM / GLM-4's interleaved-pair body (also Moonshine's): cos/sin[..., :Dr/2] repeat-interleaved,
# partial rotary over the first Dr dims, and a rotate_half that maps pairs (x[2i], x[2i+1]) to
# (-x[2i+1], x[2i]): the kernel's layout="interleaved". Only this pair of bodies takes that layout;
# a rotate-half apply body with the interleaved rotate_half (or the reverse) is not recognised.
APPLY_ROTARY_POS_EMB_INTERLEAVED = frozenset({"22307ccfdcbd"})
ROTATE_HALF_INTERLEAVED = frozenset({"00cd0e31c2ef"})
# (verified apply_rotary_pos_emb bodies, verified rotate_half bodies, kernel layout)
_VERIFIED = (
    (APPLY_ROTARY_POS_EMB, ROTATE_HALF, "rotate_half"),
    (APPLY_ROTARY_POS_EMB_INTERLEAVED, ROTATE_HALF_INTERLEAVED, "interleaved"),
)

GLOBAL_NAME = "apply_rotary_pos_emb"
_ACTIVE = contextvars.ContextVar("fuseforge_fused_rope_active", default=False)
_LOCK = threading.RLock()


class _Install:
    def __init__(self, original, dispatcher) -> None:
        self.original, self.dispatcher = original, dispatcher


_INSTALLS: dict[str, _Install] = {}
_USERS: dict[str, weakref.WeakSet] = {}


def _fusable(q, k, cos, sin, unsqueeze_dim) -> bool:
    """Inputs the kernel takes; anything else (other layouts, mixed q/k dtypes) goes to the original."""
    tensors = (q, k, cos, sin)
    return (
        all(isinstance(t, torch.Tensor) for t in tensors)
        and q.dim() == 4
        and k.dim() == 4
        and cos.dim() == 3
        and cos.shape == sin.shape
        and q.dtype == k.dtype
        and unsqueeze_dim in (1, 2)
    )


def _make_dispatcher(original, layout: str = "rotate_half"):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _ACTIVE.get() and _fusable(q, k, cos, sin, unsqueeze_dim):
            return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, layout=layout)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._fuseforge_layout = layout
    return apply_rotary_pos_emb


@functools.lru_cache(maxsize=None)
def rope_module_of(cls: type) -> str | None:
    """Name of the module whose global RoPE function the class's forward calls (through decorators)."""
    forward = getattr(cls, "forward", None)
    while forward is not None:
        code = getattr(forward, "__code__", None)
        if code is not None and GLOBAL_NAME in code.co_names:
            return forward.__globals__.get("__name__")
        forward = getattr(forward, "__wrapped__", None)
    return None


def _installed(module_name: str) -> bool:
    install = _INSTALLS.get(module_name)
    module = sys.modules.get(module_name)
    return install is not None and getattr(module, GLOBAL_NAME, None) is install.dispatcher


def _layout_of(module_name: str) -> tuple[str | None, str | None]:
    """(kernel layout, None) when the module's current RoPE global is verified; else (None, why not)."""
    current = getattr(sys.modules.get(module_name), GLOBAL_NAME, None)
    if current is None:
        return None, f"{module_name} has no {GLOBAL_NAME}"
    if getattr(current, "__wrapped__", None) is not None:
        return None, f"{module_name}.{GLOBAL_NAME} is not a recognised rotate-half or interleaved RoPE"
    for applies, rotate_halves, layout in _VERIFIED:
        if matches(current, applies):
            if not matches(current.__globals__.get("rotate_half"), rotate_halves):
                kind = "standard rotate-half" if layout == "rotate_half" else "interleaved-pair rotate_half"
                return None, f"{module_name}.rotate_half is not the {kind}"
            return layout, None
    return None, f"{module_name}.{GLOBAL_NAME} is not a recognised rotate-half or interleaved RoPE"


def check_module(module_name: str) -> str | None:
    """None when the module's RoPE is (or is dispatched to) a verified implementation; else why not."""
    if _installed(module_name):
        return None
    return _layout_of(module_name)[1]


def layout_of(module_name: str) -> str | None:
    """The kernel layout ("rotate_half" / "interleaved") the module's RoPE is (or would be) fused with."""
    if _installed(module_name):
        return _INSTALLS[module_name].dispatcher._fuseforge_layout
    return _layout_of(module_name)[0]


def ensure_installed(module_name: str) -> bool:
    """Put the dispatcher in place if it is missing and the current global is verified."""
    if _installed(module_name):
        return True
    with _LOCK:
        if _installed(module_name):
            return True
        layout, why_not = _layout_of(module_name)
        if why_not is not None:
            return False
        module = sys.modules[module_name]
        original = getattr(module, GLOBAL_NAME)
        install = _Install(original, _make_dispatcher(original, layout))
        setattr(module, GLOBAL_NAME, install.dispatcher)
        _INSTALLS[module_name] = install
        return True


def _uninstall(module_name: str) -> None:
    install = _INSTALLS.pop(module_name, None)
    module = sys.modules.get(module_name)
    if install is not None and getattr(module, GLOBAL_NAME, None) is install.dispatcher:
        setattr(module, GLOBAL_NAME, install.original)


def _release_if_unused(module_name: str) -> None:
    with _LOCK:
        # Iterate rather than len(): inside a finalizer the dying module may still be counted.
        if not any(True for _ in _USERS.get(module_name, ())):
            _uninstall(module_name)


def register(attention: nn.Module, module_name: str) -> bool:
    """Record a patched attention module and install the dispatcher; False if it cannot be.

    When the module is garbage collected without unpatch, the original global comes
    back as soon as no other registered module uses it.
    """
    with _LOCK:
        users = _USERS.setdefault(module_name, weakref.WeakSet())
        users.add(attention)
        if not ensure_installed(module_name):
            users.discard(attention)
            return False
        weakref.finalize(attention, _release_if_unused, module_name)
        return True


def unregister(attention: nn.Module, module_name: str) -> None:
    """Forget a patched attention module; restore the original global once none is left."""
    with _LOCK:
        _USERS.setdefault(module_name, weakref.WeakSet()).discard(attention)
    _release_if_unused(module_name)


class FusedRoPEAttentionMixin:
    """Attention whose forward is a scope in which its module's RoPE runs fused."""

    def forward(self, *args, **kwargs):
        if not ensure_installed(rope_module_of(type(self)._fuseforge_original)):
            return super().forward(*args, **kwargs)
        token = _ACTIVE.set(True)
        try:
            return super().forward(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)


def attention_candidates(model: nn.Module):
    """(module, modeling-module name) for unpatched modules whose forward calls a global RoPE function."""
    for module in model.modules():
        cls = type(module)
        if "_fuseforge_original" not in cls.__dict__:
            module_name = rope_module_of(cls)
            if module_name is not None:
                yield module, module_name
