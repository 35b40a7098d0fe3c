"""Measurement helpers shared by every benchmark script: timing, memory, floors, tables.

Timing is the median of `triton.testing.do_bench` (which flushes L2 between
repetitions, so each repetition reads from HBM). Memory is the peak of
`torch.cuda.max_memory_allocated` over one forward+backward, minus what was
allocated before it (the inputs), so it counts activations, temporaries and the
gradient outputs alike for every implementation.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

# Device-to-device copy rate measured on the H200 (bytes read + written per second).
# `measure_copy_bandwidth()` re-measures it in the run; this is only the fallback.
H200_COPY_BYTES_PER_S = 4.3e12


@dataclass
class Measurement:
    op: str
    shape: str
    impl: str
    ms: Optional[float] = None
    graph_ms: Optional[float] = None  # the same step replayed from a CUDA graph: GPU time without host launch cost
    extra_mib: Optional[float] = None
    floor_ms: Optional[float] = None
    max_abs_err: Optional[float] = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def environment() -> dict:
    """GPU, library versions and host facts recorded next to every result."""
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    for mod in ("triton", "transformers", "liger_kernel", "cut_cross_entropy"):
        try:
            m = importlib.import_module(mod)
            info[mod] = getattr(m, "__version__", "installed")
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            info[mod] = None
    if info.get("liger_kernel") == "installed":
        try:
            from importlib.metadata import version

            info["liger_kernel"] = version("liger-kernel")
        except Exception:  # noqa: BLE001
            pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sms"] = props.multi_processor_count
        info["cuda"] = torch.version.cuda
    return info


def measure_copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Bytes (read + written) per second of a large device-to-device copy: the memory-bound ceiling."""
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    del src, dst
    return nbytes / (ms * 1e-3)


def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of `fn` over `rep` ms of repetitions (L2 flushed between them)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def cuda_graph_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median ms of `fn` captured once in a CUDA graph and replayed.

    On a VM where each launch costs tens of microseconds of host time, do_bench of a
    small op measures the host; the replay shows what the kernels themselves cost.
    Raises if `fn` cannot be captured: a host sync (e.g. `.item()`) is detected in a plain
    run first, so that a doomed capture never leaves the CUDA context in a bad state.
    """
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return time_ms(graph.replay, warmup=warmup, rep=rep)
    finally:
        del graph


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak memory (MiB) allocated while `fn` runs once, above what was allocated before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (peak - before) / 2**20


def fwd_bwd(forward: Callable[[], torch.Tensor | tuple], leaves: list[torch.Tensor], grads: list | None = None):
    """Return a closure running forward + backward once, clearing leaf grads first (it returns the outputs).

    Without `grads`, the upstream gradients are drawn once on the first call (random, ones for a
    scalar loss) and reused: filling a fresh [tokens, hidden] tensor on every call would add a
    write of the output's size to every implementation's time.
    """
    upstream = grads

    def run():
        nonlocal upstream
        for t in leaves:
            t.grad = None
        out = forward()
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if upstream is None:  # seeded: every implementation of a case gets the same upstream gradients
            gen = torch.Generator(outs[0].device).manual_seed(1234)
            # empty_like keeps each output's strides (e.g. RoPE's transposed views), as a model's backward would.
            upstream = [torch.ones_like(o) if o.numel() == 1 else torch.empty_like(o).normal_(generator=gen) for o in outs]
        torch.autograd.backward(outs, upstream)
        return outs

    return run


def format_table(rows: list[Measurement], baseline: str = "eager") -> str:
    """Markdown table with each implementation's time and memory and its ratio to `baseline`."""
    base = {(r.op, r.shape): r for r in rows if r.impl == baseline}
    lines = [
        "| op | shape | impl | ms | x vs eager | graph ms | graph x vs eager | floor ms | graph % of floor | extra MiB | max abs err | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get((r.op, r.shape))
        speed = f"{b.ms / r.ms:.2f}" if (b and b.ms and r.ms) else "-"
        gspeed = f"{b.graph_ms / r.graph_ms:.2f}" if (b and b.graph_ms and r.graph_ms) else "-"
        pct = f"{100 * r.floor_ms / r.graph_ms:.0f}%" if (r.graph_ms and r.floor_ms) else "-"
        lines.append(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r.op,
                r.shape,
                r.impl,
                f"{r.ms:.3f}" if r.ms is not None else "n/a",
                speed,
                f"{r.graph_ms:.3f}" if r.graph_ms is not None else "n/a",
                gspeed,
                f"{r.floor_ms:.3f}" if r.floor_ms else "-",
                pct,
                f"{r.extra_mib:.1f}" if r.extra_mib is not None else "n/a",
                f"{r.max_abs_err:.2e}" if r.max_abs_err is not None else "-",
                r.note,
            )
        )
    return "\n".join(lines)


def write_json(path: str, rows: list[Measurement], env: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": env, "results": [asdict(r) for r in rows]}, f, indent=2)


def finish(rows: list[Measurement], env: dict, json_path: str | None) -> int:
    """Write the JSON report when asked; the exit status is 1 when any fuseforge measurement failed."""
    if json_path:
        write_json(json_path, rows, env)
    failed = [r for r in rows if r.impl == "fuseforge" and r.note.startswith("failed")]
    return 1 if failed else 0


def try_import(name: str):
    """Import an optional baseline library; None when it is not installed or fails to import."""
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001
        return None
