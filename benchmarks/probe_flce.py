"""Where fused_linear_cross_entropy's time goes on a GPU: one run, many small measurements.

    python benchmarks/probe_flce.py --out DIR

1. the three full-size GEMMs (floor) and a device copy (bandwidth ceiling);
2. one chunk's GEMMs at several chunk sizes: logits, grad_hidden (K = vocab: small output,
   so cuBLAS's split-K choice matters; also manual split-K variants), grad_weight += (K = chunk);
3. the first block's pieces (vocab-major logits in grad_weight's storage);
4. the cross-entropy kernels on a token-major chunk and on the vocab-major view;
5. torch.profiler per-kernel tables of one forward+backward at two chunk sizes;
6. end-to-end forward+backward time and extra memory for several chunk sizes.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

N, H, V = 8192, 4096, 128256
ROWS = []
PROFILE_CHUNKS = (256,)


def ms(fn, rep=60):
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def record(section, name, t, flop=None, nbytes=None, **kw):
    row = dict(section=section, name=name, ms=round(t, 4), **kw)
    if flop:
        row["tflops"] = round(flop / t / 1e9, 1)
    if nbytes:
        row["gbps"] = round(nbytes / t / 1e6, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


@triton.jit
def _mm_splitk_atomic(a_ptr, b_ptr, c_ptr, M, N_, K, k_per_split, sam, sak, sbk, sbn,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    k0 = pid_k * k_per_split
    k_stop = tl.minimum(k0 + k_per_split, K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * sam + (k0 + offs_k)[None, :].to(tl.int64) * sak
    b_ptrs = b_ptr + (k0 + offs_k)[:, None].to(tl.int64) * sbk + offs_n[None, :] * sbn
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(k0, k_stop, BK):
        mk = (k + offs_k) < k_stop
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & mk[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mk[:, None] & (offs_n[None, :] < N_), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK * sak
        b_ptrs += BK * sbk
    c = c_ptr + offs_m[:, None] * N_ + offs_n[None, :]
    tl.atomic_add(c, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N_), sem="relaxed")


def triton_splitk(a, b, c32, splits, bm, bn, bk, stages, warps):
    M, K = a.shape
    N_ = b.shape[1]
    kps = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    grid = (triton.cdiv(M, bm), triton.cdiv(N_, bn), triton.cdiv(K, kps))
    c32.zero_()
    _mm_splitk_atomic[grid](a, b, c32, M, N_, K, kps, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            BM=bm, BN=bn, BK=bk, num_stages=stages, num_warps=warps)


def section_gemms(h, w):
    f_full = 2 * N * H * V
    logits = h.new_empty(N, V).normal_()
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    record("floor", "logits N x V", ms(lambda: torch.mm(h, w.t(), out=logits)), f_full)
    record("floor", "dh = g @ W (full)", ms(lambda: torch.mm(logits, w, out=dh)), f_full)
    record("floor", "dW = g.T @ h (full)", ms(lambda: torch.mm(logits.t(), h, out=dw)), f_full)
    del logits
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    record("floor", "copy 1 GiB", ms(lambda: dst.copy_(src)), nbytes=2 * 2**30)
    del src, dst
    dw.normal_()
    for c in (128, 256, 512, 1024):
        hc = h[:c]
        g = h.new_empty(c, V).normal_()
        f = 2 * c * H * V
        out = dh[:c]
        record("chunk", f"logits C={c}", ms(lambda: torch.mm(hc, w.t(), out=g)), f)
        g.normal_()
        record("chunk", f"dh mm C={c}", ms(lambda: torch.mm(g, w, out=out)), f)
        out_t = h.new_empty(H, c)
        record("chunk", f"dh^T mm(W.T, g.T) C={c}", ms(lambda: torch.mm(w.t(), g.t(), out=out_t)), f)
        record("chunk", f"dW addmm_ K={c}", ms(lambda: dw.addmm_(g.t(), hc)), f, nbytes=4 * V * H)
        record("chunk", f"dW mm (beta 0) K={c}", ms(lambda: torch.mm(g.t(), hc, out=dw)), f, nbytes=2 * V * H)
        if c <= 512:
            for s in (2, 4, 8):
                if V % s:
                    continue
                gv = g.view(c, s, V // s).transpose(0, 1)
                wv = w.view(s, V // s, H)
                try:
                    record("chunk", f"dh bmm splitK={s} fp32 + sum C={c}",
                           ms(lambda: torch.bmm(gv, wv, out_dtype=torch.float32).sum(0, out=None)), f)
                except Exception as exc:  # noqa: BLE001
                    print("bmm out_dtype failed:", exc)
                record("chunk", f"dh bmm splitK={s} bf16 + sum C={c}",
                       ms(lambda: torch.bmm(gv, wv).sum(0, dtype=torch.float32)), f)
            c32 = torch.empty(c, H, dtype=torch.float32, device="cuda")
            ref = torch.mm(g.float(), w.float())
            for cfg in ((4, 128, 256, 64, 3, 8), (8, 128, 256, 64, 3, 8), (4, 128, 128, 64, 4, 4),
                        (8, 128, 128, 64, 4, 8)):
                try:
                    triton_splitk(g, w, c32, *cfg)
                    err = float((c32 - ref).norm() / ref.norm())
                    record("chunk", f"dh triton splitK {cfg} C={c}", ms(lambda: triton_splitk(g, w, c32, *cfg)), f,
                           rel_err=err)
                except Exception as exc:  # noqa: BLE001
                    print("triton splitk failed", cfg, type(exc).__name__, str(exc)[:200])
            del c32, ref
        del g
    return dh, dw


def section_first_block(h, w, dw):
    n0 = H
    logits_t = dw.view(V, n0)
    h0 = h[:n0]
    f = 2 * n0 * H * V
    record("first", "logits_t = W @ h0.T", ms(lambda: torch.mm(w, h0.t(), out=logits_t)), f)
    logits_t.normal_()
    dh = torch.empty_like(h0)
    record("first", "dh0 = logits_t.T @ W", ms(lambda: torch.mm(logits_t.t(), w, out=dh)), f)
    for rows in (7936, 15872):
        staging = w.new_empty(rows, H)
        nsl = triton.cdiv(V, rows)

        def slices():
            for v0 in range(0, V, rows):
                v1 = min(V, v0 + rows)
                torch.mm(logits_t[v0:v1], h0, out=staging[: v1 - v0])

        def copies():
            for v0 in range(0, V, rows):
                v1 = min(V, v0 + rows)
                logits_t[v0:v1].copy_(staging[: v1 - v0])

        record("first", f"dW slices x{nsl} rows={rows}", ms(slices), f)
        record("first", f"staging copies x{nsl} rows={rows}", ms(copies), nbytes=4 * V * H)
        del staging


def section_ce():
    from fuseforge.ops.cross_entropy import LossOptions, ce_forward_stats, ce_write_grad

    opts = LossOptions()
    for label, tokens, vocab_major in (("token-major", 256, False), ("token-major", 4096, False),
                                       ("vocab-major", 4096, True)):
        if vocab_major:
            x = torch.randn(V, tokens, device="cuda", dtype=torch.bfloat16).t()
        else:
            x = torch.randn(tokens, V, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, V, (tokens,), device="cuda")
        loss = torch.empty(tokens, device="cuda")
        lse = torch.empty(tokens, device="cuda")
        scale = torch.full((1,), 1e-3, device="cuda")
        nb = tokens * V * 2
        record("ce", f"stats {label} [{tokens},V]",
               ms(lambda: ce_forward_stats(x, target, opts, loss_out=loss, lse_out=lse)), nbytes=nb)
        record("ce", f"grad in place {label} [{tokens},V]",
               ms(lambda: ce_write_grad(x, target, lse, scale, opts, out=x)), nbytes=2 * nb)
        del x


def fwd_bwd(h, w, t, chunk):
    from fuseforge.functional import fused_linear_cross_entropy

    def run():
        h.grad = w.grad = None
        fused_linear_cross_entropy(h, w, t, chunk_size=chunk).backward()

    return run


def section_profile(h, w, t, out_dir):
    from torch.profiler import ProfilerActivity, profile

    for chunk in PROFILE_CHUNKS:
        run = fwd_bwd(h, w, t, chunk)
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        table = None
        for key in ("self_cuda_time_total", "self_device_time_total"):
            try:
                table = prof.key_averages().table(sort_by=key, row_limit=16, max_name_column_width=90)
                break
            except Exception:  # noqa: BLE001
                continue
        with open(os.path.join(out_dir, f"profile_{chunk}.txt"), "w") as f:
            f.write(table or "no table")
        print(f"### profile chunk {chunk}\n{table}", flush=True)
        h.grad = w.grad = None


def section_e2e(h, w, t):
    for chunk in (128, 192, 256, 320, 384, 512, 1024):
        run = fwd_bwd(h, w, t, chunk)
        run()
        torch.cuda.synchronize()
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - before) / 2**20 - (h.numel() + w.numel()) * 2 / 2**20
        t_ms = float(do_bench(run, warmup=100, rep=600, return_mode="median"))
        record("e2e", f"fuseforge chunk={chunk}", t_ms, extra_mib=round(extra, 1))
        h.grad = w.grad = None


def section_new_kernels(h, w):
    """The replacement kernels against what they replace, at full size, with a correctness check each."""
    from fuseforge.ops import matmul_accumulate as mma
    from fuseforge.ops.chunk_cross_entropy import chunk_grad_in_place, chunk_loss_and_lse
    from fuseforge.ops.cross_entropy import LossOptions, ce_forward_stats, ce_write_grad

    dw = (torch.randn(V, H, device="cuda") * 1e-3).to(torch.bfloat16)
    for c in (256, 512):
        g = (h.new_empty(c, V).normal_() * 1e-4)
        hc = h[:c]
        f = 2 * c * H * V
        record("addmm", f"cuBLAS dW.addmm_ K={c}", ms(lambda: dw.addmm_(g.t(), hc)), f, nbytes=4 * V * H)
        record("addmm", f"triton addmm_ K={c}", ms(lambda: mma.addmm_(dw, g.t(), hc)), f, nbytes=4 * V * H)
        ref = dw.clone()
        ref.addmm_(g.t(), hc)
        mine = dw.clone()
        mma.addmm_(mine, g.t(), hc)
        err = float((mine.float() - ref.float()).norm() / (ref.float() - dw.float()).norm())
        record("addmm", f"triton vs cuBLAS rel err of the update K={c}", 0.0, rel_err=err)
        del g, ref, mine
    del dw
    opts = LossOptions(label_smoothing=0.1)
    for label, tokens, vocab_major in (("token-major", 256, False), ("vocab-major", 4096, True)):
        x = torch.randn(V, tokens, device="cuda", dtype=torch.bfloat16)
        x = x.t() if vocab_major else x.reshape(tokens, V)
        target = torch.randint(0, V, (tokens,), device="cuda")
        loss, lse = torch.empty(tokens, device="cuda"), torch.empty(tokens, device="cuda")
        loss0, lse0 = torch.empty_like(loss), torch.empty_like(lse)
        scale = torch.full((1,), 1e-3, device="cuda")
        nb = tokens * V * 2
        record("ce", f"old stats {label} [{tokens},V]",
               ms(lambda: ce_forward_stats(x, target, opts, loss_out=loss0, lse_out=lse0)), nbytes=nb)
        record("ce", f"new stats {label} [{tokens},V]", ms(lambda: chunk_loss_and_lse(x, target, opts, loss, lse)),
               nbytes=nb, rel_err=float((loss - loss0).abs().max()) + float((lse - lse0).abs().max()))
        x0 = x.clone()
        ce_write_grad(x0, target, lse0, scale, opts, out=x0)
        x1 = x.clone()
        chunk_grad_in_place(x1, target, lse, scale, opts)
        gerr = float((x1.float() - x0.float()).abs().max())
        del x0, x1
        record("ce", f"old grad {label} [{tokens},V]", ms(lambda: ce_write_grad(x, target, lse, scale, opts, out=x)),
               nbytes=2 * nb)
        record("ce", f"new grad {label} [{tokens},V]", ms(lambda: chunk_grad_in_place(x, target, lse, scale, opts)),
               nbytes=2 * nb, rel_err=gerr)
        del x
    logits_t = h.new_empty(V, H).normal_()
    dh = torch.empty_like(h[:H])
    tmp = torch.empty(H, H, device="cuda", dtype=torch.bfloat16)
    f = 2 * H * H * V
    record("first", "dh0 = logits_t.T @ W", ms(lambda: torch.mm(logits_t.t(), w, out=dh)), f)

    def transposed():
        torch.mm(w.t(), logits_t, out=tmp)
        dh.copy_(tmp.t())

    record("first", "dh0 = (W.T @ logits_t).T + copy", ms(transposed), f)


def section_e2e_variants(h, w, t):
    from fuseforge.ops import matmul_accumulate as mma

    default = mma.MAX_INNER
    for chunk, max_inner in ((256, default), (256, 0), (512, default), (1024, default)):
        mma.MAX_INNER = max_inner
        run = fwd_bwd(h, w, t, chunk)
        run()
        torch.cuda.synchronize()
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - before) / 2**20 - (h.numel() + w.numel()) * 2 / 2**20
        t_ms = float(do_bench(run, warmup=60, rep=400, return_mode="median"))
        record("e2e", f"new chunk={chunk} triton-addmm<={max_inner}", t_ms, extra_mib=round(extra, 1))
        h.grad = w.grad = None
    mma.MAX_INNER = default


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--skip", default="")
    p.add_argument("--sections", default="gemm,ce,profile,e2e")
    args = p.parse_args()
    torch.manual_seed(0)
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    skip = set(args.skip.split(","))
    sections = set(args.sections.split(",")) - skip
    if "new" in sections:
        section_new_kernels(h, w)
        torch.cuda.empty_cache()
    if "gemm" in sections:
        dh, dw = section_gemms(h, w)
        section_first_block(h, w, dw)
        del dh, dw
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
    if "variants" in sections:
        section_e2e_variants(hl, wl, t)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print("\n| section | name | ms | TFLOP/s | GB/s | extra |")
    for r in ROWS:
        print(f"| {r['section']} | {r['name']} | {r['ms']:.3f} | {r.get('tflops', '')} | {r.get('gbps', '')} | "
              f"{r.get('extra_mib', r.get('rel_err', ''))} |")


if __name__ == "__main__":
    main()
