"""The platform engine on several GPUs of one host (issue 23): scaling, the fused loss under sharding, restarts.

    python benchmarks/bench_scaling.py --gpus 2 --json scaling.json                    # every part
    python benchmarks/bench_scaling.py --gpus 2 --parts scaling --strategies ddp fsdp  # one part, two strategies
    python benchmarks/bench_scaling.py --cpu --gpus 2 --model tiny-llama --steps 4     # the same on gloo (a dry run)

Parts:
- scaling: per strategy (ddp, fsdp = FSDP2, zero1/zero2/zero3 = DeepSpeed), the kernels off and on, one global batch
  (--batch sequences per GPU x N GPUs) trained on 1 GPU (grad_accum N) and on N GPUs: tokens/s per GPU, peak memory
  per GPU, scaling efficiency = tokens/s on N / (N x tokens/s on 1), and the largest difference of the loss curves.
- lm-head: under fsdp and zero3, one step's lm_head gradient through the fused loss against the unfused loss's
  (fp32, gathered whole), and how often the fused loss ran (a fallback would leave it at 0).
- elastic: rank 1 is SIGKILLed after --kill-after steps; torch elastic restarts the group, which resumes from the
  newest checkpoint: restarts, the step resumed from, steps redone and the loss curve against an unkilled run.
Every run goes through run_local (torch elastic: the launcher of torchrun and of Flyte's Elastic tasks), each
configuration in fresh worker processes. NVLink multicast stays off (the device notes say why).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Dict, List, Optional

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment  # noqa: E402

STRATEGIES = {
    "ddp": dict(strategy="ddp"),
    "fsdp": dict(strategy="fsdp"),
    "zero1": dict(strategy="deepspeed", zero_stage=1),
    "zero2": dict(strategy="deepspeed", zero_stage=2),
    "zero3": dict(strategy="deepspeed", zero_stage=3),
}
PARTS = ("scaling", "lm-head", "elastic")


def _spec(args, **overrides):
    from fuseforge_flyte.training.spec import TrainSpec

    base = dict(model=args.model, dataset=args.dataset, steps=args.steps, batch_size=args.batch, seq_len=args.seq,
                dtype="fp32" if args.cpu else "bf16", plan="off", checkpoint_dir="off", seed=0, lr=args.lr,
                log_every=max(1, args.steps // 5))
    base.update(overrides)
    return TrainSpec(**base)


def _run(spec, nproc: int, args, max_restarts: int = 0):
    """Rank 0's metrics of `spec` trained on `nproc` fresh workers."""
    from fuseforge_flyte.training.local import run_local

    results = run_local(spec, nproc, max_restarts=max_restarts, start_method="spawn",
                        threads_per_worker=1 if args.cpu else None)
    return results[0]


def _max_difference(a: List[float], b: List[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))


