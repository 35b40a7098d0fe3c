"""Train a causal LM with `transformers.Trainer` on fuseforge's fused kernels.

The integration is one line, before the model is handed to the Trainer (no callback):

    from fuseforge.transformers import apply_kernels
    apply_kernels(model)

or, on the built trainer, `apply_kernels(trainer)`: the same for a plain Trainer, and the
form to use with TRL's trainers (examples/sft_trainer.py), which it adapts as well.

Norms, RoPE and the gated MLP then run as fused Triton kernels, and the training loss
is computed by fused linear cross-entropy straight from the last hidden states: the
[tokens x vocab] logits are never materialised, so training outputs carry
`logits=None`. Evaluation (eval mode) and generation still get normal logits.
Gradient accumulation is exact: the Trainer's `num_items_in_batch` reaches the kernel.

By default this builds a tiny Llama from a config and trains it for a few steps on
generated data, so it runs anywhere: on a GPU as is, on a CPU through Triton's
interpreter (set automatically below; a few seconds per step). For a real model:

    python examples/hf_trainer.py --model meta-llama/Llama-3.2-1B --steps 200 --seq-len 2048 --bf16
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

if not torch.cuda.is_available():  # must happen before fuseforge's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

from fuseforge.transformers import apply_kernels  # noqa: E402

TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=128,
)


class CountingDataset(torch.utils.data.Dataset):
    """Sequences that count up through a few token ids with a per-row stride: quick to learn."""

    def __init__(self, size: int, seq_len: int, span: int = 61, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, span, (size, 1), generator=g)
        stride = torch.randint(1, 4, (size, 1), generator=g)
        self.input_ids = 3 + (start + stride * torch.arange(seq_len)) % span

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.input_ids[i]
        labels = ids.clone()
        labels[:4] = -100  # a "prompt" the loss ignores, as in supervised fine-tuning
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def build_model(name: str | None, bf16: bool) -> transformers.PreTrainedModel:
    dtype = torch.bfloat16 if bf16 else torch.float32
    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LLAMA)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def train(model, steps: int, seq_len: int, output_dir: str, bf16: bool = False, seed: int = 0):
    """Run Trainer for `steps` optimizer steps (2 micro-batches each); returns the Trainer."""
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        seed=seed,
        data_seed=seed,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=CountingDataset(4 * steps, seq_len, seed=seed),
        eval_dataset=CountingDataset(4, seq_len, seed=seed + 1),
    )
    trainer.train()
    return trainer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hub id or path (default: a tiny Llama built from a config)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--no-kernels", action="store_true", help="train the unpatched model, for comparison")
    args = parser.parse_args(argv)

    model = build_model(args.model, args.bf16)
    if not args.no_kernels:
        print(apply_kernels(model))  # <- the one line; prints what was fused
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = train(model, args.steps, args.seq_len, output_dir, bf16=args.bf16)
        losses = [round(log["loss"], 4) for log in trainer.state.log_history if "loss" in log]
        print("training losses:", losses)
        print("eval:", trainer.evaluate())  # eval mode: logits are computed as usual


if __name__ == "__main__":
    main()
