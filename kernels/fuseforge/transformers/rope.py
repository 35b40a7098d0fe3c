"""Fused RoPE for Hugging Face attention, scoped to the patched model.

transformers' attention forwards call their RoPE function (`apply_rotary_pos_emb`;
DeepSeek-V3's `apply_rotary_pos_emb_interleave`; Llama 4's `apply_rotary_emb`, which
takes complex `freqs_cis`) through their modeling module's globals, so the only hook is
that global, which every model of the family in the process shares. Each (modeling
module, global name) is a "site"; an attention class is fused when every site its
forward calls is a verified implementation. To keep the patch per model anyway:

- the global is replaced by a dispatcher that runs the fused kernel only while a
  *patched* attention module is executing (a context variable its forward sets),
  and otherwise calls the original function: unpatched models of the same family
  keep their exact numerics;
- patched attention modules set that variable around their own forward, which also
  covers activation-checkpoint recomputation during backward, and (re)install the
  dispatcher if it is missing (e.g. for a deep copy of a patched model);
- the original global is put back when the last registered attention module of that
  site is unpatched or garbage collected.

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
# kernel does (fp32 math, q/k's dtype out, cos/sin of any float dtype). Multimodal RoPE (Qwen2.5-VL's
# sectioned, Qwen3-VL's interleaved) arrives here as ordinary cos/sin: in transformers 5.17-5.24 their rotary
# embedding modules merge the temporal/height/width sections before this body runs, so no mRoPE op is needed.
APPLY_ROTARY_POS_EMB = frozenset({"3e306efef1e6", "983e21780d51", "b3cd202ec32b"})
ROTATE_HALF = frozenset({"47a58608bb04"})
# GLM / GLM-4's interleaved-pair body (also Moonshine's): cos/sin[..., :Dr/2] repeat-interleaved,
# partial rotary over the first Dr dims, and a rotate_half that maps pairs (x[2i], x[2i+1]) to
# (-x[2i+1], x[2i]): the kernel's layout="interleaved". Only this pair of bodies takes that layout;
# a rotate-half apply body with the interleaved rotate_half (or the reverse) is not recognised.
APPLY_ROTARY_POS_EMB_INTERLEAVED = frozenset({"22307ccfdcbd"})
ROTATE_HALF_INTERLEAVED = frozenset({"00cd0e31c2ef"})
# DeepSeek-V3's apply_rotary_pos_emb_interleave (called when config.rope_interleave; copied into
# DeepSeek-V3.2, GLM-4-MoE-Lite and others): pairs (x[2i], x[2i+1]) rotated by cos/sin[..., i] and
# written out as halves [rotated x[0::2] | rotated x[1::2]]: the kernel's layout="interleaved_to_half".
# It calls no rotate_half. Verified on 5.17 and 5.24.
APPLY_ROTARY_POS_EMB_INTERLEAVE = frozenset({"802a4a476ca7"})
# Llama 4's apply_rotary_emb(xq, xk, freqs_cis): x viewed as complex pairs (x[2i], x[2i+1]) in fp32,
# times freqs_cis[..., i] = cos_i + i sin_i, cast back to x's dtype: layout="interleaved" with
# cos/sin = freqs_cis.real/.imag. Verified on 5.17 and 5.24.
APPLY_ROTARY_EMB_COMPLEX = frozenset({"33805806ade0"})
# GPT-OSS's apply_rotary_pos_emb(q, k, cos, sin) rotates the two halves in `_apply_rotary_emb` with cos/sin
# holding each of the Dr/2 frequencies once (not twice): rotate-half on cat(cos, cos) ("half_width").
# Gemma 4's apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim) rotates one tensor per call (q, then k) with
# the standard rotate_half ("single"); its partial "proportional" RoPE comes as zero frequencies (cos 1,
# sin 0), which the kernel applies exactly. Bodies and helpers identical on 5.17 and 5.24.
APPLY_ROTARY_POS_EMB_HALF_WIDTH = frozenset({"5a28dae18508"})
APPLY_ROTARY_EMB_HALVES = frozenset({"76b288d56c7d"})
APPLY_ROTARY_POS_EMB_SINGLE = frozenset({"6b8ab4e6dfb8"})
# The helper global a verified body calls, where it is not `rotate_half`.
_HELPER_NAMES = {"half_width": "_apply_rotary_emb"}
# global name -> ((verified bodies, verified rotate_half bodies or None when it calls none, kernel layout), ...)
_VERIFIED = {
    "apply_rotary_pos_emb": (
        (APPLY_ROTARY_POS_EMB, ROTATE_HALF, "rotate_half"),
        (APPLY_ROTARY_POS_EMB_INTERLEAVED, ROTATE_HALF_INTERLEAVED, "interleaved"),
        (APPLY_ROTARY_POS_EMB_HALF_WIDTH, APPLY_ROTARY_EMB_HALVES, "half_width"),
        (APPLY_ROTARY_POS_EMB_SINGLE, ROTATE_HALF, "single"),
    ),
    "apply_rotary_pos_emb_interleave": ((APPLY_ROTARY_POS_EMB_INTERLEAVE, None, "interleaved_to_half"),),
    "apply_rotary_emb": ((APPLY_ROTARY_EMB_COMPLEX, None, "interleaved"),),
}
GLOBAL_NAMES = tuple(_VERIFIED)
# How the report names each kernel layout, after the function's name.
_LAYOUT_LABELS = {
    "rotate_half": "",
    "interleaved": ", interleaved pairs",
    "interleaved_to_half": ", interleaved pairs to halves",
}
_ACTIVE = contextvars.ContextVar("fuseforge_fused_rope_active", default=False)
# The same scope while dynamo traces, which cannot trace a ContextVar: a plain list it can (one entry
# per patched attention forward being traced). Only the trace reads it; compiled code holds the result.
_TRACED_SCOPES: list[bool] = []


def _active() -> bool:
    """Whether a patched attention forward (the fused-RoPE scope) is running."""
    if torch.compiler.is_compiling():
        return bool(_TRACED_SCOPES)
    return _ACTIVE.get()
_LOCK = threading.RLock()


class _Install:
    def __init__(self, original, dispatcher) -> None:
        self.original, self.dispatcher = original, dispatcher


Site = tuple[str, str]  # (modeling module name, global RoPE function name)
_INSTALLS: dict[Site, _Install] = {}
_USERS: dict[Site, weakref.WeakSet] = {}


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


def _fusable_complex(xq, xk, freqs_cis) -> bool:
    """Llama 4's [B, T, H, D] q/k with [1 or B, T, D/2] complex freqs_cis, as the kernel takes them."""
    if not all(isinstance(t, torch.Tensor) for t in (xq, xk, freqs_cis)):
        return False
    return (
        xq.dim() == 4
        and xk.dim() == 4
        and freqs_cis.dim() == 3
        and freqs_cis.is_complex()
        and xq.dtype == xk.dtype
        and xq.is_floating_point()
        and xq.shape[0] == xk.shape[0]
        and xq.shape[1] == xk.shape[1] == freqs_cis.shape[1]
        and xq.shape[3] == xk.shape[3] == 2 * freqs_cis.shape[2]
        and freqs_cis.shape[0] in (1, xq.shape[0])
        and xk.shape[2] > 0
        and xq.shape[2] % xk.shape[2] == 0
    )


