"""Your own TRL `SFTTrainer` run as a fuseforge training task: fused kernels on, metrics and Deck back.

Locally (CPU: 2 worker processes, gloo, Triton's interpreter; GPUs: one worker per GPU, up to
[elastic].local_nproc_per_node), a tiny Llama built in code on the shipped tiny chat set:

    pyflyte run examples/flyte/trl_sft.py trl_workflow
    pyflyte run examples/flyte/trl_sft.py trl_workflow --steps 8 --no-kernels

On the cluster (platform.toml's image and resources, or the overrides in `@training_task(...)`), with
a real model and a conversational hub dataset ("messages" column):

    pyflyte run --remote examples/flyte/trl_sft.py trl_workflow \
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/Capybara --tokenizer "" \
        --steps 500 --batch_size 8 --seq_len 2048

Needs TRL (`pip install trl`; tested with 1.16.0): add it to platform.toml's [image].extra_packages
for the cluster image. The workers import this file's module again (spawn start method): the task puts
the file's directory on their path, so the file runs as written; --remote ships it to the pod.
"""

from __future__ import annotations

import json
import os
import tempfile

from flytekit import workflow

from fuseforge_flyte import training_task
from fuseforge_flyte.training.spec import TrainMetrics

# A tiny Llama for CPU runs and tests; other names load a Hugging Face model.
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


def load_model(name: str, vocab_size: int, bf16: bool):
    import torch
    import transformers

    dtype = torch.bfloat16 if bf16 else torch.float32
    if name == "tiny-llama":
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**TINY_LLAMA, vocab_size=vocab_size)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype)


def sft_config(output_dir: str, steps: int, batch_size: int, grad_accum: int, seq_len: int, lr: float, cuda: bool):
    """TRL's settings: conversational data, loss on the assistant's turns only, padded batches."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, learning_rate=lr, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], bf16=cuda, use_cpu=not cuda, dataloader_num_workers=0, seed=0,
        max_length=seq_len, assistant_only_loss=True, packing=False, ddp_find_unused_parameters=False,
    )


# For a cluster, set this task's size here, e.g. @training_task(gpus=8, memory="900Gi", max_restarts=1);
# without arguments it is platform.toml's [cluster] and [elastic].
@training_task
def trl_sft(model: str = "tiny-llama", dataset: str = "", split: str = "train", tokenizer: str = "builtin:tiny-bpe",
            steps: int = 4, batch_size: int = 2, grad_accum: int = 1, seq_len: int = 64, lr: float = 3e-3,
            kernels: bool = True) -> TrainMetrics:
    """SFT with TRL's SFTTrainer on every worker; rank 0's metrics come back."""
    import torch
    from trl import SFTTrainer

    from fuseforge_flyte.data.tokenizer import load_tokenizer
    from fuseforge_flyte.measure import FuseforgeMetricsCallback

    cuda = torch.cuda.is_available()
    tok = load_tokenizer(tokenizer, model)  # "" = the model's own tokenizer
    net = load_model(model, len(tok), bf16=cuda)
    callback = FuseforgeMetricsCallback(dataset=dataset or "builtin:chat", model_name=model)
    trainer = SFTTrainer(model=net, args=sft_config(tempfile.mkdtemp(prefix="trl-"), steps, batch_size, grad_accum,
                                                    seq_len, lr, cuda),
                         train_dataset=load_chat(dataset, split), processing_class=tok, callbacks=[callback])
    if kernels:
        from fuseforge.transformers import apply_kernels  # imported in the worker: Triton's mode is set by now

        apply_kernels(trainer)  # the one-line trainer switch: patches trainer.model, adapts SFTTrainer's loss
    trainer.train()
    return callback.metrics()


@workflow
def trl_workflow(model: str = "tiny-llama", dataset: str = "", split: str = "train",
                 tokenizer: str = "builtin:tiny-bpe", steps: int = 4, batch_size: int = 2, grad_accum: int = 1,
                 seq_len: int = 64, lr: float = 3e-3, kernels: bool = True) -> TrainMetrics:
    return trl_sft(model=model, dataset=dataset, split=split, tokenizer=tokenizer, steps=steps,
                   batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len, lr=lr, kernels=kernels)
