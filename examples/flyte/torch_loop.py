"""Your own plain-PyTorch training loop (DDP) as a fuseforge training task: kernels on, metrics and Deck back.

Causal-LM pretraining on packed text. Locally (CPU: 2 worker processes, gloo, Triton's interpreter;
GPUs: one worker per GPU, up to [elastic].local_nproc_per_node), a tiny Llama built in code on the
shipped tiny corpus:

    pyflyte run examples/flyte/torch_loop.py pretrain_workflow
    pyflyte run examples/flyte/torch_loop.py pretrain_workflow --steps 8 --no-kernels

On the cluster (platform.toml's image and resources, or the overrides in `@training_task(...)`), a
real model and a hub text dataset ("text" column):

    pyflyte run --remote examples/flyte/torch_loop.py pretrain_workflow \
        --model meta-llama/Llama-3.2-1B --dataset roneneldan/TinyStories --tokenizer "" \
        --steps 1000 --batch_size 8 --seq_len 2048

The loop is ordinary torch.distributed code: torch elastic starts one process per GPU and sets
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR; the loop joins the group, wraps the model in DDP and
shards the data with DistributedSampler. `StepMeter` measures it (fuseforge_flyte.measure).
The workers import this file's module again (spawn start method): the task puts the file's directory
on their path, so the file runs as written; --remote ships it to the pod.
"""

from __future__ import annotations

import os

from flytekit import workflow

from fuseforge_flyte import training_task
from fuseforge_flyte.training.spec import TrainMetrics

# A tiny Llama for CPU runs and tests; other names load a Hugging Face model.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)


def load_texts(dataset: str, split: str, max_docs: int = 20_000) -> list:
    """Documents: the shipped tiny corpus (""), a local .txt file (one per paragraph), or a hub id's "text"."""
    if not dataset:
        from fuseforge_flyte.data.builtin import CORPUS_FILE, asset_path

        dataset = asset_path(CORPUS_FILE)
    if os.path.isfile(dataset):
        with open(dataset, encoding="utf-8") as fh:
            return [p.strip() for p in fh.read().split("\n\n") if p.strip()]
    import datasets

    rows = datasets.load_dataset(dataset, split=split, streaming=True)
    return [row["text"] for _, row in zip(range(max_docs), rows)]


def packed_rows(texts: list, tokenizer, seq_len: int):
    """All documents tokenized, joined by EOS and cut into full rows of seq_len tokens (no padding)."""
    import torch

    ids: list = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows = len(ids) // seq_len
    if rows == 0:
        raise ValueError(f"the dataset holds {len(ids)} tokens: not one row of seq_len={seq_len}")
    return torch.tensor(ids[:rows * seq_len]).view(rows, seq_len)


def load_model(name: str, vocab_size: int):
    import torch
    import transformers

    if name == "tiny-llama":
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**TINY_LLAMA, vocab_size=vocab_size)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)


# For a cluster, set this task's size here, e.g. @training_task(gpus=8, nnodes=4, shared_memory="128Gi");
# without arguments it is platform.toml's [cluster] and [elastic].
@training_task
def pretrain(model: str = "tiny-llama", dataset: str = "", split: str = "train",
             tokenizer: str = "builtin:tiny-bpe", steps: int = 4, batch_size: int = 2, seq_len: int = 64,
             lr: float = 3e-3, kernels: bool = True) -> TrainMetrics:
    """A DDP training loop on every worker (bf16 autocast on GPUs); rank 0's metrics come back."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from fuseforge_flyte.data.tokenizer import load_tokenizer
    from fuseforge_flyte.measure import StepMeter

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        tok = load_tokenizer(tokenizer, model)  # "" = the model's own tokenizer
        rows = packed_rows(load_texts(dataset, split), tok, seq_len)
        net = load_model(model, len(tok)).to(device)
        if kernels:
            from fuseforge.transformers import apply_kernels  # imported in the worker: Triton's mode is set by now

            apply_kernels(net)
        ddp = DistributedDataParallel(net, device_ids=[local_rank] if cuda else None)
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
        sampler = DistributedSampler(rows, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(rows, batch_size=batch_size, sampler=sampler, drop_last=True, pin_memory=cuda)

        meter = StepMeter(net, dataset=dataset or "builtin:text", model_name=model, dtype="bf16" if cuda else "fp32")
        step, epoch = 0, 0
        while step < steps:
            sampler.set_epoch(epoch)
            for ids in meter.batches(loader):  # the wait for each batch counts as data wait
                ids = ids.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = ddp(input_ids=ids, labels=ids).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                meter.step(loss=loss, batch={"input_ids": ids, "labels": ids})
                step += 1
                if step == steps:
                    break
            epoch += 1
        metrics = meter.metrics()  # on every rank: sums the tokens over ranks
        # Every rank past its last collective before DDP's reducer (which holds the process group) is freed:
        # a gloo group torn down while a peer still talks to it can hang in its destructor.
        dist.barrier()
        del ddp
        return metrics
    finally:
        dist.destroy_process_group()


@workflow
def pretrain_workflow(model: str = "tiny-llama", dataset: str = "", split: str = "train",
                      tokenizer: str = "builtin:tiny-bpe", steps: int = 4, batch_size: int = 2, seq_len: int = 64,
                      lr: float = 3e-3, kernels: bool = True) -> TrainMetrics:
    return pretrain(model=model, dataset=dataset, split=split, tokenizer=tokenizer, steps=steps,
                    batch_size=batch_size, seq_len=seq_len, lr=lr, kernels=kernels)
