"""The batch-layout planner on Llama-3-8B (one GPU): what it probes and picks for HF eager, Liger and fuseforge.

    python benchmarks/plan_llama8b.py                          # all three, 16 x 4096 tokens per optimizer step
    python benchmarks/plan_llama8b.py --variants fuseforge --json out.json
    python benchmarks/plan_llama8b.py --variants fuseforge+fp8   # torchao float8 linears, compiled layers
    python benchmarks/plan_llama8b.py --variants fuseforge-loss+compile-layers   # compile fuses the rest

For each variant (own subprocess, clean allocator): the 8B shape from bench_model.py (random bf16 weights,
SDPA, fused AdamW whose bf16 moments are set aside from the budget), then training/planner.py's search over
micro-batch x grad_accum (same 16 sequences per step), activation checkpointing (none / every 2nd layer /
all) and, with fuseforge, the fused-loss chunk; then `--verify-steps` real optimizer steps with the chosen
layout to check its peak (optimizer state included) against the device. Prints JSON lines: one per probe
(`"kind": "probe"`), the choice (`"kind": "plan"`) and the check (`"kind": "verify"`).
Budget: about 2.5 minutes per variant on an H200 (--probe-seconds bounds the probing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, os.path.join(ROOT, "kernels"), os.path.join(ROOT, "workflows")):
    if path not in sys.path:
        sys.path.insert(0, path)

VARIANTS = ("eager", "liger", "fuseforge", "fuseforge+fp8")


def emit(record: dict) -> None:
    print("JSON " + json.dumps(record), flush=True)


def worker(args) -> None:
    import torch
    from types import SimpleNamespace

    import bench_model
    from fuseforge_flyte.training import planner

    device = torch.device("cuda")
    model = bench_model.build_model("llama3-8b", "llama").train()
    model = bench_model.apply_variant(model, args.variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    vocab = model.config.vocab_size
    generator = torch.Generator(device="cuda").manual_seed(1)
    pool = torch.randint(0, vocab, (args.global_batch, args.seq), device=device, generator=generator)

    def batches(micro_batch: int, count: int):
        return [{"input_ids": pool[(i * micro_batch) % args.global_batch:][:micro_batch],
                 "labels": pool[(i * micro_batch) % args.global_batch:][:micro_batch]} for i in range(count)]

    meter = planner.CudaMeter(device)
    optimizer_bytes = planner.optimizer_state_bytes(SimpleNamespace(optimizer=optimizer))
    budget = planner.memory_budget(meter.capacity(), optimizer_bytes, meter.total())
    runner = planner.ProbeRunner(model, forward=lambda batch, sync: model(**batch).loss,
                                 backward=lambda loss: loss.backward(),
                                 zero_grad=lambda: optimizer.zero_grad(set_to_none=True), batches=batches,
                                 seq_len=args.seq, meter=meter)
    chunks = planner.LOSS_CHUNK_CHOICES if runner.fused_loss else (0,)
    probes = planner.search(args.global_batch, runner, budget, checkpoint_choices=planner.checkpoint_choices(model),
                            chunk_sizes=chunks, start_micro_batch=args.start_micro_batch,
                            time_left=lambda done: runner.seconds < args.probe_seconds)
    for p in probes:
        emit({"kind": "probe", "variant": args.variant, **p.candidate.__dict__, "oom": p.oom,
              "peak_gib": round(p.peak_bytes / 2**30, 2), "tokens_per_s": round(p.tokens_per_s),
              "fits": p.fits(budget)})
    try:
        choice = planner.choose(probes, budget, args.global_batch, 1)
    except planner.PlanError as err:
        emit({"kind": "plan", "variant": args.variant, "error": str(err)})
        return
    best = next(p for p in probes if p.candidate == choice)
    emit({"kind": "plan", "variant": args.variant, **choice.__dict__, "tokens_per_s": round(best.tokens_per_s),
          "peak_gib": round(best.peak_bytes / 2**30, 2), "budget_gib": round(budget / 2**30, 2),
          "optimizer_gib": round(optimizer_bytes / 2**30, 2), "probes": len(probes),
          "probe_seconds": round(runner.seconds, 1)})
    if args.verify_steps < 1:
        return
    runner.apply(choice)
    meter.clear()
    times = []
    for step in range(args.verify_steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in batches(choice.micro_batch, choice.grad_accum):
            (model(**batch).loss / choice.grad_accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    steady = times[1:] or times
    emit({"kind": "verify", "variant": args.variant, "steps": args.verify_steps,
          "peak_gib_with_optimizer": round(meter.peak() / 2**30, 2),
          "device_gib": round(meter.total() / 2**30, 2),
          "tokens_per_s": round(args.global_batch * args.seq / (sum(steady) / len(steady)))})


def main(argv=None) -> int:
    import bench_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=bench_model.variant_arg,
                   help=f"default {VARIANTS}; any bench_model.py variant, e.g. fuseforge-loss+compile-layers")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--start-micro-batch", type=int, default=2)
    p.add_argument("--probe-seconds", type=float, default=75.0, help="stop probing after this (once one fits)")
    p.add_argument("--verify-steps", type=int, default=2)
    p.add_argument("--timeout", type=int, default=170, help="seconds per variant")
    p.add_argument("--json", help="also write every record here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    records = []
    for variant in args.variants:
        if variant == "liger":
            import importlib.util

            if importlib.util.find_spec("liger_kernel") is None:
                records.append({"kind": "plan", "variant": variant, "error": "liger_kernel is not installed"})
                print(json.dumps(records[-1]), flush=True)
                continue
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant,
               "--global-batch", str(args.global_batch), "--seq", str(args.seq),
               "--start-micro-batch", str(args.start_micro_batch), "--probe-seconds", str(args.probe_seconds),
               "--verify-steps", str(args.verify_steps)]
        paths = [os.path.join(ROOT, "kernels"), os.path.join(ROOT, "workflows"), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        began = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out, err, rc = exc.stdout or "", exc.stderr or "", "timeout"
            out = out.decode() if isinstance(out, bytes) else out
            err = err.decode() if isinstance(err, bytes) else err
        for line in out.splitlines():
            if line.startswith("JSON "):
                record = json.loads(line[5:])
                records.append(record)
                print(json.dumps(record), flush=True)
        if rc != 0:
            tail = " / ".join(err.strip().splitlines()[-3:])[-400:]
            record = {"kind": "error", "variant": variant, "returncode": rc, "stderr": tail}
            records.append(record)
            print(json.dumps(record), flush=True)
        print(json.dumps({"kind": "variant_seconds", "variant": variant,
                          "seconds": round(time.perf_counter() - began, 1)}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