def scaling(args) -> List[Dict]:
    """One global batch on 1 and on N GPUs, per strategy, the kernels off and on."""
    rows = []
    for name in args.strategies:
        for kernels in (False, True):
            many = _run(_spec(args, kernels=kernels, **STRATEGIES[name]), args.gpus, args)
            row = dict(part="scaling", strategy=name, kernels=kernels, gpus=args.gpus,
                       tokens_per_step=many.tokens_per_step, tokens_per_s_n=many.tokens_per_s,
                       tokens_per_s_per_gpu=many.tokens_per_s / args.gpus, peak_gib_per_gpu=many.peak_memory_gib,
                       step_p50_s_n=many.step_time_p50_s, mfu_n=many.mfu, loss_curve_n=many.loss_curve,
                       kernels_patched=list(many.kernels_patched))
            try:  # the same global batch on one GPU (a model that needs sharding may not fit there)
                one = _run(_spec(args, kernels=kernels, grad_accum=args.gpus, **STRATEGIES[name]), 1, args)
            except Exception as exc:  # noqa: BLE001 - recorded in the row; the N-GPU numbers stand
                row["single_gpu_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            else:
                row.update(tokens_per_s_1=one.tokens_per_s, peak_gib_1=one.peak_memory_gib,
                           step_p50_s_1=one.step_time_p50_s, loss_curve_1=one.loss_curve,
                           scaling_efficiency=many.tokens_per_s / (args.gpus * one.tokens_per_s),
                           loss_max_difference=_max_difference(one.loss_curve, many.loss_curve))
            print(json.dumps({k: v for k, v in row.items() if "curve" not in k}), flush=True)
            rows.append(row)
    return rows


def _full_lm_head_grad(strategy) -> torch.Tensor:
    """The lm_head weight's whole gradient on the CPU (collective under sharding)."""
    weight = strategy.inner.get_output_embeddings().weight
    if strategy.spec.strategy == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        grad = safe_get_full_grad(weight)
    else:
        grad = weight.grad
        if hasattr(grad, "full_tensor"):  # an FSDP2 shard
            grad = grad.full_tensor()
    return grad.detach().float().cpu()


def _lm_head_worker(spec_fields: Dict, fused: bool, path: str) -> Dict:
    """One step with the fused (or the unfused) loss; rank 0 saves the whole lm_head gradient to `path`.

    One loss per launch: a DeepSpeed engine cannot be built twice in one process (its close destroys the group).
    """
    import fuseforge.transformers.loss as loss_module
    from fuseforge.transformers import apply_kernels
    from fuseforge_flyte.training.distributed import DistContext
    from fuseforge_flyte.training.models import build_model
    from fuseforge_flyte.training.spec import TrainSpec
    from fuseforge_flyte.training.strategies import make_strategy

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # gloo workers share the CPU (and forked ones deadlock in OpenMP otherwise)
    calls = {"fused": 0}
    counted = loss_module.fused_linear_cross_entropy

    def counting(*a, **kw):
        calls["fused"] += 1
        return counted(*a, **kw)

    loss_module.fused_linear_cross_entropy = counting
    spec = TrainSpec(**spec_fields)
    ctx = DistContext.from_env(need_group=True)
    strategy = None
    try:
        model = build_model(spec.model, seed=0, device=ctx.device)
        generator = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own rows, as in training
        ids = torch.randint(0, model.config.vocab_size, (spec.batch_size, spec.seq_len), generator=generator)
        if fused:
            apply_kernels(model)
        strategy = make_strategy(spec, ctx, model, fused_loss=fused)
        loss = strategy.forward({"input_ids": ids.to(ctx.device), "labels": ids.to(ctx.device)}, True)
        strategy.backward(loss)
        grad = _full_lm_head_grad(strategy)
        if ctx.rank == 0:
            torch.save(grad, path)
        return dict(rank=ctx.rank, fused_calls=calls["fused"], loss=float(loss.detach()))
    finally:
        loss_module.fused_linear_cross_entropy = counted
        if strategy is not None:
            strategy.close()
        ctx.close()


def compare_lm_head_gradients(spec, nproc: int, start_method: str = "spawn") -> Dict:
    """One step of `spec` on `nproc` workers with the unfused and with the fused loss (same weights and rows):
    how often the fused loss ran in each, both losses, and how far apart the whole lm_head gradients are."""
    from dataclasses import asdict

    from fuseforge_flyte.training.local import launch_local

    fields = {k: v for k, v in asdict(spec).items() if k != "output_dir"}
    runs, grads = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for fused in (False, True):
            path = os.path.join(root, f"lm_head_grad_{fused}.pt")
            runs[fused] = launch_local(_lm_head_worker, nproc, fields, fused, path, start_method=start_method)[0]
            grads[fused] = torch.load(path, weights_only=True).double()
    reference, got = grads[False], grads[True]
    return dict(fused_calls=runs[True]["fused_calls"], unfused_run_fused_calls=runs[False]["fused_calls"],
                loss_unfused=runs[False]["loss"], loss_fused=runs[True]["loss"],
                max_abs_difference=float((got - reference).abs().max()), max_abs_gradient=float(reference.abs().max()),
                cosine=float(torch.nn.functional.cosine_similarity(got.flatten(), reference.flatten(), dim=0)))


def lm_head(args) -> List[Dict]:
    """Under fsdp and zero3 (whichever --strategies holds): the fused loss's lm_head gradient against the unfused."""
    rows = []
    for name in [s for s in args.strategies if s in ("fsdp", "zero3")]:
        spec = _spec(args, dtype="fp32", batch_size=1, **STRATEGIES[name])  # fp32: a tight comparison
        result = compare_lm_head_gradients(spec, args.gpus)
        row = dict(part="lm-head", strategy=name, gpus=args.gpus, **result,
                   relative_difference=result["max_abs_difference"] / max(result["max_abs_gradient"], 1e-30))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def elastic(args) -> List[Dict]:
    """SIGKILL rank 1 after --kill-after steps: the restarted group resumes from the newest checkpoint."""
    from fuseforge_flyte.training.faults import FAULT_ENV

    name = "fsdp" if "fsdp" in args.strategies else args.strategies[0]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        common = dict(checkpoint_every=args.checkpoint_every, keep_last=2, **STRATEGIES[name])
        unkilled = _run(_spec(args, checkpoint_dir=os.path.join(root, "unkilled"), **common), args.gpus, args)
        os.environ[FAULT_ENV] = f"1:{args.kill_after}"  # the first attempt only; the restarted workers run through
        try:
            killed = _run(_spec(args, checkpoint_dir=os.path.join(root, "killed"), **common), args.gpus, args,
                          max_restarts=1)
        finally:
            del os.environ[FAULT_ENV]
    row = dict(part="elastic", strategy=name, gpus=args.gpus, killed_after_step=args.kill_after,
               checkpoint_every=args.checkpoint_every, restarts=killed.restarts,
               resumed_from_step=killed.resumed_from_step, steps_redone=killed.steps_redone,
               steps=killed.steps, loss_max_difference=_max_difference(killed.loss_curve, unkilled.loss_curve),
               final_loss=killed.final_loss, final_loss_unkilled=unkilled.final_loss)
    print(json.dumps(row), flush=True)
    rows.append(row)
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count(), help="N (default: every visible GPU)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    p.add_argument("--model", default="llama-1b", help="a preset of fuseforge_flyte.model_names")
    p.add_argument("--dataset", default="bench:synthetic")
    p.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--kill-after", type=int, default=12, help="elastic: rank 1 dies after this step")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (kernels through TRITON_INTERPRET=1)")
    p.add_argument("--json")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.gpus < 2:
        raise SystemExit(f"--gpus must be >= 2 (scaling needs several devices), got {args.gpus}")
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} GPU(s) visible (or pass --cpu)")
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if "elastic" in args.parts and not 0 < args.kill_after < args.steps:
        raise SystemExit(f"--kill-after must be between 1 and --steps - 1 = {args.steps - 1}, got {args.kill_after}")
    parts = {"scaling": scaling, "lm-head": lm_head, "elastic": elastic}
    rows = [row for part in args.parts for row in parts[part](args)]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"env": environment(), "args": vars(args), "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
