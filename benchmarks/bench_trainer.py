"""A user's `transformers.Trainer` SFT through `@training_task`, with and without fuseforge's kernels.

Runs examples/flyte/trainer_sft.py's task twice through the decorator's local path (one elastic node of
min([elastic].local_nproc_per_node, GPUs) workers, a fresh process group each run, so each run's peak
memory starts from a clean allocator), then prints both TrainMetrics and the ratios, and writes JSON.

    python benchmarks/bench_trainer.py --out trainer.json                 # Llama-3.2-1B shape, one GPU
    python benchmarks/bench_trainer.py --workers 8 --batch-size 8 --out trainer8.json
    TRITON_INTERPRET=1 python benchmarks/bench_trainer.py --quick --out quick.json   # CPU smoke run

The model is the fuseforge preset "llama-1b" (Llama-3.2-1B's shape and vocabulary, random weights: no
download); the data are the shipped tiny chat conversations joined into multi-turn conversations of about
--seq-len tokens (tokenized with the shipped tiny BPE), loss on the assistant turns. bf16 on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "flyte"


def long_conversations(count: int, seq_len: int, seed: int = 0) -> list:
    """`count` conversations of at least seq_len tokens each (truncated to seq_len: one shape every step), made of the shipped ones in a seeded order."""
    from fuseforge_flyte.data.builtin import CHAT_FILE, asset_path
    from fuseforge_flyte.data.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:tiny-bpe", "")
    with open(asset_path(CHAT_FILE), encoding="utf-8") as fh:
        chats = [json.loads(line)["messages"] for line in fh if line.strip()]
    lengths = [len(tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) for c in chats]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages, tokens = [], 0
        while tokens < seq_len * 1.25:  # margin for the dropped system turns: every row truncates to seq_len
            i = rng.randrange(len(chats))
            messages += [m for m in chats[i] if m["role"] != "system"]
            tokens += lengths[i]
        out.append({"messages": messages})
    return out


def ratios(with_kernels, without) -> dict:
    def ratio(a: float, b: float):
        return a / b if b else None

    return {
        "tokens_per_s": ratio(with_kernels.tokens_per_s, without.tokens_per_s),
        "step_time_p50": ratio(with_kernels.step_time_p50_s, without.step_time_p50_s),
        "peak_memory": ratio(with_kernels.peak_memory_gib, without.peak_memory_gib),
        "mfu": ratio(with_kernels.mfu, without.mfu),
        "final_loss_difference": with_kernels.final_loss - without.final_loss,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, 3 steps of 64 tokens (CPU)")
    parser.add_argument("--model", default=None, help='default "llama-1b" ("tiny-llama" with --quick)')
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 60; 3 with --quick)")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker (default 4; 2 with --quick)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048 (64 with --quick)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--fp32-weights", action="store_true",
                        help="fp32 weights under bf16 autocast (the engine's precision) instead of bf16 weights")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=None,
                        help="[elastic].local_nproc_per_node for this run (default: platform.toml's, capped at the GPUs)")
    parser.add_argument("--out", type=Path, help="write both metrics and the ratios here as JSON")
    args = parser.parse_args(argv)
    model = args.model or ("tiny-llama" if args.quick else "llama-1b")
    steps = args.steps or (3 if args.quick else 60)
    batch = args.batch_size or (2 if args.quick else 4)
    seq_len = args.seq_len or (64 if args.quick else 2048)
    if args.workers is not None:  # read when the example's task is defined, i.e. imported below
        os.environ["FUSEFORGE__ELASTIC__LOCAL_NPROC_PER_NODE"] = str(args.workers)

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(EXAMPLES))
    import trainer_sft  # noqa: E402  (the user's file, exactly as `pyflyte run` would use it)

    from fuseforge_flyte.config import get_config

    workers = get_config().elastic.local_nproc_per_node
    if torch.cuda.is_available():
        workers = min(workers, torch.cuda.device_count())
    data_dir = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    data = data_dir / "long_chats.jsonl"
    rows = long_conversations(steps * batch * args.grad_accum * workers, seq_len)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    settings = dict(model=model, dataset=str(data), steps=steps, batch_size=batch, grad_accum=args.grad_accum,
                    fp32_weights=args.fp32_weights,
                    seq_len=seq_len, lr=args.lr)
    results = {}
    for kernels in (False, True):
        print(f"=== {model}: {'fuseforge kernels' if kernels else 'no kernels'}", flush=True)
        results[kernels] = trainer_sft.sft(kernels=kernels, **settings)  # the task's local path: elastic workers
        print(results[kernels], flush=True)
    r = ratios(results[True], results[False])
    print(f"\nkernels / no kernels: tokens/s x{r['tokens_per_s']:.3f}   step p50 x{r['step_time_p50']:.3f}   "
          f"peak memory x{r['peak_memory']:.3f}   final loss {r['final_loss_difference']:+.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "settings": dict(settings, dataset="shipped tiny chat joined to ~seq_len tokens", workers=workers,
                             device=results[True].device),
            "without_kernels": dataclasses.asdict(results[False]),
            "with_kernels": dataclasses.asdict(results[True]),
            "ratios": r,
        }, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