def _cos_sin_of(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """freqs_cis = cos + i sin per pair as [.., D] cos/sin: layout="interleaved" reads their first half."""
    cos, sin = freqs_cis.real, freqs_cis.imag
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _half_width_dispatcher(original):
    """GPT-OSS: cos/sin of width Dr/2 (each frequency once); the kernel reads both halves of [cos, cos]."""

    @functools.wraps(original)
    def dispatcher(q, k, cos, sin, unsqueeze_dim=1):
        if _active() and _fusable(q, k, cos, sin, unsqueeze_dim):
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    return dispatcher


def _single_tensor_dispatcher(original):
    """Gemma 4 rotates q and k in separate calls, the kernel a (q, k) pair: a detached one-head view of x
    stands in for k (1/H extra work); its output is dropped and it takes no gradient."""

    @functools.wraps(original)
    def dispatcher(x, cos, sin, unsqueeze_dim=1):
        if _active() and _fusable(x, x, cos, sin, unsqueeze_dim) and x.shape[unsqueeze_dim] > 0:
            stand_in = x.detach().narrow(unsqueeze_dim, 0, 1)
            return rope(x, stand_in, cos, sin, unsqueeze_dim=unsqueeze_dim)[0]
        return original(x, cos, sin, unsqueeze_dim)

    return dispatcher


# Verified forms of apply_rotary_pos_emb with another call signature or cos/sin width (see above).
_FORM_DISPATCHERS = {"half_width": _half_width_dispatcher, "single": _single_tensor_dispatcher}
_LAYOUT_LABELS.update({"half_width": ", half-width cos/sin", "single": ", one tensor per call"})


def _make_dispatcher(name: str, original, layout: str):
    """A stand-in for the global `name` with the original's signature: fused inside patched attention."""
    if layout in _FORM_DISPATCHERS:
        dispatcher = _FORM_DISPATCHERS[layout](original)
        dispatcher._fuseforge_layout = layout
        return dispatcher
    if name == "apply_rotary_emb":

        @functools.wraps(original)
        def dispatcher(xq, xk, freqs_cis):
            if _active() and _fusable_complex(xq, xk, freqs_cis):
                return rope(xq, xk, *_cos_sin_of(freqs_cis), unsqueeze_dim=2, layout=layout)
            return original(xq, xk, freqs_cis)

    elif name == "apply_rotary_pos_emb_interleave":

        @functools.wraps(original)
        def dispatcher(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            # HF rotates the whole head: cos/sin as wide as q/k (anything else is left to it).
            fusable = _fusable(q, k, cos, sin, unsqueeze_dim) and cos.shape[-1] == q.shape[-1]
            if _active() and fusable:
                return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, layout=layout)
            return original(q, k, cos, sin, position_ids, unsqueeze_dim)

    else:

        @functools.wraps(original)
        def dispatcher(q, k, cos, sin, unsqueeze_dim=1):
            if _active() and _fusable(q, k, cos, sin, unsqueeze_dim):
                return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, layout=layout)
            return original(q, k, cos, sin, unsqueeze_dim)

    dispatcher._fuseforge_layout = layout
    return dispatcher


