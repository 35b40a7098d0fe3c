"""Where the platform engine's training step goes on a GPU, against the plain bf16 loop (issue 21: MFU).

    python benchmarks/profile_engine.py [--steps 24] [--active 3] [engine flags, e.g. --compile]

Runs `python -m fuseforge_flyte.training`'s engine in this process (Llama-1B, 4 x 2048, bf16, kernels, synthetic
data, plan off unless given) under torch.profiler for `--active` optimizer steps after the others, then prints the
GPU time per step by kernel (top rows) and by phase: forward+backward, the optimizer's fp32 step, the master
weights' gradient casts and refresh, the gradient norm. Every number comes from the profiler's kernel times.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.join(HERE, "..", "kernels"), os.path.join(HERE, "..", "workflows")):
    sys.path.insert(0, os.path.abspath(path))

# kernel-name fragments -> phase (first match wins; the rest is forward+backward)
PHASES = (
    ("optimizer (fused AdamW)", ("FusedAdam", "fused_adam", "master_adamw")),
    ("gradient norm (clipping)", ("LpNorm", "lpnorm")),
    ("dtype casts and copies (master weights' fp32 gradients and bf16 refresh; any other copy)",
     ("direct_copy", "copy_kernel")),
)


def phase_of(name: str) -> str:
    low = name.lower()
    for phase, fragments in PHASES:
        if any(f.lower() in low for f in fragments):
            return phase
    return "forward + backward (model, loss)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--active", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    args, engine_flags = p.parse_known_args()

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from fuseforge_flyte.training import cli, strategies
    from fuseforge_flyte.training.engine import train
    from fuseforge_flyte.training.spec import TrainSpec

    flags = ["--model", "llama-1b", "--dataset", "bench:synthetic", "--steps", str(args.steps), "--batch-size", "4",
             "--seq-len", "2048", "--dtype", "bf16", "--kernels", "--plan", "off", *engine_flags]
    values = vars(cli.build_parser().parse_args(flags))
    values.pop("output"), values.pop("log_level")
    spec = TrainSpec(**values)
    wait = args.steps - args.active - 2
    prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU],
                   schedule=schedule(wait=wait, warmup=2, active=args.active))
    original = strategies.DDPStrategy.optimizer_step

    def stepping(self):
        original(self)
        prof.step()

    strategies.DDPStrategy.optimizer_step = stepping
    with prof:
        metrics = train(spec)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    # the kernels themselves (CPU-side ops also carry their kernels' device time: they would count twice)
    # (annotations such as ProfilerStep* and Optimizer.step#... are also "CUDA" rows: left out)
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
               and not e.key.startswith(("ProfilerStep", "Optimizer."))]
    per_step = lambda us: us / 1e3 / args.active  # noqa: E731
    by_phase: dict = defaultdict(float)
    for e in kernels:
        by_phase[phase_of(e.key)] += e.self_device_time_total
    busy = sum(by_phase.values())
    print(f"engine: {metrics.tokens_per_s:,.0f} tokens/s, MFU {100 * metrics.mfu:.1f}%, "
          f"step p50 {metrics.step_time_p50_s * 1e3:.1f} ms; GPU busy {per_step(busy):.1f} ms per profiled step")
    print("| phase | GPU ms per step | share |\n|---|---|---|")
    for phase, us in sorted(by_phase.items(), key=lambda kv: -kv[1]):
        print(f"| {phase} | {per_step(us):.2f} | {100 * us / busy:.1f}% |")
    print("\n| kernel | GPU ms per step | calls per step | phase |\n|---|---|---|---|")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.rows]:
        print(f"| {e.key[:90]} | {per_step(e.self_device_time_total):.3f} | {e.count / args.active:.0f} | "
              f"{phase_of(e.key)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
