"""TRL's fused LM head (an instance forward TRL's trainers install) next to fuseforge's fused loss on one model."""

from __future__ import annotations

import functools
import inspect
import types

from torch import nn

from fuseforge.transformers.patching import patch_instance, unpatch_instance
from fuseforge.transformers.report import PatchReport


def _fused_head_forwards(model: nn.Module) -> dict:
    """Instance forwards installed by TRL's `add_fused_lm_head` (they take `fused_lm_head`)."""
    found = {}
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if forward is None or getattr(forward, "_fuseforge_fused_forward", False):
            continue
        try:
            params = inspect.signature(forward, follow_wrapped=False).parameters
        except (TypeError, ValueError):
            continue
        if "fused_lm_head" in params:
            found[module] = forward
    return found


def _route(module: nn.Module, ours, theirs) -> None:
    """One instance forward: TRL's fused head for `fused_lm_head=True` calls, ours for the rest.

    `unpatch` puts TRL's forward back (see patching._undo).
    """

    @functools.wraps(type(module).forward)
    def forward(self, *args, fused_lm_head=False, **kwargs):
        if fused_lm_head:
            return theirs(*args, fused_lm_head=True, **kwargs)
        return ours(*args, **kwargs)

    forward._fuseforge_fused_forward = True
    forward._fuseforge_previous_forward = theirs
    module.forward = types.MethodType(forward, module)


def patch_next_to_trl_head(model: nn.Module, options: dict) -> tuple[PatchReport, dict]:
    """Patch with the fused loss next to any fused LM head TRL installed on the model.

    TRL's head is an instance forward, which apply_kernels leaves alone (and then skips the
    fused loss): it is set aside, the model patched, and the two forwards combined by _route.
    Returns the report and TRL's forwards by module, to put back if a later step fails.
    """
    theirs = _fused_head_forwards(model)
    for module in theirs:
        del module.__dict__["forward"]
    if theirs:
        unpatch_instance(model)  # an earlier patch's forward sits under TRL's: install ours afresh
    try:
        report = patch_instance(model, options)
    except BaseException:
        put_back(model, theirs)
        raise
    for module, forward in theirs.items():
        ours = module.__dict__.get("forward")
        if getattr(ours, "_fuseforge_fused_forward", False):
            _route(module, ours, forward)
        else:  # no fused loss on this module (the report says why): TRL's head stays
            module.forward = forward
    return report, theirs


def put_back(model: nn.Module, theirs: dict) -> None:
    """Undo patch_next_to_trl_head: our patch off, TRL's forwards back."""
    unpatch_instance(model)
    for module, forward in theirs.items():
        module.forward = forward
