"""What an out-of-memory training step leaves allocated, and what holds it.

    python benchmarks/oom_memory.py --variant fuseforge:bf16 --seq 4096 --batch 4

Builds bench_lora's model (Llama-3-8B shape + peft LoRA), runs one step at a batch that runs out of memory, then
reports torch's allocated memory after the except block, after a cyclic garbage collection, and which kinds of
objects (functions by qualified name, autograd nodes by name) the collector found in cycles: memory freed only by
`gc.collect()` is held by reference cycles, memory kept after it by a live reference.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lora import build  # noqa: E402


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="fuseforge:bf16")
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    model, note = build(args, device)
    model.train()
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    allocated = (lambda: torch.cuda.memory_allocated()) if device == "cuda" else (lambda: 0)
    print(args.variant, note, "| before the step:", gib(allocated()), flush=True)
    gc.collect()
    gc.disable()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        print("the step fit; choose a larger --batch")
        return 1
    except torch.OutOfMemoryError as err:
        print("out of memory:", str(err).splitlines()[0][:120])
    print("after the except block:", gib(allocated()), flush=True)
    gc.set_debug(gc.DEBUG_SAVEALL)
    found = gc.collect()
    garbage = list(gc.garbage)
    gc.set_debug(0)
    kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in garbage)
    functions = collections.Counter(f"{o.__module__}:{o.__qualname__}" for o in garbage if callable(o)
                                    and hasattr(o, "__qualname__") and hasattr(o, "__module__"))
    tensors = [o for o in garbage if isinstance(o, torch.Tensor)]
    nodes = collections.Counter(type(t.grad_fn).__name__ for t in tensors if t.grad_fn is not None)
    print(f"in cycles: {found} objects, {len(tensors)} tensors "
          f"({gib(sum(t.untyped_storage().nbytes() for t in tensors if t.device.type == device))})")
    print("kinds:", kinds.most_common(20))
    print("functions:", functions.most_common(30))
    print("tensors' grad_fn:", nodes.most_common(20))
    del garbage, tensors
    gc.garbage.clear()
    gc.collect()
    gc.enable()
    if device == "cuda":
        torch.cuda.empty_cache()
    print("after gc.collect():", gib(allocated()), flush=True)
    if device == "cuda":
        print_live_tensors(model, opt, device)
        # a small step launches every kernel again with small arguments: if memory drops now, what held it was
        # tied to the last launch of each kernel, not to the failed step's graph as such
        small = torch.randint(0, model.config.vocab_size, (1, 64), device=device)
        model(input_ids=small, labels=small).loss.backward()
        opt.zero_grad(set_to_none=True)
        del small
        gc.collect()
        torch.cuda.empty_cache()
        print("after one small step:", gib(allocated()), flush=True)
    return 0


def describe(obj) -> str:
    """One line naming an object that holds memory alive: frames by code and line, dicts by their first keys."""
    import types

    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_filename.rsplit('/', 2)[-2:]}:{obj.f_lineno} {obj.f_code.co_qualname}"
    if isinstance(obj, types.TracebackType):
        return f"traceback at line {obj.tb_lineno}"
    if isinstance(obj, BaseException):
        return f"exception {type(obj).__name__}"
    what = type(obj).__qualname__
    if isinstance(obj, dict):
        what += "{" + ", ".join(map(str, list(obj)[:6])) + "}"
    elif hasattr(obj, "__qualname__"):
        what += f" {getattr(obj, '__module__', '')}:{obj.__qualname__}"
    return what[:200]


def print_live_tensors(model, opt, device: str, top: int = 3, depth: int = 8) -> None:
    """The largest tensors on `device` Python still reaches that are not the model's or the optimizer's, each with the
    chain of objects that refer to it, up to `depth` (an autograd graph is kept alive by any one tensor of it)."""
    import torch

    known = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    known |= {id(p.grad) for p in model.parameters() if p.grad is not None}
    known |= {id(v) for state in opt.state.values() for v in state.values() if torch.is_tensor(v)}
    live = [o for o in gc.get_objects() if torch.is_tensor(o) and o.device.type == device and id(o) not in known]
    live.sort(key=lambda t: -t.untyped_storage().nbytes())
    print(f"live {device} tensors outside the model and optimizer: {len(live)}")
    here = sys._getframe()
    for t in live[:top]:
        node = type(t.grad_fn).__name__ if t.grad_fn is not None else None
        print(f"  {tuple(t.shape)} {t.dtype} {gib(t.untyped_storage().nbytes())} grad_fn={node}")
        level, seen = [t], {id(live), id(here)}
        for step in range(depth):
            nxt = []
            for obj in level:
                for ref in gc.get_referrers(obj):
                    if id(ref) in seen or ref is level or ref is nxt:
                        continue
                    seen.add(id(ref))
                    print("    " + "  " * step + "<- " + describe(ref))
                    nxt.append(ref)
            level = nxt[:3]
            if not level:
                break


if __name__ == "__main__":
    sys.exit(main())
