"""Local end-to-end runs of the Flyte workflows: 2 elastic worker processes, gloo, kernels interpreted on CPU.

These are the platform's slowest tests (each elastic launch spawns two Python workers): one probe task,
one `train`, one `compare`, on a tiny model with few steps and seq_len 32.
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import time
import textwrap

import pytest
import torch
from flytekit import task
from flytekit.core.context_manager import FlyteContextManager

from flytekit import workflow
from flytekit.types.directory import FlyteDirectory

from fuseforge_flyte.comparison import Comparison
from fuseforge_flyte.config import load_config
from fuseforge_flyte.launch import training_task_options
from fuseforge_flyte.tasks import DataSource
from fuseforge_flyte.training.spec import TrainMetrics
from fuseforge_flyte.workflows import _prepared, compare, demo, train

pytestmark = pytest.mark.slow

STEPS = 10
CUDA = torch.cuda.is_available()
WORKERS = min(2, torch.cuda.device_count()) if CUDA else 2  # [elastic].local_nproc_per_node, capped at the GPUs
TINY = dict(model="tiny-llama", dataset="bench:synthetic", steps=STEPS, batch_size=2, seq_len=32, lr=3e-3, dtype="fp32")


@pytest.fixture(autouse=True)
def _outputs_in_tmp(tmp_path, monkeypatch):
    """Local runs write ./outputs/<run>: in the test's own directory, not the checkout."""
    monkeypatch.chdir(tmp_path)


@workflow
def prepare_only(dataset: DataSource, seq_len: int) -> FlyteDirectory:
    """The train workflow's data steps alone: fingerprint, then the cached preparation."""
    return _prepared(dataset, "tiny-llama", "", "auto", "", "train", seq_len, True, 0.2, "", 0)


def decks_written_since(start: float) -> list[str]:
    """deck.html files the local Flyte executions wrote (under flytekit's local sandbox) after `start`."""
    sandbox = FlyteContextManager.current_context().file_access.local_sandbox_dir
    found = glob.glob(os.path.join(sandbox, "**", "deck.html"), recursive=True)
    return [open(p, encoding="utf-8").read() for p in found if os.path.getmtime(p) >= start]


def probe_worker() -> str:
    """What one elastic worker sees (module level so that spawned workers can import it)."""
    env = os.environ
    return f"{env['RANK']}/{env['WORLD_SIZE']} interpret={env.get('TRITON_INTERPRET')} fresh_store={env.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE')}"


def failing_worker() -> str:
    """Rank 1 fails with a settings error in every attempt; each start is logged (module level: spawn imports it)."""
    from fuseforge_flyte.training import permanent

    with open(os.environ["PROBE_LOG"], "a") as log:
        log.write(f"{os.environ['RANK']}@{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")

    def body() -> str:
        if os.environ["RANK"] == "1":
            # fail only once rank 0 has started this round too (spawned workers start seconds apart on a busy
            # machine: the agent would otherwise stop rank 0 before it logs its start)
            round_start = f"0@{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            deadline = time.monotonic() + 60
            while round_start not in open(os.environ["PROBE_LOG"]).read().split() and time.monotonic() < deadline:
                time.sleep(0.1)
            raise ValueError("probe: a setting no restart can fix")
        time.sleep(2)  # rank 0 still running when rank 1 fails: the agent stops it and restarts the group
        return "done"

    return permanent.run_worker(body, int(os.environ["RANK"]))


def assert_real_run(m: TrainMetrics, kernels: bool, steps: int = STEPS, seq_len: int = 32) -> None:
    assert isinstance(m, TrainMetrics)
    assert (m.model, m.kernels, m.world_size, m.steps) == ("tiny-llama", kernels, WORKERS, steps)
    assert (m.device != "cpu") if CUDA else (m.device == "cpu")
    assert m.tokens_per_s > 0 and m.samples_per_s > 0
    assert m.tokens_per_step == WORKERS * 2 * seq_len  # world size x batch x seq_len
    assert 0 < m.step_time_p50_s <= m.step_time_p90_s <= m.step_time_p99_s
    assert m.peak_memory_gib > 0
    for curve in (m.loss_curve, m.tokens_per_s_curve, m.memory_gib_curve):
        assert len(curve) == steps and all(math.isfinite(v) for v in curve)
    assert math.isfinite(m.final_loss) and m.final_loss == pytest.approx(m.loss_curve[-1])
    first, last = m.loss_curve[:3], m.loss_curve[-3:]
    assert sum(last) / 3 < sum(first) / 3 - 0.05, f"loss did not decrease: {m.loss_curve}"


