"""Fine-tuning through the engine on the real data path (issue 15): prepared shards, the global loss per
loss token, eval, deterministic resume, the trained model as output and training from it.

Single process on the CPU in fp32 with the kernels off (their equivalence is tested elsewhere), on the
shipped chat data and BPE tokenizer.
"""

import json
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fuseforge_flyte.data.prepare import prepare
from fuseforge_flyte.data.shards import open_split
from fuseforge_flyte.training.batches import IGNORE_INDEX
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.faults import FAULT_ENV, InjectedFault
from fuseforge_flyte.training.spec import TrainSpec

SEQ = 64


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """builtin:chat prepared for tiny-llama at seq_len 64 with 10% held out."""
    out = str(tmp_path_factory.mktemp("prepared") / "chat")
    prepare(TrainSpec(model="tiny-llama", dataset="builtin:chat", seq_len=SEQ, eval_fraction=0.1).data_spec(), out)
    return out


def _spec(data, **overrides):
    base = dict(model="tiny-llama", dataset=data, steps=6, batch_size=2, seq_len=SEQ, lr=3e-3, warmup_steps=1,
                kernels=False, dtype="fp32", seed=5)
    base.update(overrides)
    return TrainSpec(**base)


def test_step_loss_is_the_mean_over_every_loss_token_of_the_global_batch(chat_data):
    """grad_accum=2 with different loss-token counts per micro-batch: the step-1 loss is the token mean over
    both micro-batches (not the mean of the two micro-batch means), computed here with plain transformers."""
    m = train(_spec(chat_data, steps=1, grad_accum=2, batch_size=3))
    from fuseforge_flyte.training.batches import ShardedBatches
    from fuseforge_flyte.training.models import build_model

    train_split = open_split(chat_data, "train")
    batches = ShardedBatches(train_split, rank=0, world_size=1, batch_size=3, grad_accum=2, seed=5).next_step()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the engine's device: same init RNG
    model = build_model("tiny-llama", seed=5, device=device, vocab_size=1024)
    total, count, means = 0.0, 0, []
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
            targets = batch["labels"][:, 1:]
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                       ignore_index=IGNORE_INDEX, reduction="sum")
            n = int((targets != IGNORE_INDEX).sum())
            total, count = total + losses.item(), count + n
            means.append(losses.item() / n)
    counts_differ = len({int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches}) > 1
    assert counts_differ, "the test needs micro-batches with different loss-token counts"
    # the engine runs packed rows on a GPU through flex attention, this reference through SDPA
    assert m.loss_curve[0] == pytest.approx(total / count, rel=1e-5 if device.type == "cpu" else 1e-4)
    assert abs(total / count - sum(means) / 2) > 1e-4  # the mean of means would have been another number
    assert m.loss_tokens_per_step == count


def test_eval_loss_and_perplexity(chat_data):
    m = train(_spec(chat_data, eval_every=3))
    assert m.eval_steps == [3, 6] and len(m.eval_loss_curve) == 2
    assert m.eval_loss == m.eval_loss_curve[-1] and m.eval_perplexity == pytest.approx(math.exp(m.eval_loss))
    assert m.eval_loss_curve[1] < m.eval_loss_curve[0]
    assert m.dataset == "builtin:chat" and 0 <= m.data_wait_fraction < 1


def test_resume_reproduces_the_uninterrupted_run_on_prepared_data(chat_data, tmp_path, monkeypatch):
    uninterrupted = train(_spec(chat_data, eval_every=2, steps=7))
    spec = _spec(chat_data, eval_every=2, steps=7, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    monkeypatch.setenv(FAULT_ENV, "0:5:raise")
    with pytest.raises(InjectedFault):
        train(spec)
    monkeypatch.delenv(FAULT_ENV)
    resumed = train(spec)
    assert resumed.resumed_from_step == 4 and resumed.steps_redone == 1
    assert resumed.loss_curve == uninterrupted.loss_curve
    assert resumed.eval_loss_curve == uninterrupted.eval_loss_curve and resumed.eval_steps == [2, 4, 6, 7]


def test_trained_model_is_a_hf_directory_and_training_continues_from_it(chat_data, tmp_path):
    first = train(_spec(chat_data, eval_every=6, output_dir=str(tmp_path / "run")))
    out = str(tmp_path / "run" / "model")
    assert first.model_dir == out and first.output_dir == str(tmp_path / "run")
    assert json.load(open(tmp_path / "run" / "metrics.json"))["steps"] == first.steps  # the run's record beside it
    assert json.load(open(tmp_path / "run" / "settings.json"))["eval_every"] == 6
    names = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.vocab_size == 1024 and loaded.config.architectures == ["LlamaForCausalLM"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)  # a from-scratch model stops where its tokenizer ends a turn
    assert loaded.generation_config.eos_token_id == tokenizer.eos_token_id == loaded.config.eos_token_id
    assert loaded.generation_config.pad_token_id == tokenizer.pad_token_id
    # Continue training from the output with a negligible learning rate: the first eval matches the last one.
    again = train(_spec(chat_data, model=out, steps=1, lr=1e-12, warmup_steps=0, eval_every=1))
    assert again.eval_loss == pytest.approx(first.eval_loss, abs=1e-5)


def test_data_that_does_not_fit_the_model_is_refused_before_training(tmp_path):
    small = tmp_path / "small"
    LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=4096).save_pretrained(small)
    with pytest.raises(ValueError, match=r"vocabulary 1024\) but the model's vocab_size is 500"):
        train(TrainSpec(model=str(small / "config.json"), dataset="builtin:chat", tokenizer="builtin:tiny-bpe",
                        seq_len=SEQ, steps=1, kernels=False))
    with pytest.raises(ValueError, match="seq_len 8192 is above the model's max_position_embeddings 4096"):
        train(TrainSpec(model="tiny-llama", dataset="builtin:chat", seq_len=8192, steps=1, kernels=False))
