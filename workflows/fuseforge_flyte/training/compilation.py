"""torch.compile of the model (TrainSpec.compile): each decoder layer on its own.

Why per layer rather than the whole model:
- the layers are identical, so one compiled graph serves them all (the first layer's compile is
  reused; a whole-model graph compiles every layer and takes far longer);
- FSDP2 shards per layer: its all-gather/free hooks sit at the layer boundaries, outside the graphs;
  DDP's gradient hooks live on the parameters and need nothing from the graphs either;
- activation checkpointing (transformers checkpoints each layer's forward) runs inside the layer's
  compiled call, which torch.compile supports for non-reentrant checkpoints; a graph break inside a
  checkpointed layer makes torch.compile run that layer eagerly (still correct, just not faster);
- the model's KV cache is turned off (`use_cache=False`, as the engine builds models for training): with it
  every layer would compile its own graph;
- the fused loss head and the embeddings stay eager: they run once per step and the fused loss
  computes its own chunked gradient.
`Module.compile()` compiles in place, so the parameter names stay the plain transformers names (no
`_orig_mod.` part: checkpoints, resume and export see the same keys as without compile).

The backend is inductor; FUSEFORGE_COMPILE_BACKEND overrides it (for tests on the CPU, e.g.
"aot_eager", which checks the graphs without generating C++/Triton code).
"""

from __future__ import annotations

import logging
import os

import torch

from fuseforge_flyte.training.models import decoder_layers

log = logging.getLogger("fuseforge.training")

BACKEND_ENV = "FUSEFORGE_COMPILE_BACKEND"
DEFAULT_BACKEND = "inductor"


def compile_backend() -> str:
    return os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND


def compile_layers(model: torch.nn.Module, *, log_it: bool = False) -> int:
    """Compile each decoder layer of `model` in place; how many were compiled."""
    layers = decoder_layers(model, "compile")
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # A KV cache in training is never read, and each layer's update of it makes the shared graph guard on
        # the layer's index: one recompile per layer up to dynamo's limit (8), then the rest run eagerly.
        config.use_cache = False
    backend = compile_backend()
    for layer in layers:
        layer.compile(backend=backend)
    if log_it:
        log.info("compile: %d %s layers compiled with torch.compile (backend %s)", len(layers),
                 type(layers[0]).__name__, backend)
    return len(layers)
