"""Your own `transformers.Trainer` SFT as a fuseforge training task: fused kernels on, metrics and Deck back.

Locally (CPU: 2 worker processes, gloo, Triton's interpreter; GPUs: one worker per GPU, up to
[elastic].local_nproc_per_node), a tiny Llama built in code on the shipped tiny chat set:

    pyflyte run examples/flyte/trainer_sft.py sft_workflow
    pyflyte run examples/flyte/trainer_sft.py sft_workflow --steps 8 --no-kernels

On the cluster (image, GPUs, CPU, memory, /dev/shm, tolerations, elastic settings from platform.toml,
or the overrides in `@training_task(...)` below), a real model and a hub dataset:

    pyflyte run --remote examples/flyte/trainer_sft.py sft_workflow \
        --model meta-llama/Llama-3.2-1B-Instruct --dataset HuggingFaceH4/ultrachat_200k --split train_sft \
        --tokenizer "" --steps 500 --batch_size 8 --seq_len 2048

The workers import this file's module again (spawn start method): the task puts the file's directory on
their path, so the file runs as written wherever it lives; --remote ships it to the pod.
"""

from __future__ import annotations

import json
import os
import tempfile

from flytekit import workflow

from fuseforge_flyte import training_task
from fuseforge_flyte.training.spec import TrainMetrics

# A tiny Llama for CPU runs and tests; other names load a Hugging Face model (or a fuseforge preset shape).
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)


def load_chat(dataset: str, split: str):
    """A datasets.Dataset with a "messages" column: the shipped tiny chat set (""), a local .jsonl, or a hub id."""
    import datasets

    if not dataset:
        from fuseforge_flyte.data.builtin import CHAT_FILE, asset_path

        dataset = asset_path(CHAT_FILE)
    if os.path.isfile(dataset):  # read in memory: no datasets cache shared by the workers
        with open(dataset, encoding="utf-8") as fh:
            return datasets.Dataset.from_list([json.loads(line) for line in fh if line.strip()])
    return datasets.load_dataset(dataset, split=split)


def tokenize_chat(tokenizer, messages, seq_len: int) -> dict:
    """Chat template, truncated to seq_len; the loss only on the assistant's tokens (the template's
    {% generation %} blocks)."""
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    ids = list(encoded["input_ids"])[:seq_len]
    keep = list(encoded["assistant_masks"])[:seq_len]
    return {"input_ids": ids, "attention_mask": [1] * len(ids),
            "labels": [t if m else -100 for t, m in zip(ids, keep)]}


def load_model(name: str, vocab_size: int, bf16: bool):
    import torch
    import transformers

    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)  # the same random init on every rank (DDP broadcasts rank 0's anyway) and every run
    if name == "tiny-llama":
        config = transformers.LlamaConfig(**TINY_LLAMA, vocab_size=vocab_size)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    from fuseforge_flyte.model_names import PRESETS, load_config

    if name in PRESETS:  # a public model's shape with random weights (benchmarks), its own vocabulary
        config = load_config(name)
        config.vocab_size = max(config.vocab_size, vocab_size)  # room for every token id of the tokenizer
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype)


# For a cluster, set this task's size here, e.g. @training_task(gpus=8, nnodes=2, memory="900Gi");
# without arguments it is platform.toml's [cluster] and [elastic].
@training_task
def sft(model: str = "tiny-llama", dataset: str = "", split: str = "train", tokenizer: str = "builtin:tiny-bpe",
        steps: int = 4, batch_size: int = 2, grad_accum: int = 1, seq_len: int = 64, lr: float = 3e-3,
        kernels: bool = True, fp32_weights: bool = False) -> TrainMetrics:
    """Supervised fine-tuning with transformers.Trainer on every worker; rank 0's metrics come back.

    On a GPU the weights and optimizer state are bf16 (least memory); fp32_weights keeps fp32 weights and
    runs under bf16 autocast (mixed precision, as fuseforge's own engine does)."""
    import torch
    import transformers

    from fuseforge_flyte.data.tokenizer import load_tokenizer
    from fuseforge_flyte.measure import FuseforgeMetricsCallback

    cuda = torch.cuda.is_available()
    tok = load_tokenizer(tokenizer, model)  # "" = the model's own tokenizer
    train = load_chat(dataset, split)
    train = train.map(lambda ex: tokenize_chat(tok, ex["messages"], seq_len), remove_columns=train.column_names)
    net = load_model(model, len(tok), bf16=cuda and not fp32_weights)
    if kernels:
        from fuseforge.transformers import apply_kernels  # imported in the worker: Triton's mode is set by now

        apply_kernels(net)
    callback = FuseforgeMetricsCallback(dataset=dataset or "builtin:chat", model_name=model)
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="sft-"), max_steps=steps, per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, learning_rate=lr, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], bf16=cuda, use_cpu=not cuda, dataloader_num_workers=0, seed=0,
        ddp_find_unused_parameters=False,
    )
    collator = transformers.DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    trainer = transformers.Trainer(model=net, args=args, train_dataset=train, data_collator=collator,
                                   processing_class=tok, callbacks=[callback])
    trainer.train()
    return callback.metrics()


@workflow
def sft_workflow(model: str = "tiny-llama", dataset: str = "", split: str = "train",
                 tokenizer: str = "builtin:tiny-bpe", steps: int = 4, batch_size: int = 2, grad_accum: int = 1,
                 seq_len: int = 64, lr: float = 3e-3, kernels: bool = True) -> TrainMetrics:
    return sft(model=model, dataset=dataset, split=split, tokenizer=tokenizer, steps=steps, batch_size=batch_size,
               grad_accum=grad_accum, seq_len=seq_len, lr=lr, kernels=kernels)
