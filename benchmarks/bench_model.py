"""End-to-end training-step benchmark of a Llama-style model: HF eager vs Liger-Kernel vs fuseforge vs torch.compile.

    python benchmarks/bench_model.py                              # the 1B-class default shape
    python benchmarks/bench_model.py --preset llama3-8b --batch 8 --seq 4096 --grad-ckpt
    python benchmarks/bench_model.py --variants eager fuseforge --json out.json
    python benchmarks/bench_model.py --variants liger fuseforge --profile   # + top GPU kernels per variant
    python benchmarks/bench_model.py --variants fuseforge fuseforge@256      # fused-loss chunks of 256 MiB

Each variant runs in its own subprocess (same script, `--worker`) so that its
peak memory is measured from a clean allocator; the parent prints one table.
Model weights are random (built from a config: no downloads). A step is
forward + backward + fused AdamW on bf16 parameters with SDPA attention;
tokens/s is batch*seq / median step time after warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PRESETS = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, vocab_size=128256),
    # Llama-1B's shape with 4 of its 16 layers (benchmarks/compile_check.py: torch.compile with the kernels)
    "llama-1b-4l": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, vocab_size=128256),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "qwen2-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936),
    # Qwen3-30B-A3B's shape (128 experts, 8 active, expert width 768) with 4 of its 48 layers
    "qwen3-moe-30b-a3b-4l": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                                 head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                 num_experts_per_tok=8, vocab_size=151936),
    # Qwen2.5-VL-7B's language model with 4 of its 28 layers (text-only batches: the vision tower stays idle)
    "qwen2.5-vl-7b-4l": dict(hidden_size=3584, num_hidden_layers=4, num_attention_heads=28, num_key_value_heads=4,
                             intermediate_size=18944, vocab_size=152064),
}
# A variant is a base, then "+"-joined modifiers, then "@<MiB>" for the fused loss's chunk:
#   eager | liger | fuseforge | fuseforge-loss (only the fused linear cross-entropy; norms, RoPE and MLPs left to
#   torch.compile to fuse with their neighbours)  +  compile (whole model) | compile-layers (each decoder layer, as
#   the platform's `compile` input) | fp8 (torchao float8 linears; with compile-layers as the platform does) |
#   hf-add (fuseforge with HF's decoder-layer forward put back: the A/B of the residual add fused into the norm).
BASES = ("eager", "liger", "fuseforge", "fuseforge-loss")
MODIFIERS = ("compile", "compile-layers", "fp8", "hf-add")
VARIANTS = ("eager", "liger", "fuseforge", "compile", "fuseforge+compile", "fuseforge+fp8")


def build_model(preset: str, family: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "qwen2_5_vl":  # the image-text model: its language model trains on text-only batches
        text = dict(PRESETS[preset], max_position_embeddings=8192, rope_theta=1000000.0, tie_word_embeddings=False,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
        config = transformers.Qwen2_5_VLConfig(text_config=text, tie_word_embeddings=False)
        with torch.device("cuda"):
            return transformers.AutoModelForImageTextToText.from_config(config, torch_dtype=torch.bfloat16,
                                                                        attn_implementation="sdpa")
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    # use_cache=False, as for training (the engine does the same): no KV cache built in every forward
    config = cfg_cls(**PRESETS[preset], max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                     use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return model


def parse_variant(variant: str) -> tuple[str, tuple[str, ...], int | None]:
    """"fuseforge+compile@256" -> ("fuseforge", ("compile",), 256); a bare modifier means the eager base."""
    spec, _, chunk_mib = variant.partition("@")
    parts = spec.split("+")
    base = "eager" if parts[0] in MODIFIERS else parts[0]
    modifiers = tuple(parts if parts[0] in MODIFIERS else parts[1:])
    bad = (base not in BASES or any(m not in MODIFIERS for m in modifiers) or len(set(modifiers)) < len(modifiers)
           or {"compile", "compile-layers"} <= set(modifiers) or (chunk_mib and not chunk_mib.isdigit())
           or (chunk_mib and not base.startswith("fuseforge")) or ("hf-add" in modifiers and base != "fuseforge"))
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown variant {variant!r}: a base of {BASES}, then +modifiers of {MODIFIERS}, then @<MiB> for fuseforge")
    return base, modifiers, int(chunk_mib) if chunk_mib else None


def variant_arg(variant: str) -> str:
    """argparse `type=` for a --variants entry: the text, once parse_variant accepts it."""
    parse_variant(variant)
    return variant


def apply_variant(model, variant: str):
    import torch

    base, modifiers, chunk_mib = parse_variant(variant)
    if chunk_mib is not None:
        from fuseforge.ops import fused_linear_cross_entropy as flce

        flce.DEFAULT_CHUNK_BYTES = chunk_mib * 2**20
    notes = []
    if base == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif base.startswith("fuseforge"):  # compiled, the fused ops run as fuseforge::* custom ops inside the graph
        from fuseforge.transformers import apply_kernels

        only_loss = dict(rms_norm=False, layer_norm=False, rope=False, swiglu=False) if base == "fuseforge-loss" else {}
        report = apply_kernels(model, **only_loss)
        notes.append("fused: " + ", ".join(sorted(set(report.patched_kernels()))))
    if "hf-add" in modifiers:
        from fuseforge.transformers._swap import restore
        from fuseforge.transformers.layers import ResidualFusedDecoderLayer

        layers = [m for m in model.modules() if isinstance(m, ResidualFusedDecoderLayer)]
        notes.append(f"HF's residual add in {sum(restore(m) for m in layers)} decoder layers")
    if "fp8" in modifiers:
        from fuseforge_flyte.training.fp8 import convert_to_fp8

        notes.append(f"fp8 linears: {len(convert_to_fp8(model))}")
    if "compile" in modifiers:
        model = torch.compile(model)
    elif "compile-layers" in modifiers or "fp8" in modifiers:  # fp8 needs compiled casts to pay off
        from fuseforge_flyte.training.compilation import compile_layers

        notes.append(f"compiled layers: {compile_layers(model)}")
    model._bench_note = "; ".join(notes)
    return model


def worker(args) -> dict:
    import torch

    model = build_model(args.preset, args.family)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model = apply_variant(model, args.variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    vocab = PRESETS[args.preset]["vocab_size"]
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), device="cuda", generator=g) for _ in range(4)]

    times, losses, first_step_s = [], [], None
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        ids = batches[step % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step == 0:  # includes torch.compile's compilation for the compiled variants
            first_step_s = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(out.loss))
        del out
    if args.profile:
        print_kernel_profile(model, opt, batches[0], args.variant)
    times.sort()
    median = times[len(times) // 2]
    return {
        "note": getattr(model, "_bench_note", ""),
        "variant": args.variant,
        "step_ms": median * 1e3,
        "first_step_s": first_step_s,
        "tokens_per_s": args.batch * args.seq / median,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_loss": losses[0],
        "dynamo": dynamo_stats(),
        "last_loss": losses[-1],
    }


def dynamo_stats() -> dict:
    """torch.compile's frame and graph counts: more graphs than expected means recompiles (or breaks)."""
    from torch._dynamo.utils import counters

    return {"stats": dict(counters["stats"]), "graph_break": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values())} if counters else {}


