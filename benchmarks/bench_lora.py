"""LoRA / QLoRA training step: HF + peft (SDPA) vs Liger + peft vs fuseforge + peft, each at its best batch.

    python benchmarks/bench_lora.py --seq 2048                     # Llama-3-8B, r=16 on all linear layers, bf16 + NF4
    python benchmarks/bench_lora.py --seq 4096 --quant nf4         # QLoRA only
    python benchmarks/bench_lora.py --smoke                        # CPU, tiny model: checks the script end to end
    python benchmarks/bench_lora.py --seq 4096 --quant nf4 --libraries hf fuseforge --profile --timeout 150
                                                                   # + each best layout's top GPU kernels

Each (library, quantization) variant runs in its own subprocess (clean allocator: its peak memory is its own)
and searches its best layout: micro-batches of --batches, without activation checkpointing until one runs out
of memory, then with it (non-reentrant, every decoder layer) from there; each layout runs --warmup + --steps
optimizer steps (printed as it finishes: a variant killed at --timeout keeps the probes it finished), tokens/s from the median step. The best layout is the one with the most tokens/s; every probe
is printed and kept in the JSON.

Model: built from Llama-3-8B's config with random bf16 weights (no downloads), SDPA attention, no KV cache.
Adapters: peft LoRA r=16, alpha=16, dropout 0 on q/k/v/o/gate/up/down, in bf16 (`autocast_adapter_dtype=False`,
the same for every variant), AdamW (fused) over the adapters only. QLoRA ("nf4"): every frozen projection stored
as torchao NF4 (`fuseforge.transformers.lora.quantize_base_nf4`, block 64, double-quantized scalers, the LM head
kept bf16), for all three libraries alike. Variants:
  hf         transformers + peft as they ship
  liger      Liger-Kernel's instance patch of the Llama (RMSNorm, RoPE, SwiGLU, its fused linear cross-entropy),
             then peft
  fuseforge  peft, then `apply_kernels` on the PeftModel (norms, RoPE, SwiGLU, fused loss, fused LoRA linears)

Needs peft (the fused LoRA linear is verified against peft 0.21.2's source: another version runs peft's own
LoRA forward, and the table's note says so), torchao for nf4 and liger-kernel for liger; on the device carry
their wheels (`pip download --no-deps peft==0.21.2 torchao==0.18.0 liger-kernel==0.8.5` into .whl/, see
benchmarks/on_gpu.sh step `lora`). One invocation (one --seq, both quantizations, three libraries) is sized
to finish within 10 minutes on one H100/H200; --budget-s bounds each variant's probing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import PRESETS, print_kernel_profile  # noqa: E402 - the same Llama-3-8B shape as the others

LIBRARIES = ("hf", "liger", "fuseforge")
QUANTS = ("bf16", "nf4")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# --smoke: a model whose every projection NF4 can split into whole blocks (numel divisible by 64 * 256 / 16)
SMOKE_PRESET = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=256, vocab_size=1000)
SMOKE_NF4 = dict(block_size=16, scaler_block_size=8)


def build(args, device: str):
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    shape = SMOKE_PRESET if args.smoke else PRESETS[args.preset]
    config = transformers.LlamaConfig(**shape, max_position_embeddings=max(8192, args.seq), rope_theta=500000.0,
                                      tie_word_embeddings=False, use_cache=False)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.requires_grad_(False)
    notes = [f"peft {peft.__version__}"]
    library, quant = args.variant.split(":")
    if library == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, target_modules=TARGETS,
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    if quant == "nf4":
        from fuseforge.transformers.lora import quantize_base_nf4

        done = quantize_base_nf4(model, **(SMOKE_NF4 if args.smoke else {}))
        notes.append(f"{len(done)} NF4 weights")
    if library == "fuseforge":
        from fuseforge.transformers import apply_kernels

        report = apply_kernels(model)
        notes.append("fused: " + ", ".join(report.patched_kernels()))
        notes += [reason for reason in report.skipped.get("lora", [])][:1]
    return model, "; ".join(notes)


# --smoke only: batches of at least this size "run out of memory" without checkpointing (the CPU never does), so
# that the smoke run takes the checkpointing branch of the search too
FAKE_OOM_ENV = "FUSEFORGE_BENCH_FAKE_OOM"


def step_times(model, opt, batch: int, seq: int, vocab: int, steps: int, device: str) -> tuple[list, float]:
    import torch

    fake = os.environ.get(FAKE_OOM_ENV)
    if device == "cpu" and fake and batch >= int(fake) and not model.is_gradient_checkpointing:
        raise torch.OutOfMemoryError(f"{FAKE_OOM_ENV}={fake}: batch {batch} without checkpointing")

    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
    times, loss = [], float("nan")
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        loss = float(out.loss)
        del out
    return times, loss


def worker(args) -> dict:
    import torch

    device = "cpu" if args.smoke else "cuda"
    t_build = time.perf_counter()
    model, note = build(args, device)
    build_s = time.perf_counter() - t_build
    print("NOTE " + json.dumps({"note": note, "build_s": build_s}), flush=True)
    t0 = time.perf_counter()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
    vocab = model.config.vocab_size
    probes = []
    for ckpt in (False, True) if args.checkpointing == "search" else (True,):
        if ckpt:  # searching: only where a batch ran out of memory without it, from that batch on
            if args.checkpointing == "search" and not any(p.get("oom") for p in probes):
                break
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fitted = max((p["batch"] for p in probes if p.get("oom") is False), default=0)
        for batch in (b for b in args.batches if not ckpt or b > fitted):
            if time.perf_counter() - t0 > args.budget_s:
                probes.append({"batch": batch, "ckpt": ckpt, "skipped": "budget"})
                break
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                allocated_before = torch.cuda.memory_allocated() / 2**30
            try:
                times, loss = step_times(model, opt, batch, args.seq, vocab, args.warmup + args.steps, device)
            except torch.OutOfMemoryError:
                opt.zero_grad(set_to_none=True)
                probes.append({"batch": batch, "ckpt": ckpt, "oom": True})
                if device == "cuda":  # what the failed step left allocated (the model and optimizer state included)
                    torch.cuda.empty_cache()
                    probes[-1]["allocated_after_gib"] = torch.cuda.memory_allocated() / 2**30
                    probes[-1]["allocated_before_gib"] = allocated_before
                print("PROBE " + json.dumps(probes[-1]), flush=True)
                break
            measured = sorted(times[args.warmup:])
            median = measured[len(measured) // 2]
            peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
            probes.append({"batch": batch, "ckpt": ckpt, "oom": False, "step_ms": median * 1e3,
                           "tokens_per_s": batch * args.seq / median, "peak_gib": peak, "loss": loss})
            print("PROBE " + json.dumps(probes[-1]), flush=True)
    best = best_of(probes)
    if args.profile and best is not None and device == "cuda":  # where the best layout's step goes, kernel by kernel
        if best["ckpt"] != model.is_gradient_checkpointing:
            model.gradient_checkpointing_disable()
        ids = torch.randint(0, vocab, (best["batch"], args.seq), device=device)
        print_kernel_profile(model, opt, ids, args.variant)
    return {"variant": args.variant, "note": note, "build_s": build_s, "probes": probes, "best": best,
            "trainable": sum(p.numel() for p in params), "seconds": time.perf_counter() - t0}


def best_of(probes: list[dict]) -> dict | None:
    fitted = [p for p in probes if p.get("oom") is False]
    return max(fitted, key=lambda p: p["tokens_per_s"]) if fitted else None


def run_variant(args, variant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--preset", args.preset,
           "--seq", str(args.seq), "--rank", str(args.rank), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--budget-s", str(args.budget_s), "--checkpointing", args.checkpointing,
           "--batches", *map(str, args.batches)]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--profile"] if args.profile else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        stdout, stderr, why = proc.stdout, proc.stderr, None
    except subprocess.TimeoutExpired as exc:  # what it measured before the kill still counts
        stdout, stderr, why = _text(exc.stdout), _text(exc.stderr), f"killed after {args.timeout} s"
    if "PROFILE" in stdout:
        print(stdout[stdout.index("PROFILE"):].split("RESULT ")[0], flush=True)
    probes, note = [], {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        if line.startswith("PROBE "):
            probes.append(json.loads(line[len("PROBE "):]))
        if line.startswith("NOTE "):
            note = json.loads(line[len("NOTE "):])
    if probes:
        return {"variant": variant, "note": f"{note.get('note', '')}; {why}", "probes": probes,
                "best": best_of(probes)}
    tail = (stderr or stdout).strip().splitlines()[-4:]
    return {"variant": variant, "error": (why + ": " if why else "") + " / ".join(tail)[-400:]}


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def table(results: list[dict], args) -> str:
    shape = "tiny (smoke, CPU)" if args.smoke else args.preset
    lines = [f"\n{shape} LoRA r={args.rank} on {'/'.join(t.split('_')[0] for t in TARGETS)}, seq {args.seq}, "
             "bf16 adapters, AdamW over the adapters; best layout per variant (median step)",
             "| variant | best batch | ckpt | step ms | tokens/s | x hf | peak GiB | / hf | loss | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_quant = {r["variant"].split(":")[1]: r for r in results if r["variant"].startswith("hf:") and r.get("best")}
    for r in results:
        if "error" in r or not r.get("best"):
            lines.append(f"| {r['variant']} | {r.get('error', 'nothing fitted')} | | | | | | | | |")
            continue
        b, hf = r["best"], by_quant.get(r["variant"].split(":")[1])
        x = f"{b['tokens_per_s'] / hf['best']['tokens_per_s']:.2f}" if hf else "-"
        m = f"{b['peak_gib'] / hf['best']['peak_gib']:.2f}" if hf and hf["best"]["peak_gib"] else "-"
        lines.append(f"| {r['variant']} | {b['batch']} | {'on' if b['ckpt'] else 'off'} | {b['step_ms']:.1f} | "
                     f"{b['tokens_per_s']:.0f} | {x} | {b['peak_gib']:.2f} | {m} | {b['loss']:.3f} | {r['note']} |")
    lines += ["", "every probe (batch, checkpointing: tokens/s, peak GiB):"]
    for r in results:
        cells = []
        for p in r.get("probes", []):
            what = "OOM" if p.get("oom") else p.get("skipped") or f"{p['tokens_per_s']:.0f} tok/s, {p['peak_gib']:.1f}"
            if "allocated_after_gib" in p:  # an out-of-memory step that left memory behind says how much
                what += f" (allocated {p['allocated_before_gib']:.1f} -> {p['allocated_after_gib']:.1f} GiB)"
            cells.append(f"{p['batch']}{'+ckpt' if p['ckpt'] else ''}: {what}")
        lines.append(f"- {r['variant']}: " + ("; ".join(cells) or r.get("error", "")))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=LIBRARIES)
    p.add_argument("--quant", nargs="+", default=list(QUANTS), choices=QUANTS)
    p.add_argument("--batches", nargs="+", type=int, default=[2, 4, 8, 16, 32])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    # 6 variants x 90 s stays inside one 10-minute device call; --quant bf16 / nf4 apart give each more time
    p.add_argument("--budget-s", type=float, default=40.0,
                   help="probing time per variant after the model is built (a started probe finishes)")
    p.add_argument("--timeout", type=int, default=90, help="seconds per variant's process (its probes so far count)")
    p.add_argument("--checkpointing", choices=("search", "on"), default="search",
                   help="search: without activation checkpointing until a batch runs out of memory, then with it; "
                        "on: every batch with it (a fresh process, no earlier out-of-memory step)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, Triton interpreter: the script end to end")
    p.add_argument("--profile", action="store_true",
                   help="after the search, profile 2 steps of each variant's best layout (top GPU kernels)")
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.worker:
            args.batches, args.steps, args.warmup = args.batches[:2], min(args.steps, 2), 1
            args.timeout, args.budget_s = max(args.timeout, 400), max(args.budget_s, 120.0)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    variants = [f"{lib}:{q}" for q in args.quant for lib in args.libraries]
    results = []
    for variant in variants:
        results.append(run_variant(args, variant))
        print(f"{variant}: {json.dumps(results[-1].get('best') or results[-1].get('error'))}", flush=True)
    print(table(results, args))
    if args.json:
        from common import environment

        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "environment": environment(), "results": results}, f, indent=2)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