def test_registered_multi_node_task_runs_as_one_local_node(tmp_path, monkeypatch):
    """Registered for 4 nodes x 8 GPUs; a local run is one node of [elastic].local_nproc_per_node workers."""
    (tmp_path / "platform.toml").write_text(textwrap.dedent("""
        [image]
        registry = "localhost:30000"
        [flyte]
        project = "p"
        domain = "d"
        [cluster]
        gpus = 8
        [elastic]
        nnodes = 4
        nproc_per_node = 8
        local_nproc_per_node = 2
        rdzv_timeout = 60
        rdzv_join_timeout = 60
    """))
    config = load_config(tmp_path / "platform.toml", env={})
    probe = task(**training_task_options(config))(probe_worker)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest sets it; the task must do so itself
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert probe() == f"0/{WORKERS} interpret={None if CUDA else 1} fresh_store=1"
    assert probe.task_config.nnodes == 4 and probe.task_config.nproc_per_node == 8  # registration unchanged
    # The launch variables were scoped to the run.
    assert "TRITON_INTERPRET" not in os.environ and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ


def test_permanent_worker_error_fails_once_without_restarts(tmp_path, monkeypatch):
    """A worker error that cannot succeed on retry ends the task after one short replay round (no second
    training attempt), as a non-recoverable error naming the rank and the cause, though max_restarts is 3."""
    from fuseforge_flyte.training.permanent import PermanentFailure

    (tmp_path / "platform.toml").write_text("[image]\nregistry = \"localhost:30000\"\n[flyte]\nproject = \"p\"\ndomain = \"d\"\n[elastic]\nlocal_nproc_per_node = 2\nmax_restarts = 3\nmonitor_interval = 1\n")
    config = load_config(tmp_path / "platform.toml", env={})
    probe = task(**training_task_options(config))(failing_worker)
    monkeypatch.setenv("PROBE_LOG", str(tmp_path / "starts.txt"))
    start = time.time()
    with pytest.raises(PermanentFailure, match="(?s)not retried.*rank 1: ValueError: probe: a setting no restart"):
        probe()
    assert time.time() - start < 120  # two rounds of worker start-up (spawn imports torch), not four
    starts = (tmp_path / "starts.txt").read_text().split()
    assert sorted(starts) == ["0@0", "0@1", "1@0", "1@1"]  # the first round and one replay round, no more


def test_demo_fine_tunes_returns_the_model_and_samples_it(capfd):
    """The README's main job: SFT on builtin:chat (BPE tokenizer, assistant-only loss, packed, eval), kernels
    on; the trained model comes back as a Hugging Face directory that plain transformers loads and runs."""
    start = time.time()
    out = demo(steps=12, batch_size=2, seq_len=64, eval_every=6, prompts=["What is the capital of Spain?"])
    m = out.metrics
    assert_real_run(m, kernels=True, steps=12, seq_len=64)
    assert m.kernels_patched and m.dataset == "builtin:chat"
    assert len(m.eval_loss_curve) == 2 and m.eval_steps == [6, 12] and math.isfinite(m.eval_loss)
    assert m.eval_perplexity == pytest.approx(math.exp(m.eval_loss))
    assert m.eval_loss_curve[-1] < m.eval_loss_curve[0]
    assert 0 < m.loss_tokens_per_step < m.tokens_per_step  # only assistant tokens carry a loss
    assert 0 <= m.data_wait_fraction < 0.5
    model_dir = out.model.download()
    names = set(os.listdir(model_dir))
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    assert out.samples.prompts == ["What is the capital of Spain?"] and isinstance(out.samples.answers[0], str)
    assert str(out.samples) == f"  What is the capital of Spain? -> {out.samples.answers[0]}"  # side by side
    printed = capfd.readouterr()  # the workers are processes of their own: their file descriptors
    assert "step 12/12" in printed.out + printed.err  # progress reaches the console through Flyte's workers
    decks = [d for d in decks_written_since(start) if "Training metrics" in d]
    assert decks, "no deck.html with the training metrics was written"
    assert "data:image/png;base64," in decks[0] and "eval loss" in decks[0]


