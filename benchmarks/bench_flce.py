"""Benchmark fused linear + cross-entropy (LM head loss), forward + backward, on one GPU.

Compares, in one process and on the same inputs:
  fuseforge      fuseforge.functional.fused_linear_cross_entropy
  torch          eager F.linear -> .float() -> F.cross_entropy (what HF's ForCausalLMLoss does)
  torch.compile  the same function under torch.compile
  liger          liger_kernel's LigerFusedLinearCrossEntropyLoss   (if importable, else n/a)
  cce            cut_cross_entropy.linear_cross_entropy             (if importable, else n/a)

Time: median of triton.testing.do_bench over a closure running forward + backward (the
inputs' .grad is reset to None before every run, outside the timed region).

Extra peak memory, the number fused kernels exist to shrink:
    max_memory_allocated() during one forward + backward
  - memory_allocated() just before it (inputs, cuBLAS workspaces, .grad cleared)
  - bytes of grad_hidden + grad_weight (outputs any implementation must return)
i.e. everything an implementation allocates beyond its unavoidable results.

Correctness: each implementation's loss and gradients are compared with eager fp32
(logits, softmax and GEMMs in fp32 from the same bf16 inputs); max abs diffs are printed.

    python benchmarks/bench_flce.py                       # 8192 x 4096 -> 128256, bf16
    python benchmarks/bench_flce.py --sweep --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Callable

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SWEEP_VOCABS = (32000, 151936, 256000)
IMPLS = ("fuseforge", "torch", "torch.compile", "liger", "cce")
MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="N: tokens (batch * sequence)")
    p.add_argument("--hidden", type=int, default=4096, help="H: hidden size")
    p.add_argument("--vocab", type=int, default=128256, help="V: vocabulary size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--sweep", action="store_true", help=f"also run vocab sizes {SWEEP_VOCABS}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    p.add_argument("--chunk-size", type=int, default=None, help="fuseforge tokens per chunk (default: 64 MiB logits)")
    p.add_argument("--ignore-fraction", type=float, default=0.0, help="fraction of targets set to ignore_index")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time, ms")
    p.add_argument("--no-check", action="store_true", help="skip the fp32 correctness comparison")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    unknown = set(args.impls.split(",")) - set(IMPLS)
    if unknown:
        p.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    return args


# ----------------------------------------------------------------------------- implementations


def _eager(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def make_loss_fn(name: str, chunk_size: int | None) -> Callable | None:
    """loss(hidden, weight, target) for one implementation, or None if it is not installed."""
    if name == "fuseforge":
        from fuseforge.functional import fused_linear_cross_entropy

        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size)
    if name == "torch":
        return _eager
    if name == "torch.compile":
        return torch.compile(_eager)
    if name == "liger":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            return None
        liger = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, t: liger(w, h, t)  # Liger takes the weight first
    if name == "cce":
        try:
            from cut_cross_entropy import linear_cross_entropy
        except ImportError:
            return None
        return lambda h, w, t: linear_cross_entropy(h, w, t)
    raise ValueError(name)


# ----------------------------------------------------------------------------- measurements


def make_inputs(n, h, v, dtype, ignore_fraction, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), device=device, generator=gen)
    drop = torch.rand(n, device=device, generator=gen) < ignore_fraction
    target[drop] = -100
    return hidden, weight, target


def fwd_bwd(loss_fn, hidden, weight, target):
    hidden.grad = None
    weight.grad = None
    loss = loss_fn(hidden, weight, target)
    loss.backward()
    return loss


def extra_peak_mib(loss_fn, hidden, weight, target) -> float:
    """Peak allocated during one fwd+bwd beyond inputs and the returned gradients (see module doc)."""
    hidden.grad = None
    weight.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(loss_fn, hidden, weight, target)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    outputs = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    return (peak - before - outputs) / MiB


def fp32_reference(hidden, weight, target):
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), target)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def max_abs_diffs(loss_fn, hidden, weight, target, ref) -> tuple[float, float, float]:
    loss = fwd_bwd(loss_fn, hidden, weight, target)
    ref_loss, ref_gh, ref_gw = ref
    return (
        (loss.detach().float() - ref_loss).abs().item(),
        (hidden.grad.float() - ref_gh).abs().max().item(),
        (weight.grad.float() - ref_gw).abs().max().item(),
    )


def bench_shape(args, n, h, v) -> list[dict]:
    import triton.testing

    dtype = DTYPES[args.dtype]
    hidden, weight, target = make_inputs(n, h, v, dtype, args.ignore_fraction)
    ref = None
    if not args.no_check:
        ref = fp32_reference(hidden, weight, target)
        torch.cuda.empty_cache()
    rows = []
    for name in args.impls.split(","):
        row = dict(impl=name, tokens=n, hidden=h, vocab=v, dtype=args.dtype, ms=None, extra_mib=None,
                   loss_diff=None, grad_hidden_diff=None, grad_weight_diff=None, note="")
        loss_fn = make_loss_fn(name, args.chunk_size)
        if loss_fn is None:
            row["note"] = "n/a (not installed)"
            rows.append(row)
            continue
        try:
            fwd_bwd(loss_fn, hidden, weight, target)  # compile / autotune / allocate workspaces
            row["extra_mib"] = extra_peak_mib(loss_fn, hidden, weight, target)
            row["ms"] = triton.testing.do_bench(
                lambda: fwd_bwd(loss_fn, hidden, weight, target),
                warmup=args.warmup, rep=args.rep, grad_to_none=[hidden, weight], return_mode="median",
            )
            if ref is not None:
                row["loss_diff"], row["grad_hidden_diff"], row["grad_weight_diff"] = max_abs_diffs(
                    loss_fn, hidden, weight, target, ref)
        except torch.cuda.OutOfMemoryError:
            row["note"] = "OOM"
        except Exception as err:  # a baseline failing must not hide the others' numbers
            row["note"] = f"failed: {type(err).__name__}: {err}"[:120]
        hidden.grad = None
        weight.grad = None
        torch.cuda.empty_cache()
        rows.append(row)
    eager_ms = next((r["ms"] for r in rows if r["impl"] == "torch" and r["ms"]), None)
    for r in rows:
        r["vs_eager"] = eager_ms / r["ms"] if eager_ms and r["ms"] else None
    return rows


# ----------------------------------------------------------------------------- report


def _fmt(x, spec):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| shape (N x H -> V, dtype) | impl | ms | extra MiB | speedup vs eager (x) "
        "| max abs diff loss / dH / dW vs fp32 | note |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        diffs = "n/a" if r["loss_diff"] is None else (
            f"{r['loss_diff']:.1e} / {r['grad_hidden_diff']:.1e} / {r['grad_weight_diff']:.1e}")
        lines.append(
            f"| {r['tokens']} x {r['hidden']} -> {r['vocab']}, {r['dtype']} | {r['impl']} | {_fmt(r['ms'], '.2f')} "
            f"| {_fmt(r['extra_mib'], '.1f')} | {_fmt(r['vs_eager'], '.2f')} | {diffs} | {r['note']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_flce.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    shapes = [(args.tokens, args.hidden, args.vocab)]
    if args.sweep:
        shapes += [(args.tokens, args.hidden, v) for v in SWEEP_VOCABS if v != args.vocab]
    rows = []
    for n, h, v in shapes:
        rows += bench_shape(args, n, h, v)
        print(markdown_table([r for r in rows if r["vocab"] == v]), flush=True)
        print()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
