"""Preference and RL losses from the LM head: fuseforge vs eager PyTorch and Liger-Kernel (forward + backward).

    python benchmarks/bench_preference.py --out $OUT/pref.json          # DPO, ORPO, SimPO, KTO, GRPO, headline shape
    python benchmarks/bench_preference.py --loss dpo --loss grpo --pairs 4
    TRITON_INTERPRET=1 python benchmarks/bench_preference.py --quick --out /tmp/pref.json  # CPU: runs, no timing

Headline (issue 19): bf16, hidden 4096, vocabulary 128256, sequences of 2048 tokens; 8 pairs
(16 sequences, chosen stacked over rejected) for DPO (sigmoid), ORPO and SimPO, 16 unpaired
sequences (8 desirable) for KTO, 8 sequences for GRPO (loss_type dapo). About a quarter of
each sequence is prompt (ignore_index), the rest completion. Each step is one forward +
backward w.r.t. the policy's hidden states and lm_head weight. Where the loss has a reference
model (DPO, KTO) its frozen head (own hidden states and weight) is part of the step; GRPO gets
its reference and old log-probs as tensors (beta 0.04, no bias correction), as TRL stores them.

Implementations: "eager" materialises the [tokens, V] logits, upcasts them, takes log_softmax and
gathers the targets (what a trainer does without fusion); "fuseforge" is fuseforge.functional;
"liger" is liger_kernel.chunked_loss (LigerFusedLinear{DPO,ORPO,SimPO,KTO,GRPO}Loss, chunk_size 1),
skipped with a note when liger-kernel is not importable.

ms: median of triton.testing.do_bench. extra MiB: peak torch.cuda.max_memory_allocated during one
step above what was allocated before it, minus the gradient outputs every implementation must
produce (d hidden, d weight); the raw number is extra.with_grad_outputs_mib. max abs err: of the
loss against eager. TFLOP/s counts the minimal vocabulary GEMMs (policy logits, d hidden,
d weight, reference logits); fuseforge's preference losses compute the gradients in the forward sweep
(whole pairs per chunk), as its GRPO does: no GEMM more.
With --quick on the CPU each implementation runs once (no timing, no memory).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Measurement, environment, finish, fwd_bwd, peak_extra_mib, time_ms, try_import  # noqa: E402

LOSSES = ("dpo", "orpo", "simpo", "kto", "grpo")
IGNORE = -100
BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "kto": 0.1, "grpo": 0.04}
SIMPO_GAMMA = 0.5
QUICK = dict(pairs=2, seq=13, hidden=32, vocab=301)


@dataclass
class Inputs:
    hidden: torch.Tensor  # [n, T, H] policy hidden states (leaf)
    weight: torch.Tensor  # [V, H] policy lm_head (leaf)
    target: torch.Tensor  # [n, T] ignore_index on the prompt
    ref_hidden: torch.Tensor
    ref_weight: torch.Tensor


def make_inputs(n_seq: int, seq: int, hidden: int, vocab: int, dtype, device) -> Inputs:
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    target = torch.randint(0, vocab, (n_seq, seq), generator=gen, device=device)
    target[:, : seq // 4] = IGNORE
    return Inputs(
        hidden=randn(n_seq, seq, hidden).requires_grad_(True),
        weight=randn(vocab, hidden, scale=hidden**-0.5).requires_grad_(True),
        target=target,
        ref_hidden=randn(n_seq, seq, hidden),
        ref_weight=randn(vocab, hidden, scale=hidden**-0.5),
    )


# ------------------------------------------------------------------------------------ eager (materialised logits)


def eager_token_logps(hidden, weight, target):
    logits = (hidden @ weight.t()).float()
    logp = logits.log_softmax(-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp * (target != IGNORE)


def eager_sums(hidden, weight, target, average=False):
    tok = eager_token_logps(hidden, weight, target)
    sums = tok.sum(-1)
    if average:
        sums = sums / (target != IGNORE).sum(-1).clamp(min=1)
    return tok, sums


def eager_dpo(x: Inputs):
    _, sums = eager_sums(x.hidden, x.weight, x.target)
    with torch.no_grad():
        _, ref = eager_sums(x.ref_hidden, x.ref_weight, x.target)
    lr = sums - ref
    b = lr.shape[0] // 2
    return -F.logsigmoid(BETA["dpo"] * (lr[:b] - lr[b:])).mean()


def eager_orpo(x: Inputs):
    tok, avg = eager_sums(x.hidden, x.weight, x.target, average=True)
    b = avg.shape[0] // 2
    mask = (x.target[:b] != IGNORE).float()
    nll = -(tok[:b] * mask).sum() / mask.sum()
    c, r = avg[:b], avg[b:]
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
    return nll - BETA["orpo"] * F.logsigmoid(log_odds).mean()


def eager_simpo(x: Inputs):
    _, avg = eager_sums(x.hidden, x.weight, x.target, average=True)
    b = avg.shape[0] // 2
    return -F.logsigmoid(BETA["simpo"] * (avg[:b] - avg[b:]) - SIMPO_GAMMA).mean()


def eager_kto(x: Inputs, desirable, kl):
    _, sums = eager_sums(x.hidden, x.weight, x.target)
    with torch.no_grad():
        _, ref = eager_sums(x.ref_hidden, x.ref_weight, x.target)
    lr, beta = sums - ref, BETA["kto"]
    good, bad = 1 - torch.sigmoid(beta * (lr - kl)), 1 - torch.sigmoid(beta * (kl - lr))
    return torch.where(desirable, good, bad).mean()


def eager_grpo(x: Inputs, adv, old, ref, eps=0.2):
    tok = eager_token_logps(x.hidden, x.weight, x.target)
    mask = (x.target != IGNORE).float()
    ratio = torch.exp(tok - old)
    per_token = -torch.min(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])
    per_token = per_token + BETA["grpo"] * (torch.exp(ref - tok) - (ref - tok) - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)  # dapo without a global count


# ------------------------------------------------------------------------------------ cases


def build_case(loss: str, pairs: int, seq: int, hidden: int, vocab: int, dtype, device):
    """(shape label, inputs, {impl: forward returning the scalar loss}, minimal vocabulary-GEMM FLOPs)."""
    import fuseforge.functional as ff

    n_seq = pairs if loss == "grpo" else 2 * pairs
    x = make_inputs(n_seq, seq, hidden, vocab, dtype, device)
    n_tok = n_seq * seq
    gemm = 2.0 * n_tok * vocab * hidden
    ref_kw = dict(ref_hidden=x.ref_hidden, ref_weight=x.ref_weight)
    liger = try_import("liger_kernel.chunked_loss")
    compiled = device == "cuda"
    impls: dict[str, Callable[[], torch.Tensor]] = {}
    flops = 3 * gemm
    if loss == "dpo":
        flops += gemm
        impls["eager"] = lambda: eager_dpo(x)
        impls["fuseforge"] = lambda: ff.fused_linear_dpo_loss(x.hidden, x.weight, x.target, beta=BETA["dpo"],
                                                              **ref_kw).loss
        if liger is not None:
            m = liger.LigerFusedLinearDPOLoss(beta=BETA["dpo"], compiled=compiled, use_ref_model=True)
            impls["liger"] = lambda: m(x.weight, x.hidden, x.target, None, x.ref_hidden, x.ref_weight, None)[0]
    elif loss == "orpo":
        impls["eager"] = lambda: eager_orpo(x)
        impls["fuseforge"] = lambda: ff.fused_linear_orpo_loss(x.hidden, x.weight, x.target, beta=BETA["orpo"]).loss
        if liger is not None:
            m = liger.LigerFusedLinearORPOLoss(beta=BETA["orpo"], compiled=compiled)
            impls["liger"] = lambda: m(x.weight, x.hidden, x.target)[0]
    elif loss == "simpo":
        impls["eager"] = lambda: eager_simpo(x)
        impls["fuseforge"] = lambda: ff.fused_linear_simpo_loss(x.hidden, x.weight, x.target, beta=BETA["simpo"],
                                                                gamma=SIMPO_GAMMA).loss
        if liger is not None:
            m = liger.LigerFusedLinearSimPOLoss(beta=BETA["simpo"], gamma=SIMPO_GAMMA, compute_nll_loss=False,
                                                compiled=compiled)
            impls["liger"] = lambda: m(x.weight, x.hidden, x.target)[0]
    elif loss == "kto":
        flops += gemm
        desirable = torch.arange(n_seq, device=device) % 2 == 0
        kl = torch.tensor(0.5, device=device)
        impls["eager"] = lambda: eager_kto(x, desirable, kl)
        impls["fuseforge"] = lambda: ff.fused_linear_kto_loss(x.hidden, x.weight, x.target, desirable, kl=kl,
                                                              beta=BETA["kto"], **ref_kw).loss
        if liger is not None:
            m = liger.LigerFusedLinearKTOLoss(beta=BETA["kto"], compiled=compiled, use_ref_model=True)
            impls["liger"] = lambda: m(x.hidden, x.weight, x.target, None, desirable, x.ref_hidden, x.ref_weight,
                                       None, kl)[0]
    else:  # grpo, dapo normalisation, reference and old log-probs as tensors
        with torch.no_grad():
            cur = eager_token_logps(x.hidden.detach(), x.weight.detach(), x.target)
            old = cur + 0.05 * torch.randn_like(cur)
            ref = eager_token_logps(x.ref_hidden, x.ref_weight, x.target)
        adv = torch.randn(n_seq, device=device)
        mask = x.target != IGNORE
        impls["eager"] = lambda: eager_grpo(x, adv, old, ref)
        impls["fuseforge"] = lambda: ff.fused_linear_grpo_loss(
            x.hidden, x.weight, x.target, adv, old_logps=old, ref_logps=ref, loss_type="dapo", beta=BETA["grpo"],
            use_bias_correction_kl=False).loss
        if liger is not None:
            m = liger.LigerFusedLinearGRPOLoss(beta=BETA["grpo"], compiled=compiled, use_ref_model=True,
                                               loss_type="dapo")
            ids = x.target.clamp(min=0)
            impls["liger"] = lambda: m(x.hidden, x.weight, ids, mask, adv, None, ref, old)[0]
    return f"{n_seq}x{seq}x{hidden}->{vocab}", x, impls, flops


def measure(loss, shape, x: Inputs, impls, flops, timed: bool) -> list[Measurement]:
    rows = []
    leaves = [x.hidden, x.weight]
    grad_mib = sum(t.numel() * t.element_size() for t in leaves) / 2**20
    with torch.no_grad():
        eager_loss = float(impls["eager"]())
    for name, fwd in impls.items():
        m = Measurement(loss, shape, name)
        run = fwd_bwd(fwd, leaves)
        try:
            run()  # warm-up (compiles Triton kernels / Liger's torch.compile) and API check
            with torch.no_grad():
                value = float(fwd())
            m.extra["loss"] = value
            if name != "eager":
                m.max_abs_err = abs(value - eager_loss)
            if timed:
                for t in leaves:
                    t.grad = None
                raw = peak_extra_mib(run)
                m.extra["with_grad_outputs_mib"] = round(raw, 1)
                m.extra_mib = raw - grad_mib
                m.ms = time_ms(run, warmup=5, rep=200)
                m.note = f"{flops / (m.ms * 1e-3) / 1e12:.0f} TFLOP/s"
        except Exception as exc:  # noqa: BLE001 - report a failing implementation, keep going
            m.note = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
        for t in leaves:
            t.grad = None
        rows.append(m)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "liger" not in impls:
        rows.append(Measurement(loss, shape, "liger", note="n/a: liger-kernel not importable"))
    return rows


def format_table(rows: list[Measurement]) -> str:
    """Markdown: time and memory of each implementation, and its ratio to eager."""
    base = {(r.op, r.shape): r for r in rows if r.impl == "eager"}
    lines = ["| loss | shape | impl | ms | x vs eager | extra MiB | x less memory | loss err vs eager | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get((r.op, r.shape))
        speed = f"{b.ms / r.ms:.2f}" if (b and b.ms and r.ms) else "-"
        mem = f"{b.extra_mib / r.extra_mib:.1f}" if (b and b.extra_mib and r.extra_mib and r.extra_mib > 0) else "-"
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r.op, r.shape, r.impl, f"{r.ms:.2f}" if r.ms is not None else "n/a", speed,
            f"{r.extra_mib:.0f}" if r.extra_mib is not None else "n/a", mem,
            f"{r.max_abs_err:.2e}" if r.max_abs_err is not None else "-", r.note))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", action="append", choices=LOSSES, help="loss(es) to run (default: all)")
    p.add_argument("--pairs", type=int, default=8, help="pairs (paired losses), 2x sequences (KTO), sequences (GRPO)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", "--json", dest="out", help="write results and environment to this JSON file")
    p.add_argument("--quick", action="store_true", help=f"small shapes {QUICK}; on the CPU: run once, no timing")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick:
        build_parser().error("timing needs a CUDA device; use --quick on the CPU (with TRITON_INTERPRET=1)")
    shape = dict(QUICK) if args.quick else dict(pairs=args.pairs, seq=args.seq, hidden=args.hidden, vocab=args.vocab)
    env = environment()
    print({k: v for k, v in env.items() if v is not None}, flush=True)
    if try_import("liger_kernel.chunked_loss") is None:
        print("note: liger-kernel is not importable; its rows are skipped", flush=True)
    rows: list[Measurement] = []
    for loss in args.loss or LOSSES:
        torch.manual_seed(0)
        label, x, impls, flops = build_case(loss, shape["pairs"], shape["seq"], shape["hidden"], shape["vocab"],
                                            dtype, device)
        result = measure(loss, label, x, impls, flops, timed=device == "cuda")
        rows.extend(result)
        print(format_table(result), flush=True)
        del x, impls
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n## all results\n" + format_table(rows))
    return finish(rows, env, args.out)


if __name__ == "__main__":
    sys.exit(main())