@functools.lru_cache(maxsize=None)
def rope_sites_of(cls: type) -> tuple[Site, ...]:
    """The (module, global) RoPE functions the class's forward calls (through decorators); () if none."""
    forward = getattr(cls, "forward", None)
    while forward is not None:
        code = getattr(forward, "__code__", None)
        names = [name for name in GLOBAL_NAMES if code is not None and name in code.co_names]
        if names:
            module_name = forward.__globals__.get("__name__")
            return tuple((module_name, name) for name in names)
        forward = getattr(forward, "__wrapped__", None)
    return ()


def _installed(site: Site) -> bool:
    install = _INSTALLS.get(site)
    module = sys.modules.get(site[0])
    return install is not None and getattr(module, site[1], None) is install.dispatcher


def _layout_of(site: Site) -> tuple[str | None, str | None]:
    """(kernel layout, None) when the site's current global is verified; else (None, why not)."""
    module_name, name = site
    current = getattr(sys.modules.get(module_name), name, None)
    if current is None:
        return None, f"{module_name} has no {name}"
    unknown = f"{module_name}.{name} is not a recognised RoPE implementation"
    if getattr(current, "__wrapped__", None) is not None:
        return None, unknown
    for applies, rotate_halves, layout in _VERIFIED[name]:
        if matches(current, applies):
            helper = _HELPER_NAMES.get(layout, "rotate_half")
            if rotate_halves is not None and not matches(current.__globals__.get(helper), rotate_halves):
                kind = {"rotate_half": "standard rotate-half", "interleaved": "interleaved-pair rotate_half"}
                return None, f"{module_name}.{helper} is not the {kind.get(layout, 'verified one')}"
            return layout, None
    return None, unknown


