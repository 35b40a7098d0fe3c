"""Per-op kernel benchmark: fuseforge vs torch eager, torch.compile and Liger-Kernel, in one process.

    python benchmarks/run.py                       # every op at its headline shape
    python benchmarks/run.py --op rms_norm --sweep # one op over a sweep of sizes
    python benchmarks/run.py --json out.json       # also write the results as JSON
    TRITON_INTERPRET=1 python benchmarks/run.py --smoke  # CPU check of the script itself (no timing)

Every number is forward+backward. `floor ms` is the bytes an op must move at
least (read inputs, write outputs, read upstream grads, write input grads)
divided by the measured device-to-device copy rate; `% of floor` is how close
the implementation gets to that memory-bandwidth bound. `ms` is do_bench of the
eager step (host launch cost included); `graph ms` replays the same step from a
CUDA graph, i.e. the GPU time alone.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    H200_COPY_BYTES_PER_S,
    cuda_graph_ms,
    Measurement,
    environment,
    finish,
    format_table,
    fwd_bwd,
    measure_copy_bandwidth,
    peak_extra_mib,
    time_ms,
    try_import,
)

EPS = 1e-6


@dataclass
class Case:
    """One op at one shape: the leaves to differentiate, each implementation's forward, and the bytes floor."""

    op: str
    shape: str
    leaves: list
    impls: dict  # name -> zero-argument forward returning a tensor or tuple of tensors
    min_bytes: int
    note: str = ""


def _rand(shape, dtype, device, scale=1.0, grad=True):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)


def _liger():
    return try_import("liger_kernel.transformers.functional")


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


# ---------------------------------------------------------------- reference (eager) definitions


def ref_rms_norm(x, w):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * y.to(x.dtype)


def ref_fused_add_rms_norm(x, r, w):
    h = x + r
    return ref_rms_norm(h, w), h


def ref_layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def ref_swiglu(g, u):
    return F.silu(g) * u


def ref_geglu(g, u):
    return F.gelu(g, approximate="tanh") * u


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def ref_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def ref_cross_entropy(logits, target):
    # What transformers' ForCausalLMLoss does: upcast, then cross-entropy.
    return F.cross_entropy(logits.float(), target, ignore_index=-100)


def ref_jsd(s_logp, t_logp, beta=0.5):
    s, t = s_logp.float(), t_logp.float()
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    kl_t = (t.exp() * (t - m)).sum(-1)
    kl_s = (s.exp() * (s - m)).sum(-1)
    return (beta * kl_t + (1 - beta) * kl_s).mean()


# ---------------------------------------------------------------- cases


def case_rms_norm(T, D, dtype, device):
    from fuseforge.functional import rms_norm

    x, w = _rand((T, D), dtype, device), _rand((D,), dtype, device)
    lg = _liger()
    impls = {
        "fuseforge": lambda: rms_norm(x, w, eps=EPS),
        "eager": lambda: ref_rms_norm(x, w),
        "compile": (lambda f: lambda: f(x, w))(_compiled(ref_rms_norm)),
    }
    if lg:
        impls["liger"] = lambda: lg.liger_rms_norm(x, w, EPS, 0.0, "llama", True)
    es = x.element_size()
    return Case("rms_norm", f"{T}x{D}", [x, w], impls, 5 * T * D * es)


def case_fused_add_rms_norm(T, D, dtype, device):
    from fuseforge.functional import fused_add_rms_norm

    x, r, w = _rand((T, D), dtype, device), _rand((T, D), dtype, device), _rand((D,), dtype, device)
    lg = _liger()
    impls = {
        "fuseforge": lambda: fused_add_rms_norm(x, r, w, eps=EPS),
        "eager": lambda: ref_fused_add_rms_norm(x, r, w),
        "compile": (lambda f: lambda: f(x, r, w))(_compiled(ref_fused_add_rms_norm)),
    }
    if lg and hasattr(lg, "liger_fused_add_rms_norm"):
        impls["liger"] = lambda: lg.liger_fused_add_rms_norm(x, r, w, EPS, 0.0, "llama", False)
    es = x.element_size()
    # fwd: read x, r; write y, h. bwd: read dy, dh, h; write one grad shared by x and r.
    return Case("fused_add_rms_norm", f"{T}x{D}", [x, r, w], impls, 8 * T * D * es)


