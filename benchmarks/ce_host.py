"""Where the host time of a cross-entropy step goes, per way of calling it (GPU only).

    python benchmarks/ce_host.py [--shape 8192,32000 ...]

For each shape and each variant (fuseforge with a fresh gradient buffer for a leaf, fuseforge
writing the gradient over activation logits, torch.compile), prints do_bench, CUDA-graph
time, host time per step (launches queued behind a sleep kernel, so the GPU never waits on
them) and torch.profiler's top host-side ops and CUDA runtime calls, which name any
allocation or synchronisation that the graph replay hides.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
from common import cuda_graph_ms, fwd_bwd, time_ms  # noqa: E402
from tune import host_ms, python_profile  # noqa: E402


def host_profile(fn, steps: int = 10, top: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def launch_costs() -> None:
    """Host microseconds per launch: a small Triton kernel against a small aten op."""
    from fuseforge.ops.targets import _BLOCK, _scan_targets_kernel

    t = torch.randint(0, 100, (8192,), device="cuda")
    inv = torch.empty(1, device="cuda")
    found = torch.empty(2, dtype=torch.int64, device="cuda")

    def triton_launch():
        _scan_targets_kernel[(1,)](t, t.numel(), 100, -100, inv, found, BLOCK=_BLOCK, num_warps=8)

    def aten_op():
        inv.mul_(1.0)

    for name, fn in [("triton kernel (7 args)", triton_launch), ("aten mul_", aten_op)]:
        fn()
        print(f"host per launch, {name}: {host_ms(fn, steps=200) * 1e3:.1f} us")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", action="append", help="tokens,vocab (repeat); default 8192,32000")
    p.add_argument("--variants", default="fuseforge,fuseforge_inplace,compile")
    args = p.parse_args()
    launch_costs()
    shapes = [tuple(int(n) for n in s.split(",")) for s in (args.shape or ["8192,32000"])]
    for n, v in shapes:
        torch.manual_seed(0)
        case = run.case_cross_entropy(n, v, torch.bfloat16, "cuda")
        for name in args.variants.split(","):
            fn = fwd_bwd(case.impls[name], case.leaves)
            for _ in range(5):
                fn()
            ms = time_ms(fn)
            graph = cuda_graph_ms(fn)
            host = host_ms(fn)
            print(f"\n### cross_entropy {n}x{v} {name}: do_bench {ms:.3f} ms, graph {graph:.3f} ms, host {host:.3f} ms/step")
            print(host_profile(fn), flush=True)
            if name.startswith("fuseforge"):
                print(python_profile(fn, top=30), flush=True)
            for t in case.leaves:
                t.grad = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
