"""The platform's real data path against synthetic data, same model shape and engine, each in its own process.

    python benchmarks/bench_data_path.py --data .gpu/chat2048 --model llama-1b --batch 4 --seq 2048 --steps 30

`--data` is a directory written by `fuseforge_flyte.data.prepare` (tokenized, loss-masked, packed shards
with restarting position_ids) for `--seq`. Both runs go through `python -m fuseforge_flyte.training` with
the kernels on (bf16 autocast, DDP strategy on one GPU); the packed runs read their batches from the Arrow
shards and attend within each packed example only: through flex attention (the engine's choice on a GPU)
and, for comparison, through SDPA given the block-diagonal mask. Reports tokens/s (steady steps), the share of step
time spent getting batches onto the GPU, peak memory and losses, and the ratio packed / synthetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


# The engine's CLI with the attention used for packed rows chosen (engine.PACKED_ATTENTION).
_DRIVER = ("import sys; import fuseforge_flyte.training.engine as engine; engine.PACKED_ATTENTION = sys.argv.pop(1); "
           "from fuseforge_flyte.training.cli import main; sys.exit(main(sys.argv[1:]))")


def run(dataset: str, args, extra, packed_attention: str = "flex_attention") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "metrics.json")
        cmd = [sys.executable, "-c", _DRIVER, packed_attention, "--model", args.model, "--dataset", dataset,
               "--seq_len", str(args.seq), "--batch_size", str(args.batch), "--steps", str(args.steps),
               "--dtype", "bf16", "--log_every", "5", "--metrics_file", out, *extra]
        print("$", " ".join(cmd[3:]), f"(packed rows: {packed_attention})", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {
        "synthetic": run("bench:synthetic", args, []),
        "prepared": run(args.data, args, []),
        "prepared (sdpa+mask)": run(args.data, args, [], packed_attention="sdpa"),
        "prepared+eval+save": run(args.data, args, ["--eval_every", str(args.steps),
                                                     "--output_dir", tempfile.mkdtemp(prefix="ff-model-")]),
    }
    print(f"\n{'run':20s} {'tok/s':>10s} {'p50 ms':>8s} {'data wait':>10s} {'peak GiB':>9s} {'MFU':>6s} "
          f"{'loss0':>7s} {'lossN':>7s} {'eval':>7s}")
    for name, m in results.items():
        print(f"{name:20s} {m['tokens_per_s']:10.0f} {m['step_time_p50_s'] * 1e3:8.1f} "
              f"{m['data_wait_fraction'] * 100:9.2f}% {m['peak_memory_gib']:9.2f} {m['mfu'] * 100:5.1f}% "
              f"{m['loss_curve'][0]:7.3f} {m['final_loss']:7.3f} {m['eval_loss'] or float('nan'):7.3f}")
    ratio = results["prepared"]["tokens_per_s"] / results["synthetic"]["tokens_per_s"]
    print(f"\nprepared / synthetic tokens/s: {ratio:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "results": results, "ratio": ratio}, handle, indent=1)


if __name__ == "__main__":
    main()
