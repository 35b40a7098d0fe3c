"""Checkpoint/resume (issue 7): exact replay, corrupt/partial checkpoints, wrong shapes, object stores.

Single process on the CPU in fp32, so a resumed run must reproduce the
uninterrupted loss curve bit for bit.
"""

import json
import logging
import os
import random

import numpy as np
import pytest
import torch

from fuseforge_flyte.training.checkpoint import (MARKER, SKIPPED, CheckpointError, rng_state, set_rng_state)
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.faults import FAULT_ENV, InjectedFault
from fuseforge_flyte.training.spec import TrainSpec

STEPS = 8


def _spec(ckpt_dir, **overrides):
    base = dict(model="tiny-llama", dataset="bench:bytes", steps=STEPS, batch_size=2, seq_len=32, lr=3e-3,
                warmup_steps=2, kernels=False, checkpoint_dir=str(ckpt_dir), checkpoint_every=2, keep_last=3,
                seed=3)
    base.update(overrides)
    return TrainSpec(**base)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every resumed run must reproduce."""
    torch.set_num_threads(1)
    return train(_spec(tmp_path_factory.mktemp("reference")))


def _interrupt(monkeypatch, spec, step):
    """Run until `step` finishes, then fail like a crashed worker."""
    monkeypatch.setenv(FAULT_ENV, f"0:{step}:raise")
    with pytest.raises(InjectedFault):
        train(spec)
    monkeypatch.delenv(FAULT_ENV)


def _checkpoints(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("step_"))


def test_resume_reproduces_uninterrupted_loss_curve(reference, tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 5)
    assert _checkpoints(tmp_path) == ["step_00000002", "step_00000004"]
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["furthest_step"] == 5

    resumed = train(spec)
    assert resumed.resumed_from_step == 4
    assert resumed.steps_redone == 1  # step 5 was done, lost, and done again
    assert resumed.restarts == 0  # no torch elastic restart in-process
    assert resumed.loss_curve == reference.loss_curve  # bitwise: model, optimizer, schedule, data order
    assert resumed.final_loss == reference.final_loss
    # keep_last=3 of 2, 4, 6, 8; no temp directories left behind
    assert _checkpoints(tmp_path) == ["step_00000004", "step_00000006", "step_00000008"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_completed_run_resumes_without_training(reference, tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 7)
    first = train(spec)
    again = train(spec)  # e.g. a Flyte retry after the task finished
    assert again.resumed_from_step == STEPS
    assert again.loss_curve == first.loss_curve == reference.loss_curve
    assert again.steps_redone == first.steps_redone == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "no_marker"])
def test_damaged_newest_checkpoint_is_skipped(reference, tmp_path, monkeypatch, caplog, damage):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 7)
    newest = tmp_path / "step_00000006"
    model_file = newest / "model.pt"
    size = model_file.stat().st_size
    if damage == "truncate":
        with open(model_file, "r+b") as handle:
            handle.truncate(size // 2)
    elif damage == "garbage":  # same size, so only loading can notice
        model_file.write_bytes(bytes(size))
    else:
        (newest / MARKER).unlink()

    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 4
    assert resumed.loss_curve == reference.loss_curve
    expected = {"truncate": "truncated", "garbage": "loading failed", "no_marker": "incomplete checkpoint"}[damage]
    assert any(expected in r.getMessage() and "step_00000006" in r.getMessage() for r in caplog.records)


def test_skipped_checkpoint_is_marked_and_replaced(tmp_path, monkeypatch):
    spec = _spec(tmp_path, steps=6, checkpoint_every=2)
    _interrupt(monkeypatch, spec, 5)
    with open(tmp_path / "step_00000004" / "optimizer.pt", "r+b") as handle:
        handle.truncate(10)
    resumed = train(spec)
    assert resumed.resumed_from_step == 2
    # step 4 was rewritten by the resumed run, so it is complete again and no longer marked
    assert not (tmp_path / "step_00000004" / SKIPPED).exists()
    assert (tmp_path / "step_00000004" / MARKER).exists()


def test_wrong_model_shape_is_a_clear_error_and_keeps_checkpoints(tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 4)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != "progress.json"}
    # tiny-mistral has the same parameter names but one KV head instead of two
    with pytest.raises(CheckpointError) as err:
        train(_spec(tmp_path, model="tiny-mistral"))
    message = str(err.value)
    assert "different model" in message and "k_proj.weight" in message and "refusing to start fresh" in message
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != "progress.json"}
    assert after == before  # nothing overwritten, nothing marked


def test_all_checkpoints_corrupt_refuses_fresh_start(tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 5)
    for name in _checkpoints(tmp_path):
        (tmp_path / name / "model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="none can be loaded.*step_00000004.*step_00000002"):
        train(spec)
    assert _checkpoints(tmp_path) == ["step_00000002", "step_00000004"]
    assert not list(tmp_path.glob(f"step_*/{SKIPPED}"))  # a retry must not see them as "handled"


def test_strategy_change_is_a_clear_error(tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 3)
    with pytest.raises(CheckpointError, match="strategy 'ddp'.*'fsdp'"):
        train(_spec(tmp_path, strategy="fsdp"))


def test_object_store_uri_roundtrip(reference, monkeypatch):
    """fsspec store without renames: files uploaded per rank, marker written last."""
    import fsspec

    root = f"memory://fuseforge-test-{random.randrange(1 << 30)}"
    spec = _spec(root)
    _interrupt(monkeypatch, spec, 5)
    fs = fsspec.filesystem("memory")
    path = root[len("memory://"):]
    assert fs.exists(f"{path}/step_00000004/{MARKER}")
    assert fs.exists(f"{path}/step_00000004/model.pt")
    resumed = train(spec)
    assert resumed.resumed_from_step == 4
    assert resumed.loss_curve == reference.loss_curve
    fs.rm(path, recursive=True)


def test_rng_states_roundtrip():
    """torch, python and numpy generators continue exactly where the saved state left them."""
    device = torch.device("cpu")
    state = rng_state(device)
    draws = lambda: (torch.rand(3).tolist(), random.random(), float(np.random.rand()))  # noqa: E731
    expected = draws()
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    assert draws() != expected
    set_rng_state(state, device)
    assert draws() == expected