def print_kernel_profile(model, opt, ids, variant: str, steps: int = 2, rows: int = 25) -> None:
    """GPU time per kernel over `steps` training steps: where a variant's step time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    # Kernel time summed over the step against its wall time: the gap is the GPU waiting for the host.
    busy_ms = sum(getattr(e, "self_device_time_total", 0) for e in averages) / 1e3 / steps
    launches = sum(e.count for e in averages if getattr(e, "self_device_time_total", 0) > 0) / steps
    print(f"PROFILE {variant} ({steps} steps): GPU busy {busy_ms:.1f} ms of {wall_ms:.1f} ms wall per step, "
          f"{launches:.0f} kernels per step\n{table}", flush=True)


def run_variant(args, variant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--preset", args.preset,
           "--family", args.family, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup)] + (["--grad-ckpt"] if args.grad_ckpt else []) + (["--profile"] if args.profile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if args.profile and "PROFILE" in proc.stdout:
        print(proc.stdout[proc.stdout.index("PROFILE"):].split("RESULT ")[0], flush=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    oom = any("OutOfMemory" in l or "out of memory" in l for l in (proc.stderr or "").splitlines())
    return {"variant": variant, "error": "OOM" if oom else " / ".join(tail)[-300:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b", choices=sorted(PRESETS))
    p.add_argument("--family", default="llama", choices=["llama", "qwen2", "qwen3_moe", "qwen2_5_vl"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=variant_arg, help=f"e.g. {VARIANTS}, fuseforge-loss+compile, fuseforge+compile-layers; @<MiB> sets the loss chunk")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--profile", action="store_true", help="print each variant's top GPU kernels (torch.profiler)")
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0

    results = [run_variant(args, v) for v in args.variants]
    base = next((r for r in results if r["variant"] == "eager" and "error" not in r), None)
    liger = next((r for r in results if r["variant"] == "liger" and "error" not in r), None)
    print(f"\n{args.preset} batch {args.batch} x seq {args.seq}, bf16, AdamW(fused), SDPA, grad ckpt {args.grad_ckpt}")
    print("| variant | step ms | tokens/s | x eager | x liger | peak GiB | loss first -> last |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | {r['error']} | | | | | |")
            continue
        xe = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        xl = f"{r['tokens_per_s'] / liger['tokens_per_s']:.2f}" if liger else "-"
        print(f"| {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {xe} | {xl} | {r['peak_gib']:.2f} | "
              f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} |" + (f" {r['note']}" if r.get("note") else "")
              + (f" dynamo {r['dynamo']}" if r.get("dynamo", {}).get("stats") else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
