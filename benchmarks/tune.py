"""Launch-constant sweep for the per-op kernels, in one process on the GPU.

    python benchmarks/tune.py [--op rms_norm ...] [--shape 2048,16384 --shape 4096,1024] [--profile]

For each op at its headline shape in benchmarks/run.py (or each --shape), every combination
of the module constants below is patched in, compiled, checked (outputs and every leaf
gradient against eager) and timed forward+backward (summed kernel time, and median do_bench
like run.py).
`--profile` also prints each kernel's device time per step and the host time per
step (queued behind a long sleep kernel, so it is pure launch/Python cost) and a cProfile
of it. Where the host time exceeds the kernels' (small ops on a VM with ~50 us launches),
do_bench measures the host and the kernel table is the number to tune against.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
from common import fwd_bwd, time_ms  # noqa: E402

from fuseforge.ops import glu, rope  # noqa: E402
from fuseforge.ops._shared import rowwise  # noqa: E402

ROWWISE = {  # (rows narrower than rowwise.GPU_WIDE_ROW, wider rows)
    "GPU_ELEMENTS_PER_THREAD": [(8, 8), (16, 16), (32, 32), (32, 16)],
    "GPU_BWD_PROGRAMS_PER_SM": [(1, 1), (2, 2), (4, 4), (2, 1)],
}
# The split backward of wide rows: which widths take it (1 << 30: none) and its column kernel.
SPLIT = {
    "SPLIT_BACKWARD_MIN_COLS": [1, 1 << 30],
    "GPU_PARAM_GRAD_TILE": [(16, 256), (32, 128), (8, 512)],
    "GPU_PARAM_GRAD_WARPS": [4, 8],
    "GPU_PARAM_GRAD_PROGRAMS_PER_SM": [4, 8],
}
# op -> (module, {constant: values}): every combination is timed.
GRIDS = {
    "rms_norm": (rowwise, ROWWISE),
    "fused_add_rms_norm": (rowwise, ROWWISE),
    "layer_norm": (rowwise, ROWWISE),
    "rms_norm_split": (rowwise, SPLIT),
    "fused_add_rms_norm_split": (rowwise, SPLIT),
    "layer_norm_split": (rowwise, SPLIT),
    "swiglu": (glu, {"_GPU_TILE": [2048, 4096, 8192], "_GPU_ELEMENTS_PER_THREAD": [8, 16, 32]}),
    "geglu": (glu, {"_GPU_TILE": [2048, 4096, 8192], "_GPU_ELEMENTS_PER_THREAD": [8, 16, 32]}),
    "rope": (rope, {"_GPU_TILE": [1024, 2048, 4096, 8192], "_GPU_ELEMENTS_PER_THREAD": [4, 8, 16, 32]}),
}


def kernel_events(fn, steps: int = 5):
    """torch.profiler's per-kernel averages over `steps` runs of `fn` (after one warm-up run)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def kernel_ms(fn, steps: int = 10) -> float:
    """GPU time of one step: the device time of every kernel it launches, summed.

    What tuning is about: on this VM each launch costs ~50 us of host time, which hides small
    kernels from do_bench.
    """
    return sum(getattr(e, "self_device_time_total", 0) for e in kernel_events(fn, steps)) / 1e3 / steps


def grads_of(case, impl):
    """The outputs of one forward+backward and every leaf's gradient (fp32 copies)."""
    fn = fwd_bwd(case.impls[impl], case.leaves)
    outs = fn()
    torch.cuda.synchronize()
    return [o.detach().float().clone() for o in outs] + [t.grad.float().clone() for t in case.leaves if t.grad is not None]


def rel_err(got, ref):
    return max(float((g - r).abs().max()) / max(float(r.abs().max()), 1e-6) for g, r in zip(got, ref))


def host_ms(fn, steps=10):
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: every launch below waits in the queue
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / steps * 1e3


def python_profile(fn, steps: int = 20, top: int = 10) -> str:
    """Where the host time of a step goes (Python functions, launches included), by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def profile(fn, steps=5):
    events = kernel_events(fn, steps)
    rows = []
    for e in events:
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / steps, e.count // steps, e.key[:70]))
    return sorted(rows, reverse=True)[:8]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--op", action="append", choices=sorted(GRIDS))
    p.add_argument("--profile", action="store_true")
    p.add_argument("--shape", action="append", help="comma-separated shape instead of each op's headline one, "
                   "e.g. 2048,16384 (repeat for several)")
    args = p.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    summary = []
    jobs = []
    for op in args.op or list(GRIDS):
        builder, shape, _ = run.OPS[op.removesuffix("_split")]
        shapes = [tuple(int(n) for n in text.split(",")) for text in args.shape] if args.shape else [shape]
        jobs += [(op, builder, shape) for shape in shapes]
    for op, builder, shape in jobs:
        torch.manual_seed(0)
        case = builder(*shape, torch.bfloat16, "cuda")
        ref = grads_of(case, "eager")
        module, grid = GRIDS[op]
        defaults = {n: getattr(module, n) for n in grid}
        fn = fwd_bwd(case.impls["fuseforge"], case.leaves)
        if args.profile:
            for _ in range(5):
                fn()
            print(f"\n### {op} {case.shape}: host {host_ms(fn):.3f} ms/step; kernels (us/step, calls/step):")
            for us, calls, name in profile(fn):
                print(f"  {us:9.1f} {calls:3d}  {name}")
            print(python_profile(fn))
        results = []
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid, values))
            for n, v in setting.items():
                setattr(module, n, v)
            try:
                err = rel_err(grads_of(case, "fuseforge"), ref)
                ms = kernel_ms(fn)
                wall = time_ms(fn)
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is just skipped
                print(f"{op} {setting} failed: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            results.append((ms, err, setting))
            print(f"{op} {setting} kernels {ms:.3f} ms (do_bench {wall:.3f} ms) output/grad rel err {err:.1e}", flush=True)
        for n, v in defaults.items():
            setattr(module, n, v)
        results.sort(key=lambda r: r[0])
        default_ms = next((r[0] for r in results if r[2] == defaults), float("nan"))
        if results:
            summary.append((op, case.shape, default_ms, results[0][0], results[0][1], results[0][2]))
        del case, ref
        torch.cuda.empty_cache()
    print("\n(ms: summed kernel device time per forward+backward, torch.profiler)\n| op | shape | default ms | best ms | output/grad rel err | best setting |\n|---|---|---|---|---|---|")
    for op, shape, d, b, e, s in summary:
        print(f"| {op} | {shape} | {d:.3f} | {b:.3f} | {e:.1e} | {s} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
