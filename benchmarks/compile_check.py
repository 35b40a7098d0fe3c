"""torch.compile with fuseforge's kernels on the GPU: graph breaks, compile time and step time, as one JSON line.

    python benchmarks/compile_check.py                       # 4-layer Llama-1B shape, bf16, 4 x 2048
    python benchmarks/compile_check.py --batch 2 --seq 1024 --steps 5

For a fuseforge-patched model: the graph breaks `torch._dynamo.explain` finds in one training forward
(with labels, so the fused loss head is in the graph), then bench_model.py's training step (forward +
backward + fused AdamW, bf16, SDPA; each variant in its own process) for eager-patched ("fuseforge"),
compiled-patched ("fuseforge+compile") and compiled-unpatched ("compile"): the first step's time
(compilation included for the compiled ones) and the median step time after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_model  # noqa: E402

VARIANTS = ("fuseforge", "fuseforge+compile", "compile")


def explain(preset: str, family: str, batch: int, seq: int) -> dict:
    """Graph breaks and graphs of one patched training forward, and how long dynamo took to find them."""
    import torch

    from fuseforge.transformers import apply_kernels

    model = bench_model.build_model(preset, family)
    apply_kernels(model)
    model.train()
    vocab = bench_model.PRESETS[preset]["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    t0 = time.perf_counter()
    result = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    seconds = time.perf_counter() - t0
    reasons = [f"{r.reason.splitlines()[0][:200]} @ {r.user_stack[-1].filename}:{r.user_stack[-1].lineno}"
               if r.user_stack else r.reason.splitlines()[0][:200] for r in result.break_reasons]
    fused_ops = sorted({op for g in result.graphs for op in ("rms_norm", "rope", "glu", "fused_linear_cross_entropy")
                        if f"torch.ops.fuseforge.{op}" in g.code})
    return {"graph_breaks": result.graph_break_count, "graphs": result.graph_count, "explain_s": round(seconds, 1),
            "break_reasons": reasons[:25], "fused_ops_in_graph": fused_ops}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b-4l", choices=sorted(bench_model.PRESETS))
    p.add_argument("--family", default="llama", choices=["llama", "qwen2"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant's process")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=bench_model.VARIANTS)
    p.add_argument("--skip-explain", action="store_true")
    args = p.parse_args(argv)

    out = {"preset": args.preset, "family": args.family, "batch": args.batch, "seq": args.seq}
    if not args.skip_explain:
        out["explain"] = explain(args.preset, args.family, args.batch, args.seq)
    # bench_model.run_variant's worker arguments (same step, same timing)
    worker_args = argparse.Namespace(preset=args.preset, family=args.family, batch=args.batch, seq=args.seq,
                                     steps=args.steps, warmup=args.warmup, grad_ckpt=False, profile=False,
                                     timeout=args.timeout)
    out["variants"] = {}
    for variant in args.variants:
        r = bench_model.run_variant(worker_args, variant)
        out["variants"][variant] = r if "error" in r else {
            "first_step_s": round(r["first_step_s"], 2), "step_ms": round(r["step_ms"], 2),
            "tokens_per_s": round(r["tokens_per_s"]), "peak_gib": round(r["peak_gib"], 2),
            "first_loss": round(r["first_loss"], 4), "last_loss": round(r["last_loss"], 4),
        }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
