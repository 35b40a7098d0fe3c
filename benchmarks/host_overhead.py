"""Where each headline op's host time goes, fuseforge against Liger-Kernel (GPU only).

    python benchmarks/host_overhead.py [--op rms_norm ...] [--profile]

Per op at its headline shape (run.py's OPS), forward+backward in bf16: do_bench as launched, the
CUDA-graph replay (GPU time), the host time per step with the launches queued behind a sleep kernel
(so the GPU never waits on them), and the number of kernels one step launches. --profile adds
cProfile's top Python functions for each implementation. The implementations alternate over --rounds rounds
(the host's speed drifts on a shared VM) and the medians are reported. Issue 21 asks that, as launched, every headline op
take at most Liger's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
from common import cuda_graph_ms, environment, fwd_bwd, time_ms  # noqa: E402
from tune import host_ms, python_profile  # noqa: E402


def kernels_per_step(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--op", action="append", help="default: every headline op but jsd")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds per op (median kept)")
    p.add_argument("--json")
    args = p.parse_args()
    ops = args.op or [op for op in run.OPS if op != "jsd"]
    rows = []
    for op in ops:
        build, shape, _ = run.OPS[op]
        torch.manual_seed(0)
        case = build(*shape, torch.bfloat16, "cuda")
        impls = [name for name in ("fuseforge", "liger") if name in case.impls]
        fns = {name: fwd_bwd(case.impls[name], case.leaves) for name in impls}
        for fn in fns.values():
            for _ in range(5):
                fn()
        # the host's speed drifts on a shared VM: alternate the implementations, keep the median of the rounds
        ms = {name: [] for name in impls}
        host = {name: [] for name in impls}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                ms[name].append(time_ms(fn))
                host[name].append(host_ms(fn, steps=50))
                for t in case.leaves:
                    t.grad = None
        for name, fn in fns.items():
            row = {"op": op, "shape": case.shape, "impl": name, "ms": statistics.median(ms[name]),
                   "host_ms": statistics.median(host[name]), "ms_rounds": ms[name], "launches": kernels_per_step(fn)}
            try:
                row["graph_ms"] = cuda_graph_ms(fn)
            except Exception as exc:  # noqa: BLE001 - an op that syncs cannot be captured
                row["graph_ms"] = None
                row["note"] = f"no CUDA graph: {type(exc).__name__}"
                torch.cuda.synchronize()
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.profile:
                print(f"--- {name} {op}: Python profile", flush=True)
                print(python_profile(fn, steps=50, top=25), flush=True)
            for t in case.leaves:
                t.grad = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
