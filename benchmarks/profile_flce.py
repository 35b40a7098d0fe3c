"""Where fused_linear_cross_entropy's time goes on a GPU: its pieces timed one by one, in one run.

    python benchmarks/profile_flce.py --out DIR [--sections floor,chunk,first,ce,profile,e2e]

floor   the three full-size GEMMs and a 1 GiB device copy (the two ceilings);
chunk   one chunk's GEMMs at several chunk sizes: logits, grad_hidden (K = vocab) and
        grad_weight += g.T @ h (cuBLAS beta=1, against the same product with beta=0);
first   the first block's pieces (vocab-major logits in grad_weight's storage, staged slices);
ce      the cross-entropy kernels on a token-major chunk and on the vocab-major block;
profile torch.profiler per-kernel table (self CUDA time, calls) of one forward + backward;
e2e     forward + backward time and extra peak memory for several chunk sizes.
Every row prints as JSON as it is measured; a table comes last and DIR/profile_flce.json keeps all.
do_bench numbers are sustained (clocks under load); the profiler's single run is at burst clocks.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from triton.testing import do_bench

N, H, V = 8192, 4096, 128256
ROWS: list[dict] = []


def ms(fn, rep=60):
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def record(section, name, t, flop=None, nbytes=None, **extra):
    row = dict(section=section, name=name, ms=round(t, 4), **extra)
    if flop:
        row["tflops"] = round(flop / t / 1e9, 1)
    if nbytes:
        row["gbps"] = round(nbytes / t / 1e6, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def section_floor(h, w):
    flop = 2 * N * H * V
    logits = h.new_empty(N, V).normal_()
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    record("floor", "logits N x V", ms(lambda: torch.mm(h, w.t(), out=logits)), flop)
    record("floor", "dh = g @ W (full)", ms(lambda: torch.mm(logits, w, out=dh)), flop)
    record("floor", "dW = g.T @ h (full)", ms(lambda: torch.mm(logits.t(), h, out=dw)), flop)
    del logits
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    record("floor", "copy 1 GiB", ms(lambda: dst.copy_(src)), nbytes=2 * 2**30)


def section_chunk(h, w):
    dh = torch.empty_like(h)
    dw = torch.randn_like(w)
    for c in (128, 256, 512, 1024):
        hc, out = h[:c], dh[:c]
        g = h.new_empty(c, V).normal_()
        flop = 2 * c * H * V
        record("chunk", f"logits C={c}", ms(lambda: torch.mm(hc, w.t(), out=g)), flop)
        g.normal_()
        record("chunk", f"dh mm C={c}", ms(lambda: torch.mm(g, w, out=out)), flop)
        record("chunk", f"dW addmm_ K={c}", ms(lambda: dw.addmm_(g.t(), hc)), flop, nbytes=4 * V * H)
        record("chunk", f"dW mm (beta 0) K={c}", ms(lambda: torch.mm(g.t(), hc, out=dw)), flop, nbytes=2 * V * H)


def section_first(h, w):
    n0 = H
    logits_t = torch.empty_like(w).view(V, n0)
    h0 = h[:n0]
    flop = 2 * n0 * H * V
    record("first", "logits_t = W @ h0.T", ms(lambda: torch.mm(w, h0.t(), out=logits_t)), flop)
    logits_t.normal_()
    dh = torch.empty_like(h0)
    record("first", "dh0 = logits_t.T @ W", ms(lambda: torch.mm(logits_t.t(), w, out=dh)), flop)
    rows = 8016  # the staging slice of the 64 MiB rule at this shape
    staging = w.new_empty(rows, H)

    def slices():
        for v0 in range(0, V, rows):
            v1 = min(V, v0 + rows)
            torch.mm(logits_t[v0:v1], h0, out=staging[: v1 - v0])

    def copies():
        for v0 in range(0, V, rows):
            v1 = min(V, v0 + rows)
            logits_t[v0:v1].copy_(staging[: v1 - v0])

    record("first", f"dW slices of {rows} rows", ms(slices), flop)
    record("first", f"staging copies of {rows} rows", ms(copies), nbytes=4 * V * H)


def section_ce():
    from fuseforge.loss_args import LossOptions
    from fuseforge.ops.cross_entropy import ce_forward_stats, ce_write_grad
    from fuseforge.ops._shared.vocab_major_cross_entropy import vocab_major_grad_in_place, vocab_major_loss_and_lse

    opts = LossOptions(label_smoothing=0.1)
    scale = torch.full((1,), 1e-3, device="cuda")
    for tokens in (256, 4096):
        x = torch.randn(tokens, V, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, V, (tokens,), device="cuda")
        loss, lse = torch.empty(tokens, device="cuda"), torch.empty(tokens, device="cuda")
        nb = tokens * V * 2
        record("ce", f"cross_entropy stats token-major [{tokens},V]",
               ms(lambda: ce_forward_stats(x, target, opts, loss_out=loss, lse_out=lse)), nbytes=nb)
        record("ce", f"cross_entropy grad token-major [{tokens},V]",
               ms(lambda: ce_write_grad(x, target, lse, scale, opts, out=x)), nbytes=2 * nb)
    tokens = 4096
    x_t = torch.randn(V, tokens, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, V, (tokens,), device="cuda")
    loss, lse = torch.empty(tokens, device="cuda"), torch.empty(tokens, device="cuda")
    nb = tokens * V * 2
    record("ce", "cross_entropy stats on the vocab-major view",
           ms(lambda: ce_forward_stats(x_t.t(), target, opts, loss_out=loss, lse_out=lse)), nbytes=nb)
    record("ce", "vocab_major stats", ms(lambda: vocab_major_loss_and_lse(x_t, target, opts, loss, lse)), nbytes=nb)
    record("ce", "cross_entropy grad on the vocab-major view",
           ms(lambda: ce_write_grad(x_t.t(), target, lse, scale, opts, out=x_t.t())), nbytes=2 * nb)
    record("ce", "vocab_major grad", ms(lambda: vocab_major_grad_in_place(x_t, target, lse, scale, opts)),
           nbytes=2 * nb)


def fwd_bwd(h, w, t, chunk):
    from fuseforge.functional import fused_linear_cross_entropy

    def run():
        h.grad = w.grad = None
        fused_linear_cross_entropy(h, w, t, chunk_size=chunk).backward()

    return run


def section_profile(h, w, t, out_dir, chunk=256):
    from torch.profiler import ProfilerActivity, profile

    run = fwd_bwd(h, w, t, chunk)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=90)
    with open(os.path.join(out_dir, f"profile_flce_{chunk}.txt"), "w") as f:
        f.write(table)
    print(f"### profile, chunk {chunk}\n{table}", flush=True)
    h.grad = w.grad = None


def section_e2e(h, w, t):
    for chunk in (128, 256, 384, 512, 1024, 2048):
        run = fwd_bwd(h, w, t, chunk)
        run()
        h.grad = w.grad = None  # the outputs are subtracted below: keep them out of "before"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - before - (h.numel() + w.numel()) * 2) / 2**20
        record("e2e", f"fuseforge chunk={chunk}", float(do_bench(run, warmup=100, rep=500, return_mode="median")),
               extra_mib=round(extra, 1))
        h.grad = w.grad = None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--sections", default="floor,chunk,first,ce,profile,e2e")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    torch.manual_seed(0)
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    for name, fn in (("floor", section_floor), ("chunk", section_chunk), ("first", section_first)):
        if name in sections:
            fn(h, w)
            torch.cuda.empty_cache()
    if "ce" in sections:
        section_ce()
        torch.cuda.empty_cache()
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    if "profile" in sections:
        section_profile(hl, wl, t, args.out)
    if "e2e" in sections:
        section_e2e(hl, wl, t)
    with open(os.path.join(args.out, "profile_flce.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print("\n| section | name | ms | TFLOP/s | GB/s | extra MiB |\n|---|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['section']} | {r['name']} | {r['ms']:.3f} | {r.get('tflops', '')} | {r.get('gbps', '')} | "
              f"{r.get('extra_mib', '')} |")


if __name__ == "__main__":
    main()
