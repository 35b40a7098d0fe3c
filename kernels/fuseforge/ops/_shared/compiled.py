"""How the ops run inside torch.compile: as torch.library custom ops, chosen only while compiling.

Why: dynamo cannot trace into a Triton launch (nor Triton's interpreter) or through the host-side
planning around it, so an autograd.Function around our launches breaks the graph at every op.
Each op module therefore also registers its forward and backward as `fuseforge::*` custom ops,
with fake (meta) implementations that give the output shapes, dtypes and strides without
computing, and autograd whose backward is itself a custom op, so compiled forward and backward
graphs stay whole. Their real implementations call the same launch functions the
autograd.Function does (one copy of each launch), so both paths give identical results.

Why not always the custom op: the dispatcher adds host overhead to every call, and eager
training is host-bound on small ops. The public functions check their arguments at the boundary
(plain Python, no host sync) and take the custom op only when `compiling()`.
What cannot be traced runs inside the custom op's real implementation, which runs eagerly: the
loss ops' class-index scan (ops/targets.py) and its ValueError on bad indices.
In-place reuse of saved buffers (swiglu's inplace_backward, cross_entropy's inplace_grad) is an
eager-only memory saving: a custom op's outputs may not alias its inputs, so the compiled path
writes gradients to fresh buffers (same values).
"""

from __future__ import annotations

import torch


def compiling() -> bool:
    """True while dynamo traces (then the ops dispatch to their custom ops)."""
    return torch.compiler.is_compiling()