def case_layer_norm(T, D, dtype, device):
    from fuseforge.functional import layer_norm

    x, w, b = _rand((T, D), dtype, device), _rand((D,), dtype, device), _rand((D,), dtype, device)
    lg = _liger()
    impls = {
        "fuseforge": lambda: layer_norm(x, w, b, eps=EPS),
        "eager": lambda: ref_layer_norm(x, w, b),
        "compile": (lambda f: lambda: f(x, w, b))(_compiled(ref_layer_norm)),
    }
    if lg:
        impls["liger"] = lambda: lg.liger_layer_norm(x, w, b, EPS)
    return Case("layer_norm", f"{T}x{D}", [x, w, b], impls, 5 * T * D * x.element_size())


def _glu_case(name, ff_fn, ref_fn, liger_name, T, I, dtype, device):
    g, u = _rand((T, I), dtype, device, scale=2.0), _rand((T, I), dtype, device)
    lg = _liger()
    impls = {
        "fuseforge": lambda: ff_fn(g, u),
        "eager": lambda: ref_fn(g, u),
        "compile": (lambda f: lambda: f(g, u))(_compiled(ref_fn)),
    }
    if lg:
        impls["liger"] = lambda: getattr(lg, liger_name)(g, u)
    # fwd: read g, u; write out. bwd: read g, u, dout; write dg, du.
    return Case(name, f"{T}x{I}", [g, u], impls, 8 * T * I * g.element_size())


def case_swiglu(T, I, dtype, device):
    from fuseforge.functional import swiglu

    return _glu_case("swiglu", swiglu, ref_swiglu, "liger_swiglu", T, I, dtype, device)


def case_geglu(T, I, dtype, device):
    from fuseforge.functional import geglu

    return _glu_case("geglu", lambda g, u: geglu(g, u, approximate="tanh"), ref_geglu, "liger_geglu", T, I, dtype, device)


def case_rope(B, Hq, Hk, T, D, dtype, device):
    from fuseforge.functional import rope

    # Leaves in [B, T, H, D], used through a transpose: the non-contiguous layout HF attention produces.
    qb, kb = _rand((B, T, Hq, D), dtype, device), _rand((B, T, Hk, D), dtype, device)
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * torch.rand(D // 2, device=device)
    emb = torch.cat([angles, angles], dim=-1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    lg = _liger()
    impls = {
        "fuseforge": lambda: rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin),
        "eager": lambda: ref_rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin),
        "compile": (lambda f: lambda: f(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin))(_compiled(ref_rope)),
    }
    if lg:
        impls["liger"] = lambda: lg.liger_rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    nbytes = (qb.numel() + kb.numel()) * qb.element_size()
    return Case("rope", f"q{B}x{Hq}x{T}x{D},k{Hk}", [qb, kb], impls, 4 * nbytes, note="HF layout (transposed views)")


