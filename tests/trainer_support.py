"""What the Trainer/TRL tests share: the shipped tiny tokenizer and a tiny Llama sized to it."""

from __future__ import annotations

import pytest
import torch
import transformers

from fuseforge_flyte.data.tokenizer import load_tokenizer


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
