"""Probe: a one-read cross-entropy whose last-finishing slice program writes the row's gradient.

    python benchmarks/ce_last_arriver_probe.py [--shape 8192,128256 ...]

Why a probe and not a library path: it answers one question before any integration. The
split kernels read the logits twice from HBM (1.48 ms floor at 8192 x 128256); earlier
one-read designs made programs wait on each other and were slower (benchmarks/RESULTS.md).
Here no program ever waits: every (row, vocabulary slice) program folds its slice into
statistics, bumps the row's arrival counter, and only the program that arrives last (the
classic threadfence-reduction pattern) merges the row's statistics and sweeps the row again,
a few microseconds after its slices were read, so that the second read should come from L2.
Prints kernel time (torch.profiler) and errors against fp32 eager per launch setting, next to
the split kernels' forward+backward.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fuseforge.ops import cross_entropy as ce  # noqa: E402


@triton.jit
def _ce_last_arriver_kernel(
    x_ptr, stride_xt, stride_xv, g_ptr, stride_gt, stride_gv, target_ptr, stats_ptr, count_ptr,
    loss_ptr, lse_ptr, scale_ptr,
    n_tokens, n_vocab, n_splits, vocab_per_split, ignore_index, label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, GRAD_BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    tok = pid // n_splits
    pid_s = pid % n_splits
    offs_t = tok + tl.arange(0, 1)
    mask_t = offs_t < n_tokens
    target = tl.load(target_ptr + offs_t, mask=mask_t, other=-1)
    row = x_ptr + offs_t.to(tl.int64) * stride_xt
    v_begin = pid_s * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, n_vocab)

    target_logit = ce.load_target_logit(row, stride_xv, target, mask_t, v_begin, v_end, softcap, HAS_SOFTCAP)
    run_max, exp_acc, z_acc = ce.init_tile_stats(1, BLOCK_V, VOCAB_AXIS=1)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask = mask_t[:, None] & (offs_v < v_end)[None, :]
        x = tl.load(row[:, None] + offs_v.to(tl.int64)[None, :] * stride_xv, mask=mask, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        run_max, exp_acc, z_acc = ce.fold_tile_stats(
            x, mask, run_max, exp_acc, z_acc, softcap, HAS_SOFTCAP, HAS_SMOOTHING, VOCAB_AXIS=1
        )
    run_sum, logit_sum = ce.finish_tile_stats(exp_acc, z_acc, HAS_SMOOTHING, VOCAB_AXIS=1)
    ce.store_split_stats(stats_ptr, pid_s, n_splits, offs_t, mask_t, n_tokens, run_max, run_sum, logit_sum,
                         target_logit)
    tl.debug_barrier()  # every thread's stores happen before the release below
    arrived = tl.atomic_add(count_ptr + tok, 1, sem="acq_rel", scope="gpu") + 1
    if arrived == n_splits:
        tl.debug_barrier()
        offs_s = tl.arange(0, BLOCK_S)
        mask2 = (offs_s < n_splits)[:, None] & mask_t[None, :]
        field = n_splits * n_tokens
        base = stats_ptr + offs_s[:, None] * n_tokens + offs_t[None, :]
        # .cg: from L2, never from a line this SM's L1 cached before the others wrote it.
        part_max = tl.load(base, mask=mask2, other=float("-inf"), cache_modifier=".cg")
        part_sum = tl.load(base + field, mask=mask2, other=0.0, cache_modifier=".cg")
        top = tl.max(part_max, axis=0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        lse = shift + tl.log(tl.sum(part_sum * tl.exp(part_max - shift[None, :]), axis=0))
        tgt = tl.sum(tl.load(base + 3 * field, mask=mask2, other=0.0, cache_modifier=".cg"), axis=0)
        zsum = tl.sum(tl.load(base + 2 * field, mask=mask2, other=0.0, cache_modifier=".cg"), axis=0)
        loss = ce._token_loss(lse, tgt, zsum, target, n_vocab, ignore_index, label_smoothing, z_loss_scale,
                              HAS_SMOOTHING, HAS_Z_LOSS)
        loss = tl.where(ce.target_is_bad(target, n_vocab, ignore_index), float("nan"), loss)
        tl.store(loss_ptr + offs_t, loss, mask=mask_t)
        tl.store(lse_ptr + offs_t, lse, mask=mask_t)
        valid = mask_t & (target != ignore_index)
        scale = tl.load(scale_ptr).to(tl.float32) + tl.zeros([1], tl.float32)
        softmax_coef, smooth, hit, lse_g = ce.grad_coefficients(scale, valid, lse, n_vocab, label_smoothing,
                                                                z_loss_scale)
        g_row = g_ptr + offs_t.to(tl.int64) * stride_gt
        for v0 in range(0, n_vocab, GRAD_BLOCK_V):
            offs_v = v0 + tl.arange(0, GRAD_BLOCK_V)
            offs_v64 = offs_v.to(tl.int64)
            mask = mask_t[:, None] & (offs_v < n_vocab)[None, :]
            x = tl.load(row[:, None] + offs_v64[None, :] * stride_xv, mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            hits_target = offs_v[None, :] == target[:, None]
            g = ce.grad_tile(x, hits_target, valid, lse_g, softmax_coef, smooth, hit, softcap, HAS_SOFTCAP,
                             VOCAB_AXIS=1)
            tl.store(g_row[:, None] + offs_v64[None, :] * stride_gv, g.to(g_ptr.dtype.element_ty), mask=mask,
                     eviction_policy="evict_first")


def last_arriver_ce(logits, target, scale, vocab_per_split=8192, block_v=4096, grad_block_v=4096, num_warps=8,
                    out=None):
    """(per-token loss, lse, scale * dloss/dlogits) in one launch; `scale` is 1 fp32 element."""
    n_tokens, n_vocab = logits.shape
    opts = ce.LossOptions()
    n_splits = triton.cdiv(n_vocab, vocab_per_split)
    stats = torch.empty(ce.N_STATS, n_splits, n_tokens, dtype=torch.float32, device=logits.device)
    count = torch.zeros(n_tokens, dtype=torch.int32, device=logits.device)
    loss = torch.empty(n_tokens, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_tokens, dtype=torch.float32, device=logits.device)
    grad = out if out is not None else torch.empty_like(logits)
    _ce_last_arriver_kernel[(n_tokens * n_splits,)](
        logits, logits.stride(0), logits.stride(1), grad, grad.stride(0), grad.stride(1), target, stats, count,
        loss, lse, scale,
        n_tokens, n_vocab, n_splits, vocab_per_split, opts.ignore_index, 0.0, 0.0, 1.0,
        HAS_SOFTCAP=False, HAS_SMOOTHING=False, HAS_Z_LOSS=False,
        BLOCK_V=min(block_v, vocab_per_split), BLOCK_S=triton.next_power_of_2(n_splits),
        GRAD_BLOCK_V=grad_block_v, num_warps=num_warps,
    )
    return loss, lse, grad


def reference(logits, target):
    x = logits.detach().float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x, target, ignore_index=-100)
    loss.backward()
    tok = torch.nn.functional.cross_entropy(x.detach(), target, ignore_index=-100, reduction="none")
    return loss.detach(), tok, x.grad


_REFERENCES = {}


def check(logits, target, **cfg) -> float:
    key = (logits.data_ptr(), target.data_ptr(), tuple(logits.shape))
    if key not in _REFERENCES:
        _REFERENCES.clear()
        _REFERENCES[key] = reference(logits, target)
    ref_loss, ref_tok, ref_grad = _REFERENCES[key]
    n_valid = int((target != -100).sum())
    scale = torch.full((1,), 1.0 / max(n_valid, 1), device=logits.device)
    loss, _, grad = last_arriver_ce(logits, target, scale, **cfg)
    err_tok = float((loss - ref_tok).abs().max())
    err_loss = abs(float(loss.sum()) / max(n_valid, 1) - float(ref_loss))
    err_grad = float((grad.float() - ref_grad).abs().max() / ref_grad.abs().max())
    return max(err_tok, err_loss, err_grad)


def kernel_ms(fn, steps=10):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 1e3 / steps


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", action="append")
    p.add_argument("--smoke", action="store_true", help="small shapes, correctness only (CPU interpreter)")
    p.add_argument("--splits", type=int, nargs="+", default=[4096, 8192, 16384], help="vocabulary per slice program")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    args = p.parse_args()
    if args.smoke:
        for n, v, vps in [(5, 300, 128), (7, 1000, 256), (3, 77, 1024)]:
            logits = torch.randn(n, v) * 3
            target = torch.randint(0, v, (n,))
            target[1] = -100
            err = check(logits.to(torch.bfloat16), target, vocab_per_split=vps, block_v=64, grad_block_v=128,
                        num_warps=4)
            print(f"smoke {n}x{v} split {vps}: max err {err:.2e}")
        return 0
    shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shape or ["8192,128256", "8192,32000"])]
    from common import fwd_bwd, time_ms  # noqa: E402

    for n, v in shapes:
        torch.manual_seed(0)
        logits = (torch.randn(n, v, device="cuda") * 4).to(torch.bfloat16)
        target = torch.randint(0, v, (n,), device="cuda")
        target[torch.rand(n, device="cuda") < 0.1] = -100
        leaf = logits.clone().requires_grad_()
        split = fwd_bwd(lambda: ce.cross_entropy(leaf, target), [leaf])
        print(f"\n### {n}x{v}: split kernels fwd+bwd {kernel_ms(split):.3f} ms (do_bench {time_ms(split):.3f})", flush=True)
        del leaf, split
        scale = torch.full((1,), 1.0 / max(int((target != -100).sum()), 1), device="cuda")
        grad = torch.empty_like(logits)
        for vps, bv, gbv, warps in itertools.product(args.splits, [4096], [4096, 8192], args.warps):
            if bv > vps:
                continue
            cfg = dict(vocab_per_split=vps, block_v=bv, grad_block_v=gbv, num_warps=warps)
            try:
                err = check(logits, target, **cfg)
                fn = lambda: last_arriver_ce(logits, target, scale, out=grad, **cfg)  # noqa: E731
                ms = kernel_ms(fn)
            except Exception as exc:  # noqa: BLE001
                print(f"{cfg} failed: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            print(f"{cfg}: kernels {ms:.3f} ms, rel err {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