def test_data_preparation_is_cached_on_the_contents(tmp_path, monkeypatch):
    """A second run with the same dataset contents and options skips the preparation; new contents redo it."""
    import fuseforge_flyte.data.prepare as prepare_module

    calls = []
    real = prepare_module.prepare
    monkeypatch.setattr(prepare_module, "prepare", lambda spec, out: calls.append(spec.dataset) or real(spec, out))
    data = tmp_path / "chat.jsonl"
    lines = [f'{{"prompt": "Say {i} {time.time_ns()}.", "completion": "{i}."}}' for i in range(40)]
    data.write_text("\n".join(lines) + "\n")
    first = prepare_only(dataset=str(data), seq_len=32)
    second = prepare_only(dataset=str(data), seq_len=32)
    assert len(calls) == 1, "the second preparation with the same inputs was not a cache hit"
    assert first.path == second.path
    data.write_text("\n".join(lines[:-1]) + "\n")  # same path, other contents: prepared again
    third = prepare_only(dataset=str(data), seq_len=32)
    assert len(calls) == 2 and third.path != first.path


def test_a_removed_local_cache_is_a_miss_not_a_hit_on_missing_files(tmp_path, monkeypatch):
    """flytekit's local task cache outlives fuseforge's cache folder: once that folder is removed (a cleaned
    ~/.cache, another FUSEFORGE_CACHE), the same preparation is done again instead of handing training a folder
    that is gone."""
    import fuseforge_flyte.data.prepare as prepare_module

    calls = []
    real = prepare_module.prepare
    monkeypatch.setattr(prepare_module, "prepare", lambda spec, out: calls.append(spec.dataset) or real(spec, out))
    monkeypatch.setenv("FUSEFORGE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(f'{{"prompt": "Say {i} {time.time_ns()}.", "completion": "{i}."}}' for i in range(40)))
    first = prepare_only(dataset=str(data), seq_len=32)
    assert prepare_only(dataset=str(data), seq_len=32).path == first.path and len(calls) == 1  # a hit
    shutil.rmtree(tmp_path / "cache")
    again = prepare_only(dataset=str(data), seq_len=32)
    assert len(calls) == 2 and os.path.isdir(again.path)


@pytest.mark.parametrize("rows,match", [
    (['{"question": "a", "answer": "b"}'], "column"),  # no text/messages/prompt+completion column
    ([], "no rows"),  # an empty dataset
])
def test_bad_data_fails_in_preparation_before_any_worker_starts(tmp_path, monkeypatch, rows, match):
    """Bad data is named by the CPU preparation task: the elastic training task never launches workers."""
    from fuseforge_flyte.launch import ElasticTrainingTask

    launched = []
    monkeypatch.setattr(ElasticTrainingTask, "execute", lambda self, **kw: launched.append(kw))
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(rows) + ("\n" if rows else ""))
    start = time.time()
    with pytest.raises(Exception, match=match):
        train(model="tiny-llama", dataset=str(data), steps=2, seq_len=32)
    assert not launched and time.time() - start < 60


def test_compare_workflow_end_to_end():
    start = time.time()
    result = compare(**TINY)
    assert isinstance(result, Comparison)
    assert_real_run(result.with_kernels, kernels=True)
    assert_real_run(result.without_kernels, kernels=False)
    for value in (result.throughput_gain_pct, result.memory_reduction_pct, result.step_time_p50_speedup):
        assert math.isfinite(value)
    assert result.throughput_gain_pct == pytest.approx(
        100 * (result.with_kernels.tokens_per_s / result.without_kernels.tokens_per_s - 1)
    )
    # Same seed and data in fp32: the fused kernels must train the same model (CPU: ~1e-6 apart).
    assert result.max_loss_curve_diff < 1e-2, (result.with_kernels.loss_curve, result.without_kernels.loss_curve)
    assert abs(result.final_loss_diff) <= result.max_loss_curve_diff + 1e-12
    decks = [d for d in decks_written_since(start) if "Kernels vs no kernels" in d]
    assert decks and "without kernels" in decks[0] and "data:image/png;base64," in decks[0]
