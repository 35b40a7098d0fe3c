"""Benchmark the fused LM head loss (linear + cross-entropy), forward + backward, in one process.

    python benchmarks/bench_flce.py                         # 8192 tokens x 4096 -> 128256, bf16
    python benchmarks/bench_flce.py --sweep --json out.json # also vocab 32000 / 151936 / 256000
    TRITON_INTERPRET=1 python benchmarks/bench_flce.py --smoke   # CPU check of the script (no timing)

Implementations, on the same inputs:
  fuseforge  fuseforge.functional.fused_linear_cross_entropy
  eager      F.linear -> .float() -> F.cross_entropy (what HF's ForCausalLMLoss computes)
  compile    the same function under torch.compile
  liger      Liger-Kernel's LigerFusedLinearCrossEntropyLoss      (n/a when not installed)
  cce        cut_cross_entropy.linear_cross_entropy                (n/a when not installed)

ms: median of triton.testing.do_bench over forward + backward (grads reset to None first).
extra MiB: peak torch.cuda.max_memory_allocated() during one forward + backward, minus what
  was allocated before it (inputs), minus the bytes of grad_hidden + grad_weight (results every
  implementation must return): what an implementation allocates beyond its unavoidable outputs.
floor ms: the three GEMMs alone (logits = h @ W.T, dh = g @ W, dW = g.T @ h) at full size, timed
  with torch.mm into preallocated outputs: no implementation that does these FLOPs is faster.
diffs: max abs difference of loss / grad_hidden / grad_weight against eager fp32 (fp32 GEMMs
  and softmax from the same rounded inputs).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    Measurement,
    environment,
    finish,
    format_table,
    fwd_bwd,
    peak_extra_mib,
    time_ms,
    try_import,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SWEEP_VOCABS = (32000, 151936, 256000)
IMPLS = ("fuseforge", "eager", "compile", "liger", "cce")
SMOKE_SHAPE = (96, 32, 500)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="N: tokens (batch x sequence)")
    p.add_argument("--hidden", type=int, default=4096, help="H: hidden size")
    p.add_argument("--vocab", type=int, default=128256, help="V: vocabulary size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--sweep", action="store_true", help=f"also run vocab sizes {SWEEP_VOCABS}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    p.add_argument("--chunk-size", type=int, default=None, help="fuseforge tokens per chunk (default: 64 MiB logits)")
    p.add_argument("--ignore-fraction", type=float, default=0.0, help="fraction of targets set to ignore_index")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time, ms")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with eager fp32")
    p.add_argument("--json", metavar="PATH", help="also write results and environment as JSON")
    p.add_argument("--smoke", action="store_true", help=f"CPU/interpreter: shape {SMOKE_SHAPE}, no timing")
    args = p.parse_args(argv)
    unknown = set(args.impls.split(",")) - set(IMPLS)
    if unknown:
        p.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    if not args.smoke and not torch.cuda.is_available():
        p.error("timing needs a CUDA device; use --smoke on the CPU (with TRITON_INTERPRET=1)")
    if args.smoke and args.chunk_size is None:
        args.chunk_size = 16  # small chunks, so the smoke run takes every fuseforge code path
    return args


def _eager(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def make_loss_fn(name: str, chunk_size: int | None) -> Callable | None:
    """loss(hidden, weight, target) for one implementation; None when its library is not installed."""
    if name == "fuseforge":
        from fuseforge.functional import fused_linear_cross_entropy

        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size)
    if name == "eager":
        return _eager
    if name == "compile":
        return torch.compile(_eager)
    if name == "liger":
        liger = try_import("liger_kernel.transformers")
        if liger is None:
            return None
        loss_fn = liger.LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, t: loss_fn(w, h, t)  # Liger takes the weight first
    if name == "cce":
        cce = try_import("cut_cross_entropy")
        return None if cce is None else (lambda h, w, t: cce.linear_cross_entropy(h, w, t))
    raise ValueError(name)


def make_inputs(n, h, v, dtype, ignore_fraction, device):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), device=device, generator=gen)
    target[torch.rand(n, device=device, generator=gen) < ignore_fraction] = -100
    return hidden, weight, target


def gemm_floor_ms(hidden, weight, args) -> float:
    """The three full-size GEMMs every implementation performs, with preallocated outputs."""
    h, w = hidden.detach(), weight.detach()
    logits = h.new_empty(h.shape[0], w.shape[0])
    dh, dw = torch.empty_like(h), torch.empty_like(w)

    def gemms():
        torch.mm(h, w.t(), out=logits)
        torch.mm(logits, w, out=dh)
        torch.mm(logits.t(), h, out=dw)

    ms = time_ms(gemms, args.warmup, args.rep)
    del logits, dh, dw
    return ms


def fp32_reference(hidden, weight, target):
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), target)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def bench_shape(args, n, h, v, device) -> list[Measurement]:
    dtype = DTYPES[args.dtype]
    hidden, weight, target = make_inputs(n, h, v, dtype, args.ignore_fraction, device)
    shape = f"{n}x{h}->{v} {args.dtype}"
    output_mib = (hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()) / 2**20
    floor = None if args.smoke else gemm_floor_ms(hidden, weight, args)
    ref = None if args.no_check else fp32_reference(hidden, weight, target)
    rows = []
    for name in args.impls.split(","):
        m = Measurement("fused_linear_cross_entropy", shape, name, floor_ms=floor)
        loss_fn = None if (args.smoke and name == "compile") else make_loss_fn(name, args.chunk_size)
        if loss_fn is None:
            m.note = "n/a (not installed)" if name != "compile" else "n/a (smoke)"
            rows.append(m)
            continue
        run = fwd_bwd(lambda f=loss_fn: f(hidden, weight, target), [hidden, weight])
        try:
            run()  # compile / warm up / allocate workspaces
            if ref is not None:
                got = _loss_and_grads(loss_fn, hidden, weight, target)
                diffs = [float((a - b).abs().max()) for a, b in zip(got, ref)]
                m.extra = dict(loss_diff=diffs[0], grad_hidden_diff=diffs[1], grad_weight_diff=diffs[2])
                m.max_abs_err = max(diffs)
            if not args.smoke:
                # Drop the last step's grads first: they are the outputs subtracted below, and
                # counting them in the "before" baseline too would subtract them twice.
                hidden.grad = weight.grad = None
                m.extra_mib = peak_extra_mib(run) - output_mib
                m.ms = time_ms(run, args.warmup, args.rep)
        except Exception as exc:  # noqa: BLE001 - report a failing baseline, keep benchmarking the rest
            m.note = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        hidden.grad = weight.grad = None
        if device == "cuda":
            torch.cuda.empty_cache()
        rows.append(m)
    return rows


def _loss_and_grads(loss_fn, hidden, weight, target):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, target)
    loss.backward()
    return loss.detach().float(), hidden.grad.float(), weight.grad.float()


def diffs_table(rows: list[Measurement]) -> str:
    lines = ["| shape | impl | max abs diff: loss | grad_hidden | grad_weight |", "|---|---|---|---|---|"]
    for r in rows:
        d = r.extra or {}
        cells = [f"{d[k]:.2e}" if k in d else "-" for k in ("loss_diff", "grad_hidden_diff", "grad_weight_diff")]
        lines.append(f"| {r.shape} | {r.impl} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    env = environment()
    print({k: val for k, val in env.items() if val is not None}, flush=True)
    if args.smoke:
        shapes = [SMOKE_SHAPE]
    else:
        shapes = [(args.tokens, args.hidden, args.vocab)]
        if args.sweep:
            shapes += [(args.tokens, args.hidden, v) for v in SWEEP_VOCABS if v != args.vocab]
    rows: list[Measurement] = []
    for n, h, v in shapes:
        shape_rows = bench_shape(args, n, h, v, device)
        rows += shape_rows
        print(format_table(shape_rows) + "\n\n" + diffs_table(shape_rows) + "\n", flush=True)
    if len(shapes) > 1:
        print("## all results\n" + format_table(rows) + "\n\n" + diffs_table(rows))
    return finish(rows, env, args.json)


if __name__ == "__main__":
    sys.exit(main())
