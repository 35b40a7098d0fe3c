"""Supervised fine-tuning with TRL's SFTTrainer on fuseforge's fused kernels.

The integration is one line on the built trainer (no subclass, no callback):

    from fuseforge.transformers import apply_kernels
    apply_kernels(trainer)

It patches `trainer.model` (norms, RoPE, gated MLP, and the fused linear cross-entropy
loss) and adapts the trainer: training steps take the model's fused loss, which never
builds the [tokens x vocab] logits. SFTTrainer's two logits-statistics training metrics,
`entropy` and `mean_token_accuracy`, are then not logged (one warning says so; evaluation
still reports them). `apply_kernels(trainer, fused_linear_cross_entropy=False)` keeps
them: the norm, RoPE and MLP kernels stay and the loss comes from TRL's own fused LM head.
The same call works for DPOTrainer, KTOTrainer, GRPOTrainer, ...: those compute their loss
themselves, so their models get the layer kernels without the fused loss.

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

    trainer = trl.SFTTrainer(
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
    print(apply_kernels(trainer))  # <- the one line; prints what was fused and what the trainer changed
    trainer.train()


if __name__ == "__main__":
    main()