def check_sites(sites: tuple[Site, ...]) -> str | None:
    """None when every site is (or is dispatched to) a verified implementation; else why not."""
    for site in sites:
        if not _installed(site) and (reason := _layout_of(site)[1]) is not None:
            return reason
    return None


def layout_of(site: Site) -> str | None:
    """The kernel layout the site's RoPE is (or would be) fused with."""
    if _installed(site):
        return _INSTALLS[site].dispatcher._fuseforge_layout
    return _layout_of(site)[0]


def describe(sites: tuple[Site, ...]) -> str:
    """The report's name for what is fused: e.g. "modeling_glm4.apply_rotary_pos_emb, interleaved pairs"."""
    return "; ".join(
        f"{module_name.rsplit('.', 1)[-1]}.{name}{_LAYOUT_LABELS.get(layout_of((module_name, name)), '')}"
        for module_name, name in sites
    )


def ensure_installed(site: Site) -> bool:
    """Put the dispatcher in place if it is missing and the current global is verified."""
    if _installed(site):
        return True
    with _LOCK:
        if _installed(site):
            return True
        layout, why_not = _layout_of(site)
        if why_not is not None:
            return False
        module_name, name = site
        module = sys.modules[module_name]
        original = getattr(module, name)
        install = _Install(original, _make_dispatcher(name, original, layout))
        setattr(module, name, install.dispatcher)
        _INSTALLS[site] = install
        return True


def _uninstall(site: Site) -> None:
    install = _INSTALLS.pop(site, None)
    module = sys.modules.get(site[0])
    if install is not None and getattr(module, site[1], None) is install.dispatcher:
        setattr(module, site[1], install.original)


def _release_if_unused(site: Site) -> None:
    with _LOCK:
        # Iterate rather than len(): inside a finalizer the dying module may still be counted.
        if not any(True for _ in _USERS.get(site, ())):
            _uninstall(site)


def register(attention: nn.Module, sites: tuple[Site, ...]) -> bool:
    """Record a patched attention module and install the dispatchers of all its sites; False if one cannot be.

    When the module is garbage collected without unpatch, each original global comes
    back as soon as no other registered module uses it.
    """
    with _LOCK:
        for done, site in enumerate(sites):
            users = _USERS.setdefault(site, weakref.WeakSet())
            users.add(attention)
            if not ensure_installed(site):
                unregister(attention, sites[: done + 1])
                return False
            weakref.finalize(attention, _release_if_unused, site)
        return True


def unregister(attention: nn.Module, sites: tuple[Site, ...]) -> None:
    """Forget a patched attention module; restore each original global once none is left."""
    for site in sites:
        with _LOCK:
            _USERS.setdefault(site, weakref.WeakSet()).discard(attention)
        _release_if_unused(site)


class FusedRoPEAttentionMixin:
    """Attention whose forward is a scope in which its module's RoPE runs fused."""

    def forward(self, *args, **kwargs):
        if not all(ensure_installed(site) for site in rope_sites_of(type(self)._fuseforge_original)):
            return super().forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            _TRACED_SCOPES.append(True)
            try:
                return super().forward(*args, **kwargs)
            finally:
                _TRACED_SCOPES.pop()
        token = _ACTIVE.set(True)
        try:
            return super().forward(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)


def attention_candidates(model: nn.Module):
    """(module, its RoPE sites) for unpatched modules whose forward calls a global RoPE function."""
    for module in model.modules():
        cls = type(module)
        if "_fuseforge_original" not in cls.__dict__:
            sites = rope_sites_of(cls)
            if sites:
                yield module, sites
