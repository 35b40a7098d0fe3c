"""Distillation-loss benchmark: fuseforge vs torch eager, torch.compile and Liger-Kernel (forward + backward).

    python benchmarks/bench_distill.py                                  # both ops at the headline shapes
    python benchmarks/bench_distill.py --op fused_linear_jsd --tokens 8192 --student-hidden 2048
    python benchmarks/bench_distill.py --json distill.json
    TRITON_INTERPRET=1 python benchmarks/bench_distill.py --smoke       # CPU check of the script (no timing)

fused_linear_jsd: student and teacher LM heads (hidden 4096 each by default, vocab 128256) on
`--tokens` tokens; the eager reference materialises both [tokens, V] logits, upcasts, takes
log_softmax and the JSD formula in torch; Liger is LigerFusedLinearJSD. `--jsd-rows` sets the
shape of the plain jsd case (log-probs [rows, V], student gradient only).

ms is the median of triton.testing.do_bench over forward+backward. `extra MiB` is the peak of
torch.cuda.max_memory_allocated during one forward+backward above what was allocated before it
(the inputs), MINUS the gradient outputs every implementation must produce (d student hidden +
d student weight, or d student log-probs): it is the working memory each implementation adds.
The raw number is kept as `extra.with_grad_outputs_mib` in the JSON. For fused_linear_jsd the note
gives the achieved TFLOP/s over the 4 vocabulary matmuls (2 forward logits, 2 student gradients).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    H200_COPY_BYTES_PER_S,
    Measurement,
    environment,
    finish,
    format_table,
    measure_copy_bandwidth,
    try_import,
)
from run import Case, bench_case, case_jsd, ref_jsd  # noqa: E402

SMOKE = dict(tokens=12, student_hidden=16, teacher_hidden=24, vocab=300, jsd_rows=6)


def ref_fused_linear_jsd(hs, ws, ht, wt, beta: float, temperature: float):
    """What a user writes without fusion: both full logits, fp32 log-softmax, the JSD formula."""
    s_logp = torch.log_softmax((hs @ ws.t()).float() / temperature, dim=-1)
    t_logp = torch.log_softmax((ht @ wt.t()).float() / temperature, dim=-1)
    return ref_jsd(s_logp, t_logp, beta)


def case_fused_linear_jsd(n, hs_size, ht_size, vocab, beta, temperature, dtype, device):
    from fuseforge.functional import fused_linear_jsd

    def weight(h):
        return (torch.randn(vocab, h, device=device) / h**0.5).to(dtype)

    hs = torch.randn(n, hs_size, device=device).to(dtype).requires_grad_(True)
    ws = weight(hs_size).requires_grad_(True)
    ht, wt = torch.randn(n, ht_size, device=device).to(dtype), weight(ht_size)
    compiled = torch.compile(ref_fused_linear_jsd, dynamic=False)
    impls = {
        "fuseforge": lambda: fused_linear_jsd(hs, ws, ht, wt, beta=beta, temperature=temperature),
        "eager": lambda: ref_fused_linear_jsd(hs, ws, ht, wt, beta, temperature),
        "compile": lambda: compiled(hs, ws, ht, wt, beta, temperature),
    }
    liger = try_import("liger_kernel.transformers")
    if liger is not None and hasattr(liger, "LigerFusedLinearJSD"):
        # positional (beta, ignore_index, temperature): the keyword name changed across Liger versions
        liger_loss = liger.LigerFusedLinearJSD(beta, -100, temperature)
        impls["liger"] = lambda: liger_loss(hs, ws, ht, wt, None)  # shift_labels: required positional in 0.8.5
    # compute-bound: no bytes floor (min_bytes=0); TFLOP/s is added to the note after timing.
    return Case("fused_linear_jsd", f"{n}x{hs_size}/{ht_size}x{vocab}", [hs, ws], impls, 0)


def _liger_jsd_available() -> bool:
    liger = try_import("liger_kernel.transformers.functional")
    return liger is not None and hasattr(liger, "liger_jsd")


def finish_rows(rows: list[Measurement], case: Case, flops: float | None) -> list[Measurement]:
    """Subtract the unavoidable gradient outputs from the peak memory; add TFLOP/s where meaningful."""
    grad_mib = sum(t.numel() * t.element_size() for t in case.leaves) / 2**20
    for m in rows:
        if m.extra_mib is not None:
            m.extra["with_grad_outputs_mib"] = round(m.extra_mib, 1)
            m.extra_mib -= grad_mib
        if flops and m.ms:
            m.note = (m.note + " " if m.note else "") + f"{flops / (m.ms * 1e-3) / 1e12:.0f} TFLOP/s"
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", action="append", choices=["fused_linear_jsd", "jsd"], help="op(s) to run (default: both)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens for fused_linear_jsd (default 4096)")
    p.add_argument("--student-hidden", type=int, default=4096)
    p.add_argument("--teacher-hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--jsd-rows", type=int, default=8192, help="rows of the plain jsd case (default 8192, beta 0.5)")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", help="write results and environment to this JSON file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, no timing: checks that every impl runs")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        p.error("timing needs a CUDA device; use --smoke on the CPU (with TRITON_INTERPRET=1)")
    shape = dict(SMOKE) if args.smoke else dict(
        tokens=args.tokens, student_hidden=args.student_hidden, teacher_hidden=args.teacher_hidden,
        vocab=args.vocab, jsd_rows=args.jsd_rows,
    )
    env = environment()
    bandwidth = H200_COPY_BYTES_PER_S if args.smoke else measure_copy_bandwidth()
    env["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 2)
    print({k: v for k, v in env.items() if v is not None}, flush=True)

    rows: list[Measurement] = []
    for op in args.op or ["fused_linear_jsd", "jsd"]:
        torch.manual_seed(0)
        if op == "fused_linear_jsd":
            n, hs, ht, v = shape["tokens"], shape["student_hidden"], shape["teacher_hidden"], shape["vocab"]
            case = case_fused_linear_jsd(n, hs, ht, v, args.beta, args.temperature, dtype, device)
            flops = 2.0 * n * v * (3 * hs + ht)  # student + teacher logits, d hidden, d weight
        else:
            case = case_jsd(shape["jsd_rows"], shape["vocab"], dtype, device)
            flops = None
            if not _liger_jsd_available():
                case.impls.pop("liger", None)
        if args.smoke:
            case.impls.pop("compile", None)
        result = finish_rows(bench_case(case, bandwidth, args.smoke), case, flops)
        if "liger" not in case.impls:
            result.append(Measurement(case.op, case.shape, "liger", note="n/a: liger-kernel not importable"))
        rows.extend(result)
        print(format_table(result), flush=True)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n## all results\n" + format_table(rows))
    return finish(rows, env, args.json)


if __name__ == "__main__":
    sys.exit(main())
