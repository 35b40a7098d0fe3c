"""Supervised fine-tuning with TRL's SFTTrainer on fuseforge's fused kernels.

The integration is one line before the model is handed to the trainer (no callback):

    from fuseforge.transformers import apply_kernels
    apply_kernels(model)

One TRL detail: recent SFTTrainer versions log per-token entropy and accuracy computed
from `outputs.logits` during training. With fuseforge's fused linear cross-entropy the
training forward never builds the [tokens x vocab] logits (that is the memory saving),
so it returns `logits=None`; `FusedSFTTrainer` below is SFTTrainer minus those two
training metrics (evaluation still reports them). If you would rather keep them, pass
`apply_kernels(model, fused_linear_cross_entropy=False)` to the plain SFTTrainer: the
norm, RoPE and MLP kernels stay, logits are computed as usual.

Needs `pip install trl datasets` and a GPU (or TRITON_INTERPRET=1 and a lot of patience):

    python examples/sft_trainer.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/Capybara --max-steps 100
"""

from __future__ import annotations

import argparse

try:
    import datasets
    import trl
except ImportError as err:  # pragma: no cover - depends on the environment
    raise SystemExit(
        f"examples/sft_trainer.py needs TRL and datasets ({err.name} is not installed): "
        "pip install trl datasets. For a Trainer example without TRL see examples/hf_trainer.py."
    ) from None

import torch
import transformers

from fuseforge.transformers import apply_kernels


class FusedSFTTrainer(trl.SFTTrainer):
    """SFTTrainer that skips its logits-based training metrics when the fused loss returns no logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:  # eval: logits are computed, TRL's metrics work unchanged
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = {k: v for k, v in inputs.items() if k != "_prediction_loss_only"}
        inputs["use_cache"] = False  # as SFTTrainer does: no KV cache while training
        return transformers.Trainer.compute_loss(
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--dataset", default="trl-lib/Capybara")
    parser.add_argument("--output-dir", default="sft-fuseforge")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args(argv)

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    print(apply_kernels(model))  # <- the one line; prints what was fused

    trainer = FusedSFTTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=datasets.load_dataset(args.dataset, split="train"),
        args=trl.SFTConfig(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            max_length=args.max_length,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=4,
            bf16=dtype == torch.bfloat16,
            logging_steps=10,
            report_to=[],
        ),
    )
    trainer.train()


if __name__ == "__main__":
    main()