class _AsActivation(torch.autograd.Function):
    """A leaf's data seen as a non-leaf tensor (what a model's logits are: the output of lm_head),
    gradients passed through. Lets `inplace_grad=True` reuse the buffer, as it would in a model."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def case_cross_entropy(N, V, dtype, device):
    from fuseforge.functional import cross_entropy

    logits = _rand((N, V), dtype, device, scale=4.0)
    target = torch.randint(0, V, (N,), device=device)
    target[torch.rand(N, device=device) < 0.1] = -100
    lg = _liger()
    impls = {
        "fuseforge": lambda: cross_entropy(logits, target),
        "eager": lambda: ref_cross_entropy(logits, target),
        "compile": (lambda f: lambda: f(logits, target))(_compiled(ref_cross_entropy)),
    }
    if lg:
        impls["liger"] = lambda: lg.liger_cross_entropy(logits, target)
    # The gradient written over the logits, as in a model (Liger-Kernel always does this). Last:
    # from its first run on, the leaf holds gradients (Liger's runs overwrite it too).
    impls["fuseforge_inplace"] = lambda: cross_entropy(_AsActivation.apply(logits), target, inplace_grad=True)
    # read the logits once, write their gradient once.
    return Case("cross_entropy", f"{N}x{V}", [logits], impls, 2 * N * V * logits.element_size())


def case_jsd(N, V, dtype, device):
    from fuseforge.functional import jsd

    s = torch.log_softmax(torch.randn(N, V, device=device), -1).to(dtype).requires_grad_(True)
    t = torch.log_softmax(torch.randn(N, V, device=device), -1).to(dtype)
    lg = _liger()
    impls = {
        "fuseforge": lambda: jsd(s, t, beta=0.5),
        "eager": lambda: ref_jsd(s, t),
        "compile": (lambda f: lambda: f(s, t))(_compiled(ref_jsd)),
    }
    if lg:
        impls["liger"] = lambda: lg.liger_jsd(s, t, None, 0.5)
    return Case("jsd", f"{N}x{V}", [s], impls, 3 * N * V * s.element_size())


# op -> (builder, headline shape, sweep shapes)
OPS = {
    "rms_norm": (case_rms_norm, (16384, 4096), [(4096, 1024), (4096, 2048), (16384, 4096), (8192, 8192), (2048, 16384), (32768, 4096)]),
    "fused_add_rms_norm": (case_fused_add_rms_norm, (16384, 4096), [(4096, 2048), (16384, 4096), (2048, 16384)]),
    "layer_norm": (case_layer_norm, (16384, 4096), [(4096, 1024), (16384, 4096), (8192, 8192), (2048, 16384)]),
    "swiglu": (case_swiglu, (8192, 14336), [(1024, 5632), (4096, 11008), (8192, 14336), (16384, 28672)]),
    "geglu": (case_geglu, (8192, 14336), [(4096, 16384), (8192, 14336)]),
    "rope": (case_rope, (4, 32, 8, 2048, 128), [(1, 32, 8, 4096, 128), (4, 32, 8, 2048, 128), (2, 40, 8, 4096, 96), (8, 16, 16, 1024, 64)]),
    "cross_entropy": (case_cross_entropy, (8192, 128256), [(8192, 32000), (8192, 128256), (4096, 256000)]),
    "jsd": (case_jsd, (4096, 128256), [(4096, 32000), (4096, 128256)]),
}

SMOKE_SHAPES = {
    "rms_norm": (5, 96),
    "fused_add_rms_norm": (5, 96),
    "layer_norm": (5, 96),
    "swiglu": (5, 96),
    "geglu": (5, 96),
    "rope": (2, 4, 2, 6, 16),
    "cross_entropy": (6, 300),
    "jsd": (6, 300),
}


def _max_abs_err(impl_fwd, ref_fwd) -> float:
    with torch.no_grad():
        a, b = impl_fwd(), ref_fwd()
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def bench_case(case: Case, bandwidth: float, smoke: bool) -> list[Measurement]:
    rows = []
    floor_ms = case.min_bytes / bandwidth * 1e3
    for name, fwd in case.impls.items():
        m = Measurement(case.op, case.shape, name, floor_ms=None if smoke else floor_ms, note=case.note)
        run = fwd_bwd(fwd, case.leaves)
        try:
            run()  # compile / warm up; also catches API errors before timing
            if name != "eager":
                m.max_abs_err = _max_abs_err(fwd, case.impls["eager"])
            if not smoke:
                for t in case.leaves:  # the last run's grads would otherwise count as "before"
                    t.grad = None
                m.extra_mib = peak_extra_mib(run)
                m.ms = time_ms(run)
                try:
                    m.graph_ms = cuda_graph_ms(run)
                except Exception as exc:  # noqa: BLE001 - e.g. a host sync inside the op
                    m.note = (m.note + "; " if m.note else "") + f"no CUDA graph: {type(exc).__name__}"
                    torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - report a failing baseline, keep benchmarking the rest
            m.note = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        rows.append(m)
    for t in case.leaves:
        t.grad = None
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", action="append", choices=sorted(OPS), help="op(s) to run (default: all)")
    p.add_argument("--sweep", action="store_true", help="run each op over its sweep of sizes")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", help="write results and environment to this JSON file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, no timing: checks that every impl runs")
    args = p.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        p.error("timing needs a CUDA device; use --smoke on the CPU (with TRITON_INTERPRET=1)")
    torch._dynamo.config.cache_size_limit = 256
    env = environment()
    bandwidth = H200_COPY_BYTES_PER_S if args.smoke else measure_copy_bandwidth()
    env["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 2)
    print({k: v for k, v in env.items() if v is not None}, flush=True)

    rows: list[Measurement] = []
    for op in args.op or list(OPS):
        builder, headline, sweep = OPS[op]
        shapes = [SMOKE_SHAPES[op]] if args.smoke else (sweep if args.sweep else [headline])
        for shape in shapes:
            torch.manual_seed(0)
            case = builder(*shape, dtype, device)
            if args.smoke:
                case.impls.pop("compile", None)
            rows.extend(bench_case(case, bandwidth, args.smoke))
            del case
            if device == "cuda":
                torch.cuda.empty_cache()
            print(format_table([r for r in rows if r.op == op and r.shape == rows[-1].shape]), flush=True)
    print("\n## all results\n" + format_table(rows))
    return finish(rows, env, args.json)


if __name__ == "__main__":
    sys.exit(main())
