"""What the Trainer/TRL tests share: the shipped tiny tokenizer, a tiny Llama sized to it, and the
training arguments of a short, deterministic, logged-every-step run."""

from __future__ import annotations

import pytest
import torch
import transformers

from fuseforge_flyte.data.tokenizer import load_tokenizer


USE_CPU = not torch.cuda.is_available()  # on the CPU the kernels run through Triton's interpreter


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:tiny-bpe", "")


def tiny_llama(tokenizer, *, hidden_size: int = 64) -> transformers.LlamaForCausalLM:
    """Seeded, 2 layers, grouped-query attention, the tokenizer's vocabulary and special ids."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return transformers.LlamaForCausalLM(config)


def common_args(tmp_path, **overrides) -> dict:
    """TrainingArguments (and TRL configs) of a 2-step, seeded, CPU-or-GPU run logged every step."""
    args = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=USE_CPU,
        bf16=False,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    return {**args, **overrides}
