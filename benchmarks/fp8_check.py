"""FP8 vs bf16 in the training engine on one GPU: the same run twice, losses and tokens/s as JSON lines.

    python benchmarks/fp8_check.py                       # llama-1b shape, 200 steps each, compiled layers
    python benchmarks/fp8_check.py --steps 50 --no-compile --variants bf16,fp8
    python benchmarks/fp8_check.py --smoke               # CPU check of the script (tiny model, fp8 left out)

Each variant runs `python -m fuseforge_flyte.training` in its own process (fresh GPU memory and
compile caches) with the same seed, data order and settings; only `--fp8` differs. The goal: the FP8
run's loss within 1 % of bf16's (mean of the last 20 steps, the noise of a single step averaged out;
the eval loss too when the data has an eval split) and more tokens/s. torch.compile is on by default
for both, since torchao's float8 casts are only fast fused (eager FP8 is usually slower than bf16).

Data: a prepared directory given by --data, else .gpu/chat2048 when present (chat text, tiny-bpe,
2048-token packed rows), else the shipped builtin:chat prepared on the fly. The last line is a
summary: {"summary": ..., "loss_rel_diff": ..., "within_1pct": ..., "speedup": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO, ".gpu", "chat2048")
TAIL = 20  # steps averaged for the loss comparison


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--data", default="", help="prepared data dir or dataset; default .gpu/chat2048 or builtin:chat")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--variants", default="bf16,fp8", help="comma-separated: bf16, fp8")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the script itself (no fp8)")
    return parser.parse_args(argv)


def variant_command(args, variant: str, output: str) -> list:
    data = args.data or (DEFAULT_DATA if os.path.isdir(DEFAULT_DATA) else "builtin:chat")
    cmd = [sys.executable, "-m", "fuseforge_flyte.training", "--model", args.model, "--dataset", data,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps), "--dtype", "bf16",
           "--log-every", "20", "--checkpoint-dir", "off", "--output", output,
           "--kernels" if args.kernels else "--no-kernels", "--compile" if args.compile else "--no-compile",
           "--fp8" if variant == "fp8" else "--no-fp8"]
    return cmd


def run_variant(args, variant: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "metrics.json")
        start = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(REPO, "kernels"), os.path.join(REPO, "workflows"), os.environ.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run(variant_command(args, variant, output), env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "error": f"timed out after {args.timeout} s"}
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not os.path.exists(output):
            return {"variant": variant, "error": f"rc={proc.returncode}", "log_tail": proc.stderr[-3000:]}
        with open(output, encoding="utf-8") as handle:
            m = json.load(handle)
    curve = [x for x in m["loss_curve"] if x == x]
    tail = curve[-TAIL:]
    return {"variant": variant, "fp8": variant == "fp8", "compile": args.compile, "kernels": args.kernels,
            "steps": m["steps"], "final_loss": m["final_loss"], f"mean_loss_last{TAIL}": sum(tail) / len(tail),
            "eval_loss": m["eval_loss"], "tokens_per_s": m["tokens_per_s"], "mfu": m["mfu"],
            "peak_memory_gib": m["peak_memory_gib"], "step_time_p50_s": m["step_time_p50_s"],
            "fp8_linears": m.get("fp8_linears", 0), "device": m["device"], "wall_s": round(wall, 1),
            "loss_at": {str(s): curve[s - 1] for s in (1, 50, 100, 150, 200) if s <= len(curve)}}


def summary(rows: dict) -> dict:
    base, low = rows.get("bf16"), rows.get("fp8")
    if not base or not low or "error" in base or "error" in low:
        return {"summary": "incomplete", "errors": {k: v.get("error") for k, v in rows.items() if "error" in v}}
    key = f"mean_loss_last{TAIL}"
    rel = (low[key] - base[key]) / base[key]
    out = {"summary": "fp8 vs bf16", "loss_rel_diff": rel, "within_1pct": abs(rel) < 0.01,
           "speedup": low["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None}
    if base["eval_loss"] is not None and low["eval_loss"] is not None:
        out["eval_loss_rel_diff"] = (low["eval_loss"] - base["eval_loss"]) / base["eval_loss"]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - {"bf16", "fp8"}
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; use bf16 and/or fp8")
    if args.smoke:  # the script's own plumbing on the CPU: a tiny model, a few steps, no FP8 (CPU refuses it)
        args.model, args.steps, args.batch_size, args.seq_len, args.compile = "tiny-llama", 3, 2, 64, False
        args.kernels, args.data, variants = False, args.data or "builtin:chat", ["bf16"]
    rows = {}
    for variant in variants:
        rows[variant] = run_variant(args, variant)
        print(json.dumps(rows[variant]), flush=True)
    print(json.dumps(summary(rows)), flush=True)
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
