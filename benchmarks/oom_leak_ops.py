"""Which op keeps its inputs' autograd graph alive when it runs out of memory inside its forward (a probe).

    python benchmarks/oom_leak_ops.py

For each case: an activation `h` with a graph (made by a plain matmul), then the op under test is called on it while
the process may allocate only a little more than it holds (torch.cuda.set_per_process_memory_fraction), so the op's
own allocation fails. After the except block and gc.collect(), a weak reference tells whether `h` is still alive.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))


class PlainFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        out = F.linear(x, w)
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def cases(big: int):
    """name -> (the op's other inputs, made before memory is capped; the call)."""
    from fuseforge.ops.glu import swiglu
    from fuseforge.ops.lora import lora_linear
    from fuseforge.ops.rms_norm import rms_norm

    def adapters(h):
        return (torch.zeros(8, big, device=h.device, dtype=h.dtype, requires_grad=True),
                torch.zeros(big * 4, 8, device=h.device, dtype=h.dtype, requires_grad=True))

    return {
        "torch linear (no custom Function)": (lambda h: (), lambda h, w: F.linear(h, w)),
        "a plain custom Function (linear inside)": (lambda h: (), lambda h, w: PlainFunction.apply(h, w)),
        "fuseforge lora_linear": (adapters, lambda h, w, a, b: lora_linear(h, w, a, b, 1.0)),
        "fuseforge swiglu": (lambda h: (h * 1,), lambda h, w, up: swiglu(h, up)),
        "fuseforge rms_norm": (lambda h: (torch.ones(big, device=h.device, dtype=h.dtype),),
                               lambda h, w, weight: rms_norm(h, weight)),
    }


def main() -> int:
    device = "cuda"
    total = torch.cuda.get_device_properties(0).total_memory
    big = 8192
    for name, (prepare, op) in cases(big).items():
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()
        x = torch.randn(16384, big, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(big * 4, big, device=device, dtype=torch.bfloat16, requires_grad=True)
        h = x @ torch.eye(big, device=device, dtype=torch.bfloat16)  # an activation with a graph
        ref = weakref.ref(h)
        extra = prepare(h)
        before = torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (64 << 20)) / total))
        try:
            out = op(h, w, *extra)
            result = f"no OOM ({tuple(out.shape)})"
            del out
        except torch.OutOfMemoryError:
            result = "OOM"
        del h, extra
        gc.collect()
        alive = ref() is not None
        print(f"{name:42s} {result:14s} activation alive after: {alive}   allocated {before / 2**30:.2f} -> "
              f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
        del x, w
    return 0


if __name__ == "__main__":
    sys.exit(main())
