"""Local end-to-end runs of the Flyte workflows: 2 elastic worker processes, gloo, kernels interpreted on CPU.

These are the platform's slowest tests (each elastic launch spawns two Python workers): one probe task,
one `train`, one `compare`, on a tiny model with few steps and seq_len 32.
"""

from __future__ import annotations

import glob
import math
import os
import time
import textwrap

import pytest
import torch
from flytekit import task
from flytekit.core.context_manager import FlyteContextManager

from fuseforge_flyte.comparison import Comparison
from fuseforge_flyte.config import load_config
from fuseforge_flyte.tasks import CONFIG, training_task_options
from fuseforge_flyte.training.spec import TrainMetrics
from fuseforge_flyte.workflows import compare, train

pytestmark = pytest.mark.slow

STEPS = 10
CUDA = torch.cuda.is_available()
WORKERS = min(2, torch.cuda.device_count()) if CUDA else 2  # [elastic].local_nproc_per_node, capped at the GPUs
TINY = dict(model="tiny-llama", dataset="builtin:synthetic", steps=STEPS, batch_size=2, seq_len=32, lr=3e-3, dtype="fp32")


def decks_written_since(start: float) -> list[str]:
    """deck.html files the local Flyte executions wrote (under flytekit's local sandbox) after `start`."""
    sandbox = FlyteContextManager.current_context().file_access.local_sandbox_dir
    found = glob.glob(os.path.join(sandbox, "**", "deck.html"), recursive=True)
    return [open(p, encoding="utf-8").read() for p in found if os.path.getmtime(p) >= start]


def probe_worker() -> str:
    """What one elastic worker sees (module level so that spawned workers can import it)."""
    env = os.environ
    return f"{env['RANK']}/{env['WORLD_SIZE']} interpret={env.get('TRITON_INTERPRET')} fresh_store={env.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE')}"


def assert_real_run(m: TrainMetrics, kernels: bool) -> None:
    assert isinstance(m, TrainMetrics)
    assert (m.model, m.kernels, m.world_size, m.steps) == ("tiny-llama", kernels, WORKERS, STEPS)
    assert (m.device != "cpu") if CUDA else (m.device == "cpu")
    assert m.tokens_per_s > 0 and m.samples_per_s > 0
    assert m.tokens_per_step == WORKERS * 2 * 32  # world size x batch x seq_len
    assert 0 < m.step_time_p50_s <= m.step_time_p90_s <= m.step_time_p99_s
    assert m.peak_memory_gib > 0
    for curve in (m.loss_curve, m.tokens_per_s_curve, m.memory_gib_curve):
        assert len(curve) == STEPS and all(math.isfinite(v) for v in curve)
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


def test_train_workflow_end_to_end():
    assert CONFIG.elastic.local_nproc_per_node == 2
    start = time.time()
    metrics = train(kernels=True, loss_chunk_size=32, **TINY)  # 2 x 31 targets per worker: 2 loss chunks
    assert_real_run(metrics, kernels=True)
    decks = [d for d in decks_written_since(start) if "Training metrics" in d]
    assert decks, "no deck.html with the training metrics was written"
    assert "data:image/png;base64," in decks[0] and "tokens/s" in decks[0]


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
