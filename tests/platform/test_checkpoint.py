"""Checkpoint/resume (issue 7): exact replay, corrupt/partial checkpoints, wrong shapes, object stores.
Verified before anything is loaded (issue 16): content hashes, HMAC, run settings and model config,
damaged FSDP checkpoints, full disks, and preemption by SIGTERM.

Single process on the CPU in fp32 (or 2 gloo workers under torch elastic), so a resumed run must
reproduce the uninterrupted loss curve bit for bit.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch

from fuseforge_flyte.training.checkpoint import (MARKER, SKIPPED, CheckpointError, rng_state, set_rng_state)
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.faults import FAULT_ENV, InjectedFault
from fuseforge_flyte.training.spec import TrainSpec
import forking  # tests/support

STEPS = 8
KEY_ENV, KEY_FILE_ENV = "FUSEFORGE_CHECKPOINT_KEY", "FUSEFORGE_CHECKPOINT_KEY_FILE"
KEY = "test-checkpoint-key-0123456789abcdef"

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


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
    expected = {"truncate": "truncated", "garbage": "model.pt changed since it was written",
                "no_marker": "incomplete checkpoint"}[damage]
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

    monkeypatch.setenv(KEY_ENV, KEY)
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


# ---------------------------------------------------------------- issue 16: verified before anything is loaded




@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory):
    torch.set_num_threads(1)
    return train(_spec(tmp_path_factory.mktemp("fsdp-reference"), strategy="fsdp"))


def _tensor_data_offset(path):
    """Byte offset of the middle element of the largest tensor stored in a torch (zip) checkpoint."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len + (info.file_size // 8) * 4


def _xor_byte(path, offset, mask):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))


def _rehash(checkpoint, *, sign=False, unsigned=False):
    """What a writer without the key can do: make the manifest match the files again (an HMAC then fails), or
    drop its signature (`unsigned`). `sign`: what a writer with this run's key does (the manifest verifies)."""
    marker = json.loads((checkpoint / MARKER).read_text())
    for rel, entry in marker["files"].items():
        data = (checkpoint / rel).read_bytes()
        if isinstance(entry, dict):
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        else:  # the format before content hashes: sizes only
            marker["files"][rel] = len(data)
    if sign or unsigned:
        marker = {k: v for k, v in marker.items() if k not in ("hmac", "key_id")}
    if sign:
        from fuseforge_flyte.training.checkpoint.signing import Signing

        marker = Signing(str(checkpoint), allow_unsigned=False, log_it=False).sign(marker)
    (checkpoint / MARKER).write_text(json.dumps(marker))


def _warned(caplog, *parts):
    return any(all(p in r.getMessage() for p in parts) for r in caplog.records)


@pytest.mark.parametrize("damage", ["model_bit_flip", "optimizer_byte", "state_edit"])
def test_silent_corruption_is_caught_by_the_content_hash(reference, tmp_path, monkeypatch, caplog, damage):
    """Sizes stay the same and torch loads the files fine: only the sha256 in the manifest notices."""
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 7)
    newest = tmp_path / "step_00000006"
    if damage == "model_bit_flip":  # one exponent bit: a weight of ~0.02 becomes ~1e37
        path = newest / "model.pt"
        _xor_byte(path, _tensor_data_offset(path) + 3, 0x40)
        assert max(t.abs().max().item() for t in torch.load(path, weights_only=True).values()) > 1e30
    elif damage == "optimizer_byte":
        path = newest / "optimizer.pt"
        _xor_byte(path, _tensor_data_offset(path) + 1, 0xFF)
        torch.load(path, weights_only=True)
    else:  # the data position moved on by two batches, same length
        path = newest / "trainer_state.json"
        text = path.read_text()
        index = json.loads(text)["position"]["index"]
        path.write_text(text.replace(f'"index": {index}', f'"index": {index + 2}'))
        assert json.loads(path.read_text())["position"]["index"] == index + 2
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 4
    assert resumed.loss_curve == reference.loss_curve
    assert _warned(caplog, "step_00000006", f"file {path.name} changed since it was written")


def test_file_outside_the_manifest_is_refused(reference, tmp_path, monkeypatch, caplog):
    """A loader may pick a file up by name (another world size's shard): nothing unlisted may be there."""
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 7)
    (tmp_path / "step_00000006" / "rng" / "rank_00001.pt").write_bytes(b"planted")
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 4 and resumed.loss_curve == reference.loss_curve
    assert _warned(caplog, "step_00000006", "rng/rank_00001.pt is not in the manifest")


def _config_file(directory, **changes):
    from fuseforge_flyte.model_names import load_config

    config = load_config("tiny-llama")
    for name, value in changes.items():
        setattr(config, name, value)
    directory.mkdir()
    config.to_json_file(str(directory / "config.json"))
    return str(directory / "config.json")


def test_same_shapes_but_another_model_config_is_refused(tmp_path, monkeypatch):
    """rope_theta, rms_norm_eps and the activation change no shape, so the parameter check cannot see them."""
    original = _config_file(tmp_path / "a")
    changed = _config_file(tmp_path / "b", rms_norm_eps=1e-5, hidden_act="gelu",
                           rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    spec = _spec(tmp_path / "ckpt", model=original)
    _interrupt(monkeypatch, spec, 3)
    with pytest.raises(CheckpointError) as err:
        train(_spec(tmp_path / "ckpt", model=changed))
    message = str(err.value)
    for part in ("model_config.rope_parameters.rope_theta: 10000.0 -> 500000.0", "model_config.rms_norm_eps",
                 "model_config.hidden_act: 'silu' -> 'gelu'", "resume_allow_changes='model_config'"):
        assert part in message
    # on purpose (a context extension's new rope_theta, say): allowed by name
    assert train(_spec(tmp_path / "ckpt", model=changed, resume_allow_changes="model_config")).resumed_from_step == 2


def test_changed_run_settings_are_refused_naming_each_unless_allowed(tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 3)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != "progress.json"}
    with pytest.raises(CheckpointError) as err:
        train(_spec(tmp_path, lr=1e-3, seed=4, batch_size=4, grad_clip=0.5))
    message = str(err.value)
    for part in ("lr: 0.003 -> 0.001", "seed: 3 -> 4", "global_batch: 2 -> 4", "grad_clip: 1.0 -> 0.5",
                 "resume_allow_changes='global_batch,grad_clip,lr,seed'"):
        assert part in message
    with pytest.raises(CheckpointError, match=r"dataset.benchmark: 'bench:bytes' -> 'bench:synthetic'"):
        train(_spec(tmp_path, dataset="bench:synthetic"))
    with pytest.raises(ValueError, match="resume_allow_changes: unknown setting.*learning_rate"):
        train(_spec(tmp_path, lr=1e-3, resume_allow_changes="learning_rate"))
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != "progress.json"}
    assert after == before  # refused before anything was written
    assert train(_spec(tmp_path, lr=1e-3, seed=4, resume_allow_changes="lr, seed")).resumed_from_step == 2


def test_continued_training_with_allowed_changes_uses_the_new_schedule(tmp_path):
    """lr and steps allowed to change: the restored optimizer and schedule take them (their state holds the old)."""
    from fuseforge_flyte.training.optim import MIN_LR_RATIO

    train(_spec(tmp_path, steps=4, checkpoint_every=0))
    more = train(_spec(tmp_path, steps=8, lr=1e-3, checkpoint_every=0, resume_allow_changes="steps,lr"))
    assert more.resumed_from_step == 4 and more.steps == 8 and len(more.loss_curve) == 8
    scheduler = torch.load(tmp_path / "step_00000008" / "scheduler.pt", weights_only=True)
    assert scheduler["base_lrs"] == [1e-3, 1e-3]
    assert scheduler["lr_lambdas"] == [{}, {}]  # the schedule's shape is rebuilt from the run's settings
    assert scheduler["_last_lr"][0] == pytest.approx(1e-3 * MIN_LR_RATIO)


def _schedule_run(lr, weight_decay, warmup, steps, trained=0):
    """A tiny model's optimizer and LR schedule as the strategies build them (training/optim.py), `trained` steps in."""
    from types import SimpleNamespace

    from fuseforge_flyte.training import optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = optim.adamw(optim.param_groups(model.named_parameters(), weight_decay), lr)
    run = SimpleNamespace(model=model, optimizer=optimizer, scheduler=optim.scheduler(optimizer, warmup, steps))
    for _ in range(trained):
        _schedule_step(run)
    return run


def _schedule_step(run):
    run.model(torch.ones(2, 4)).square().sum().backward()
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad()


def _lrs(run):
    return [group["lr"] for group in run.optimizer.param_groups]


def _restore(run, optimizer_state, scheduler_state, settings, changed):
    """What CheckpointManager does around a strategy's load: Retarget made before, applied after."""
    from fuseforge_flyte.training.checkpoint.schedule import Retarget

    retarget = Retarget(run, settings, changed)
    run.optimizer.load_state_dict(optimizer_state)
    run.scheduler.load_state_dict(scheduler_state)
    retarget.apply()


@pytest.mark.parametrize("saved_weight_decay", [0.0, 0.05], ids=["decay-added", "decay-changed"])
def test_allowed_schedule_changes_retarget_the_restored_optimizer_and_schedule(saved_weight_decay):
    """lr, weight_decay, warmup_steps and steps changed on resume: from the resumed step on, the lrs and weight
    decay are those of a run that had the new settings from the start; the optimizer's moments are kept."""
    saved = _schedule_run(lr=3e-3, weight_decay=saved_weight_decay, warmup=2, steps=8, trained=5)
    resumed = _schedule_run(lr=1e-3, weight_decay=0.1, warmup=3, steps=20)
    wanted = _schedule_run(lr=1e-3, weight_decay=0.1, warmup=3, steps=20, trained=5)
    settings = {"lr": 1e-3, "weight_decay": 0.1, "warmup_steps": 3, "steps": 20}
    _restore(resumed, saved.optimizer.state_dict(), saved.scheduler.state_dict(), settings,
             ("lr", "steps", "warmup_steps", "weight_decay"))
    assert _lrs(resumed) == pytest.approx(_lrs(wanted)) and _lrs(resumed) != pytest.approx(_lrs(saved))
    assert resumed.scheduler.get_last_lr() == pytest.approx(wanted.scheduler.get_last_lr())
    assert resumed.scheduler.state_dict()["base_lrs"] == [1e-3, 1e-3]
    assert [(g["weight_decay"], g["initial_lr"]) for g in resumed.optimizer.param_groups] == [(0.1, 1e-3), (0.0, 1e-3)]
    for mine, theirs in zip(resumed.optimizer.state.values(), saved.optimizer.state.values()):
        torch.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=0, atol=0)
    for _ in range(6):
        _schedule_step(resumed)
        _schedule_step(wanted)
        assert _lrs(resumed) == pytest.approx(_lrs(wanted))


def _former_warmup_cosine(step, warmup, total):
    """fuseforge's own LR multiplier before transformers' schedule replaced it (as checkpoints of then hold it)."""
    import math

    from fuseforge_flyte.training.optim import MIN_LR_RATIO

    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _former_schedule_state(run, lr, warmup, total):
    """`run`'s optimizer and scheduler state dicts as the former schedule wrote them: LambdaLR saved its callable
    WarmupCosine's warmup and total, and the lrs were that schedule's."""
    step = run.scheduler.last_epoch
    former = [lr * _former_warmup_cosine(step, warmup, total)] * len(run.optimizer.param_groups)
    scheduler_state = dict(run.scheduler.state_dict(), _last_lr=former,
                           lr_lambdas=[{"warmup": warmup, "total": total}] * len(former))
    optimizer_state = run.optimizer.state_dict()
    for group, value in zip(optimizer_state["param_groups"], former):
        group["lr"] = value
    return optimizer_state, scheduler_state


@pytest.mark.parametrize("changed", [(), ("steps",)], ids=["same-settings", "steps-changed"])
def test_a_checkpoint_of_the_former_schedule_continues_on_the_new_one(changed):
    """A checkpoint written with WarmupCosine (its scheduler state names warmup and total), resumed during the
    warmup where the two schedules differ: from the resumed step on, the lrs are the new schedule's."""
    steps = 12 if changed else 8
    saved = _schedule_run(lr=3e-3, weight_decay=0.1, warmup=4, steps=8, trained=2)
    optimizer_state, scheduler_state = _former_schedule_state(saved, 3e-3, warmup=4, total=8)
    resumed = _schedule_run(lr=3e-3, weight_decay=0.1, warmup=4, steps=steps)
    wanted = _schedule_run(lr=3e-3, weight_decay=0.1, warmup=4, steps=steps, trained=2)
    assert _lrs(wanted) != pytest.approx(optimizer_state["param_groups"][0]["lr"])  # the schedules differ here
    _restore(resumed, optimizer_state, scheduler_state,
             {"lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 4, "steps": steps}, changed)
    assert _lrs(resumed) == pytest.approx(_lrs(wanted))
    assert resumed.scheduler.get_last_lr() == pytest.approx(wanted.scheduler.get_last_lr())
    for _ in range(steps - 2):
        _schedule_step(resumed)
        _schedule_step(wanted)
        assert _lrs(resumed) == pytest.approx(_lrs(wanted))


def test_a_run_resumed_from_a_former_schedule_checkpoint_trains_on_the_new_schedule(tmp_path, monkeypatch, caplog):
    """End to end: the step-2 checkpoint (in the warmup) rewritten as the former schedule wrote it, and signed:
    the resumed run reproduces an uninterrupted run on the new schedule."""
    spec = _spec(tmp_path / "resumed", warmup_steps=4)
    uninterrupted = train(_spec(tmp_path / "uninterrupted", warmup_steps=4))
    _interrupt(monkeypatch, spec, 3)
    checkpoint = tmp_path / "resumed" / "step_00000002"
    for name in ("step_00000004", "step_00000006", "step_00000008"):
        assert not (tmp_path / "resumed" / name).exists()
    scheduler_state = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    optimizer_state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    former = [3e-3 * _former_warmup_cosine(2, 4, STEPS)] * len(scheduler_state["base_lrs"])
    scheduler_state.update(_last_lr=former, lr_lambdas=[{"warmup": 4, "total": STEPS}] * len(former))
    for group, value in zip(optimizer_state["param_groups"], former):
        group["lr"] = value
    torch.save(scheduler_state, checkpoint / "scheduler.pt")
    torch.save(optimizer_state, checkpoint / "optimizer.pt")
    _rehash(checkpoint, sign=True)
    with caplog.at_level(logging.INFO, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 2
    assert resumed.loss_curve == uninterrupted.loss_curve
    assert _warned(caplog, "former LR schedule")


def test_steps_below_the_checkpoint_is_a_clear_error(tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 7)
    with pytest.raises(CheckpointError, match=r"step_00000006 is at step 6, beyond this run's steps=5"):
        train(_spec(tmp_path, steps=5))


class _Payload:
    """Unpickling it creates a directory: proof that checkpoint bytes reached an unpickler."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_rewritten_pickle_never_reaches_an_unpickler(tmp_path, monkeypatch, caplog, request, strategy):
    """DCP unpickles .metadata, DeepSpeed torch.load(weights_only=False)s its files: a bucket writer's payload
    with a manifest fixed to match fails the HMAC, and the previous checkpoint is used."""
    if strategy == "deepspeed":
        request.getfixturevalue("deepspeed_on_cpu")
    monkeypatch.setenv(KEY_ENV, KEY)
    spec = _spec(tmp_path / "ckpt", strategy=strategy, steps=6)
    _interrupt(monkeypatch, spec, 5)
    newest = tmp_path / "ckpt" / "step_00000004"
    target = (newest / "dcp" / ".metadata" if strategy == "fsdp"
              else next((newest / "deepspeed" / "state").glob("*model_states.pt")))
    flag = tmp_path / "code-ran"
    target.write_bytes(__import__("pickle").dumps(_Payload(str(flag))))
    _rehash(newest)
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert not flag.exists()
    assert resumed.resumed_from_step == 2
    assert _warned(caplog, "step_00000004", "signature does not match")


def test_with_a_key_unsigned_or_foreign_checkpoints_are_refused(tmp_path, monkeypatch):
    unsigned = _spec(tmp_path / "unsigned", steps=4)
    _interrupt(monkeypatch, unsigned, 3)  # signed with the per-user key: no key is configured
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(CheckpointError, match="step_00000002: signed with another key .*from FUSEFORGE_CHECKPOINT_KEY"):
        train(unsigned)
    _rehash(tmp_path / "unsigned" / "step_00000002", unsigned=True)
    with pytest.raises(CheckpointError, match="step_00000002: not signed: it cannot be authenticated"):
        train(unsigned)
    signed = _spec(tmp_path / "signed", steps=4)
    _interrupt(monkeypatch, signed, 3)
    key_file = tmp_path / "key"  # e.g. a Kubernetes Secret mounted as a file
    key_file.write_text("another-key-0123456789abcdef\n")
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    with pytest.raises(CheckpointError, match="step_00000002: signed with another key"):
        train(signed)
    key_file.write_text(KEY + "\n")
    assert train(signed).resumed_from_step == 2
    key_file.write_text("short")
    with pytest.raises(CheckpointError, match="at least 16"):
        train(signed)


def test_in_a_pod_without_a_key_checkpoints_are_refused_before_training(monkeypatch):
    """A key made in a pod would die with it (a retry could not verify its checkpoints): none is made there."""
    import fsspec

    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    root = f"memory://fuseforge-test-{random.randrange(1 << 30)}"
    with pytest.raises(CheckpointError, match=f"no checkpoint key is set and this runs in a Kubernetes pod.*{KEY_ENV}"
                                              f".*{KEY_FILE_ENV}.*allow_unsigned_checkpoints=true"):
        train(_spec(root))
    assert not fsspec.filesystem("memory").exists(root[len("memory://"):])


def test_a_key_can_be_required_for_a_local_directory(tmp_path, monkeypatch):
    """For a local copy of remote data (e.g. Flyte's intra-task checkpoint restored from the bucket)."""
    monkeypatch.setenv("FUSEFORGE_CHECKPOINT_REQUIRE_KEY", "1")
    with pytest.raises(CheckpointError, match="no checkpoint key is set and FUSEFORGE_CHECKPOINT_REQUIRE_KEY is set"):
        train(_spec(tmp_path))
    assert not os.listdir(tmp_path)
    monkeypatch.setenv(KEY_ENV, KEY)
    assert train(_spec(tmp_path, steps=2)).steps == 2


# ----------------------------------------------------------------- signed by default (issue 35)


class _StealthyPayload:
    """Unpickling it creates a directory, then returns what the real file held: the run would carry on as if
    nothing happened."""

    def __init__(self, path, real: bytes):
        self.path, self.real = path, real

    def __reduce__(self):
        return (eval, (f"__import__('os').mkdir({self.path!r}) or __import__('pickle').loads({self.real!r})",))


def _no_configured_key(monkeypatch):
    for name in (KEY_ENV, KEY_FILE_ENV, "FUSEFORGE_CHECKPOINT_REQUIRE_KEY"):
        monkeypatch.delenv(name, raising=False)


def _unsigned_payload_in_newest(tmp_path, monkeypatch, stealthy=True):
    """An FSDP run (no key configured: the per-user key signs it) with checkpoints at steps 2 and 4, then a writer
    without the key: step 4's DCP .metadata replaced by a pickle that runs code (creating `flag`), the manifest
    made to match the files again and, all it can do about the HMAC, its signature dropped. (spec, flag)."""
    _no_configured_key(monkeypatch)
    spec = _spec(tmp_path / "ckpt", strategy="fsdp", steps=6)
    _interrupt(monkeypatch, spec, 5)
    flag = tmp_path / "code-ran"
    newest = tmp_path / "ckpt" / "step_00000004"
    metadata = newest / "dcp" / ".metadata"
    payload = _StealthyPayload(str(flag), metadata.read_bytes()) if stealthy else _Payload(str(flag))
    metadata.write_bytes(__import__("pickle").dumps(payload))
    _rehash(newest, unsigned=True)
    return spec, flag


def test_without_a_configured_key_local_runs_sign_with_a_per_user_key(tmp_path, monkeypatch, caplog):
    _no_configured_key(monkeypatch)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    spec = _spec(tmp_path / "ckpt", steps=4)
    with caplog.at_level(logging.INFO, logger="fuseforge.training"):
        _interrupt(monkeypatch, spec, 3)
    key_file = tmp_path / "config" / "fuseforge" / "checkpoint-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert _warned(caplog, "created the checkpoint key", str(key_file))
    marker = json.loads((tmp_path / "ckpt" / "step_00000002" / MARKER).read_text())
    assert len(marker["hmac"]) == 64 and marker["key_id"]
    key = key_file.read_bytes()
    assert train(spec).resumed_from_step == 2
    assert key_file.read_bytes() == key  # made once


@pytest.mark.parametrize("stealthy", [False, True], ids=["payload", "stealthy-payload"])
def test_an_unsigned_checkpoint_never_reaches_an_unpickler(tmp_path, monkeypatch, caplog, stealthy):
    """No key configured, a local checkpoint_dir: the newest checkpoint's .metadata is a pickle that runs code
    (the stealthy one then returns the real metadata). Unsigned, it is refused: the code never runs."""
    spec, flag = _unsigned_payload_in_newest(tmp_path, monkeypatch, stealthy)
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert not flag.exists()
    assert resumed.resumed_from_step == 2
    assert _warned(caplog, "step_00000004", "not signed: it cannot be authenticated", "allow_unsigned_checkpoints")


def test_a_directory_of_unsigned_checkpoints_stops_the_run_without_loading_any(tmp_path, monkeypatch):
    spec, flag = _unsigned_payload_in_newest(tmp_path, monkeypatch)
    _rehash(tmp_path / "ckpt" / "step_00000002", unsigned=True)
    with pytest.raises(CheckpointError, match="none can be loaded.*step_00000004: not signed.*step_00000002: not signed"):
        train(spec)
    assert not flag.exists()
    assert not list((tmp_path / "ckpt").glob(f"step_*/{SKIPPED}"))


def test_the_opt_in_loads_an_unsigned_checkpoint_and_warns_before_its_bytes_are_read(tmp_path, monkeypatch):
    _no_configured_key(monkeypatch)
    spec = _spec(tmp_path / "ckpt", strategy="fsdp", steps=6)
    _interrupt(monkeypatch, spec, 5)
    _rehash(tmp_path / "ckpt" / "step_00000004", unsigned=True)
    seen = []  # (message, had DCP's metadata been read when it was logged?)
    from fuseforge_flyte.training.checkpoint import dcp_metadata

    real_load = dcp_metadata.load
    loaded = []
    monkeypatch.setattr(dcp_metadata, "load", lambda stream: loaded.append(1) or real_load(stream))

    class Recorder(logging.Handler):
        def emit(self, record):
            seen.append((record.getMessage(), bool(loaded)))

    logger = logging.getLogger("fuseforge.training")
    recorder = Recorder(level=logging.WARNING)
    logger.addHandler(recorder)
    try:
        resumed = train(dataclasses.replace(spec, allow_unsigned_checkpoints=True))
    finally:
        logger.removeHandler(recorder)
    assert resumed.resumed_from_step == 4 and loaded  # opted in: loaded, its metadata through the allow-list
    said = [read for message, read in seen if "step_00000004" in message and "not signed" in message
            and "allow_unsigned_checkpoints is set" in message]
    assert said == [False]  # said once, before any byte of it reached the unpickler


@pytest.mark.parametrize("stealthy", [False, True], ids=["payload", "stealthy-payload"])
def test_even_with_the_opt_in_a_planted_dcp_pickle_runs_no_code_and_stops_the_run(tmp_path, monkeypatch,
                                                                                  stealthy):
    """Issue 49: under allow_unsigned_checkpoints the unsigned .metadata passes the manifest check, but it is read
    through an allow-list unpickler: refused naming the file, the run stops (exit 2: a user error) instead of
    falling back to step 2 and finishing with exit 0."""
    from fuseforge_flyte.user_errors import user_error_line

    spec, flag = _unsigned_payload_in_newest(tmp_path, monkeypatch, stealthy)
    with pytest.raises(CheckpointError) as refused:
        train(dataclasses.replace(spec, allow_unsigned_checkpoints=True))
    assert not flag.exists()
    line = user_error_line(refused.value)
    assert line and "step_00000004" in line and "file dcp/.metadata was refused: it names " in line
    assert "delete" in line and "falling back" in line
    assert not list((tmp_path / "ckpt").glob(f"step_*/{SKIPPED}"))
    assert _checkpoints(tmp_path / "ckpt") == ["step_00000002", "step_00000004"]  # nothing trained over them


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_checkpoints_load_with_weights_only(deepspeed_on_cpu, tmp_path, monkeypatch, zero_stage):
    """Issue 49: DeepSpeed's own engine loads with torch.load(weights_only=False); every load of a resume goes
    through weights_only=True and the small allow-list its ZeRO-2/3 files need (the loss curve is that of an
    uninterrupted run)."""
    spec = _spec(tmp_path / "ckpt", strategy="deepspeed", zero_stage=zero_stage, steps=4)
    whole = train(_spec(tmp_path / "whole", strategy="deepspeed", zero_stage=zero_stage, steps=4))
    _interrupt(monkeypatch, spec, 3)
    real_load, modes = torch.load, []

    def spy(*args, **kwargs):
        modes.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    resumed = train(spec)
    assert resumed.resumed_from_step == 2 and resumed.loss_curve == whole.loss_curve
    assert len(modes) >= 3 and set(modes) == {True}, modes  # model, optimizer, RNG states


@pytest.mark.parametrize("payload", ["torch-save", "raw-pickle"])
def test_even_with_the_opt_in_a_planted_deepspeed_pickle_runs_no_code_and_stops_the_run(
        deepspeed_on_cpu, tmp_path, monkeypatch, payload):
    """Issue 49: under allow_unsigned_checkpoints a DeepSpeed file that would run code is refused naming the file,
    and the run stops (a user error) as for a DCP pickle, instead of falling back to step 2."""
    from fuseforge_flyte.user_errors import user_error_line

    _no_configured_key(monkeypatch)
    spec = _spec(tmp_path / "ckpt", strategy="deepspeed", steps=6, allow_unsigned_checkpoints=True)
    _interrupt(monkeypatch, spec, 5)
    newest = tmp_path / "ckpt" / "step_00000004"
    target = next((newest / "deepspeed" / "state").glob("*model_states.pt"))
    flag = tmp_path / "code-ran"
    if payload == "torch-save":
        torch.save({"module": _Payload(str(flag))}, target)
    else:
        target.write_bytes(__import__("pickle").dumps(_Payload(str(flag))))
    _rehash(newest, unsigned=True)
    with pytest.raises(CheckpointError) as refused:
        train(spec)
    assert not flag.exists()
    line = user_error_line(refused.value)
    rel = target.relative_to(newest).as_posix()
    expected = ("was refused: it names posix.mkdir, which a DeepSpeed checkpoint never holds" if payload == "torch-save"
                else "is not a file DeepSpeed writes")
    assert line and "step_00000004" in line and f"file {rel} {expected}" in line and "falling back" in line
    assert _checkpoints(tmp_path / "ckpt") == ["step_00000002", "step_00000004"]


def test_a_deepspeed_load_admits_no_other_global(tmp_path):
    """The load itself, not only the check before it: a torch.save file naming anything off the allow-list is
    refused naming the file, and its code never runs."""
    from fuseforge_flyte.training.checkpoint.dcp_metadata import RefusedPickle, deepspeed_load

    flag, path = tmp_path / "code-ran", tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": _Payload(str(flag))}, path)
    with pytest.raises(RefusedPickle, match=f"DeepSpeed file {path} was refused .*posix.mkdir"):
        deepspeed_load(str(path))
    assert not flag.exists()


def test_dcp_metadata_reads_through_the_allow_list_exactly(fsdp_reference, tmp_path):
    """What a real FSDP save pickles is admitted (same object as pickle.load gives); a payload is refused."""
    import pickle

    from fuseforge_flyte.training.checkpoint import dcp_metadata

    spec = _spec(tmp_path, strategy="fsdp", steps=2)
    train(spec)
    path = tmp_path / "step_00000002" / "dcp" / ".metadata"
    with open(path, "rb") as handle:
        restricted = dcp_metadata.load(handle)
    assert restricted == pickle.loads(path.read_bytes())
    flag = tmp_path / "code-ran"
    path.write_bytes(pickle.dumps(_Payload(str(flag))))
    assert "file dcp/.metadata was refused: it names posix.mkdir" in dcp_metadata.refusal(
        str(tmp_path / "step_00000002"), {"dcp/.metadata": {}})
    assert not flag.exists()


def test_a_planted_skip_mark_in_the_newest_signed_checkpoint_is_ignored_and_said(reference, tmp_path, monkeypatch,
                                                                                caplog):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 7)
    (tmp_path / "step_00000006" / SKIPPED).write_text(json.dumps({"reason": "planted", "time": time.time()}))
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 6 and resumed.steps_redone == 1  # no fall back to step 4
    assert resumed.loss_curve == reference.loss_curve
    assert _warned(caplog, f"ignoring {SKIPPED} in checkpoint", "step_00000006", "signature does not match")


def test_a_skip_mark_counts_for_the_checkpoint_it_was_made_for_only_and_is_said(reference, tmp_path, monkeypatch,
                                                                                caplog):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 7)
    with open(tmp_path / "step_00000006" / "optimizer.pt", "r+b") as handle:
        handle.truncate(10)
    _interrupt(monkeypatch, spec, 5)  # falls back to step 4 and marks 6; fails before writing step 6 again
    mark = tmp_path / "step_00000006" / SKIPPED
    assert json.loads(mark.read_text())["hmac"]
    shutil.copy(mark, tmp_path / "step_00000004" / SKIPPED)  # a valid mark, replayed onto another checkpoint
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 4 and resumed.loss_curve == reference.loss_curve
    assert _warned(caplog, "skipping checkpoint", "step_00000006", f"marked {SKIPPED} by an earlier attempt",
                   "optimizer.pt is 10 bytes")
    assert _warned(caplog, f"ignoring {SKIPPED} in checkpoint", "step_00000004", "signature does not match")


def test_full_bucket_is_reported_as_such(monkeypatch):
    from fsspec.implementations.memory import MemoryFileSystem

    def put_file(self, lpath, rpath, **kwargs):
        raise OSError("QuotaExceeded: the bucket's storage quota is exhausted")

    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setattr(MemoryFileSystem, "put_file", put_file)
    root = f"memory://fuseforge-test-{random.randrange(1 << 30)}"
    with pytest.raises(CheckpointError, match=r"uploading checkpoint step_00000002 to memory://.* failed: the store "
                                              r"is full or over its quota.*QuotaExceeded"):
        train(_spec(root))


def test_object_store_checkpoint_changed_in_the_bucket_is_refused(reference, monkeypatch, caplog):
    import fsspec

    monkeypatch.setenv(KEY_ENV, KEY)
    root = f"memory://fuseforge-test-{random.randrange(1 << 30)}"
    spec = _spec(root)
    _interrupt(monkeypatch, spec, 5)
    fs, path = fsspec.filesystem("memory"), root[len("memory://"):]
    model = f"{path}/step_00000004/model.pt"
    data = bytearray(fs.cat_file(model))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(model, bytes(data))
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 2 and resumed.loss_curve == reference.loss_curve
    assert _warned(caplog, "step_00000004", "file model.pt changed since it was written")
    fs.rm(path, recursive=True)


def test_damaged_fsdp_checkpoint_falls_back_to_the_previous_one(fsdp_reference, tmp_path, monkeypatch, caplog):
    """DCP raises CheckpointException (a BaseException) for a bad shard: it must skip, not crash every restart."""
    spec = _spec(tmp_path, strategy="fsdp")
    _interrupt(monkeypatch, spec, 7)
    newest = tmp_path / "step_00000006"
    shard = next((newest / "dcp").glob("*.distcp"))
    shard.write_bytes(bytes(shard.stat().st_size))
    _rehash(newest, sign=True)  # signed again with the run's key: the manifest verifies, only loading can notice
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 4
    assert resumed.loss_curve == fsdp_reference.loss_curve
    assert _warned(caplog, "step_00000006", "loading failed", "CheckpointException")


def test_save_is_refused_before_writing_when_the_disk_is_too_full(tmp_path, monkeypatch):
    from fuseforge_flyte.training.checkpoint import manager

    calls = []

    def free_bytes(path):  # room for the first checkpoint only
        calls.append(path)
        return (10**12 if len(calls) == 1 else 1000), 10**12

    monkeypatch.setattr(manager, "free_bytes", free_bytes, raising=False)
    with pytest.raises(CheckpointError, match=r"not enough free space for checkpoint step_00000004 .*: 1000 bytes "
                                              r"free of 931.32 GiB, and a checkpoint takes about .* MiB \(the size "
                                              r"of the last one\).*keep_last=3 holds 4 checkpoints"):
        train(_spec(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["progress.json", "step_00000002"]


_FULL_DISK = """
import resource, signal, sys, torch
from fuseforge_flyte.training.checkpoint import CheckpointError
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.spec import TrainSpec
torch.set_num_threads(1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    train(TrainSpec(model="tiny-llama", dataset="bench:bytes", steps=4, batch_size=2, seq_len=32, kernels=False,
                    checkpoint_dir=sys.argv[1], checkpoint_every=2))
except CheckpointError as err:
    from fuseforge_flyte.user_errors import user_error_line
    print("CheckpointError:", err)
    print("LINE:", user_error_line(err))
    sys.exit(3)
"""


def test_disk_full_while_writing_is_reported_as_such(tmp_path):
    """torch's zip writer says 'unexpected pos'; the error must say the disk is full, with the free space."""
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 3, output
    assert "writing checkpoint step_00000002 failed: the disk holding" in output and "is full" in output, output
    assert " free of " in output and "unexpected pos" in output
    assert "LINE: writing checkpoint step_00000002 failed: the disk holding" in output  # a user error: one line, exit 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["progress.json"]  # the partial files are gone


def test_sigterm_checkpoints_the_step_and_resume_redoes_nothing(reference, tmp_path, monkeypatch):
    from fuseforge_flyte.training.preemption import SIGNAL_ENV, Preempted

    spec = _spec(tmp_path)
    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setenv(SIGNAL_ENV, "0:5")
    with pytest.raises(Preempted) as stop:
        train(spec)
    monkeypatch.delenv(SIGNAL_ENV)
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    assert stop.value.step == 5 and stop.value.checkpoint == str(tmp_path / "step_00000005")
    assert stop.value.metrics.loss_curve == reference.loss_curve[:5]
    resumed = train(spec)
    assert resumed.resumed_from_step == 5 and resumed.steps_redone == 0
    assert resumed.loss_curve == reference.loss_curve


_ELASTIC = dict(model="tiny-llama", dataset="bench:bytes", seq_len=32, batch_size=1, lr=3e-3, kernels=False, seed=5)
_AGENT = """
import json, sys
from fuseforge_flyte.training.local import run_local
from fuseforge_flyte.training.spec import TrainSpec
run_local(TrainSpec(**json.loads(sys.argv[1])), 2, start_method="fork")
"""


def _launch(spec, **kwargs):
    from fuseforge_flyte.training.local import run_local

    return run_local(spec, 2, start_method=forking.start_method(), **kwargs)


def test_sigterm_to_the_elastic_agent_checkpoints_and_the_restart_redoes_nothing(tmp_path):
    """As on a Kubernetes eviction: the agent gets SIGTERM and forwards it to its workers (SIGKILL 30 s later)."""
    settings = dict(_ELASTIC, strategy="fsdp", steps=30, checkpoint_every=10, keep_last=2)
    uninterrupted = _launch(TrainSpec(**settings, checkpoint_dir=str(tmp_path / "uninterrupted")))[0]
    ckpt = tmp_path / "evicted"
    log_file = tmp_path / "agent.log"
    with open(log_file, "w") as out:
        agent = subprocess.Popen([sys.executable, "-c", _AGENT, json.dumps(dict(settings, checkpoint_dir=str(ckpt)))],
                                 stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and agent.poll() is None:
            try:
                if json.loads((ckpt / "progress.json").read_text())["furthest_step"] >= 4:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        agent.send_signal(signal.SIGTERM)
        returncode = agent.wait(timeout=120)
    output = log_file.read_text()
    assert returncode != 0, output
    stopped = json.loads((ckpt / "progress.json").read_text())["furthest_step"]
    assert 4 <= stopped < 30, output
    assert (ckpt / f"step_{stopped:08d}" / MARKER).exists(), output
    assert "SIGTERM received" in output and f"preempted (SIGTERM) after step {stopped}" in output

    resumed = _launch(TrainSpec(**settings, checkpoint_dir=str(ckpt)))
    for metrics in resumed.values():
        assert metrics.resumed_from_step == stopped and metrics.steps_redone == 0
        assert metrics.loss_curve == uninterrupted.loss_curve


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, monkeypatch):
    """Only rank 1's pod was evicted: the all-reduced flag makes both ranks checkpoint step 3 and stop."""
    from fuseforge_flyte.training.preemption import SIGNAL_ENV

    settings = dict(_ELASTIC, strategy="ddp", steps=6, checkpoint_every=4)
    uninterrupted = _launch(TrainSpec(**settings, checkpoint_dir=str(tmp_path / "uninterrupted")))[0]
    monkeypatch.setenv(SIGNAL_ENV, "1:3")  # first attempt only
    restarted = _launch(TrainSpec(**settings, checkpoint_dir=str(tmp_path / "evicted")), max_restarts=1)
    for metrics in restarted.values():
        assert metrics.restarts == 1
        assert metrics.resumed_from_step == 3 and metrics.steps_redone == 0
        assert metrics.loss_curve == uninterrupted.loss_curve


def test_prepared_data_identity_is_part_of_the_settings(tmp_path):
    """Real data: the prepared data's source, format and counts, not its directory, identify it."""
    spec = dict(model="tiny-llama", dataset="builtin:chat", tokenizer="builtin:tiny-bpe", steps=1, batch_size=2,
                seq_len=64, kernels=False, checkpoint_dir=str(tmp_path))
    train(TrainSpec(**spec))
    with pytest.raises(CheckpointError, match=r"dataset.eval_source: '' -> 'eval_fraction=0.1'; "
                                              r"dataset.train_loss_tokens: \d+ -> \d+"):
        train(TrainSpec(**spec, eval_fraction=0.1))


@contextlib.contextmanager
def _flyte_attempt(checkpoint):
    """This process as a Flyte task attempt whose intra-task checkpoint is `checkpoint`."""
    from flytekit.core.context_manager import ExecutionParameters, FlyteContextManager

    ctx = FlyteContextManager.current_context()
    params = ExecutionParameters.new_builder(ctx.user_space_params)
    params.checkpoint = checkpoint
    state = ctx.execution_state.with_params(user_space_params=params.build())
    with FlyteContextManager.with_context(ctx.with_execution_state(state)):
        yield


def test_default_checkpoint_location_survives_preemption_across_attempts(reference, tmp_path, monkeypatch):
    """checkpoint_dir="" on a cluster: attempt 1 is evicted after step 5 and saves into its Flyte checkpoint;
    attempt 2 restores it (signed bytes only), hands it on at once, and resumes with nothing redone."""
    from flytekit.core.checkpointer import SyncCheckpoint

    from fuseforge_flyte.flyte_checkpoint import MIRROR_ENV, restore_previous, worker_hook
    from fuseforge_flyte.training.checkpoint.signing import REQUIRE_KEY_ENV
    from fuseforge_flyte.training.preemption import SIGNAL_ENV, Preempted

    monkeypatch.setenv(KEY_ENV, KEY)
    first = SyncCheckpoint(checkpoint_dest=str(tmp_path / "flyte" / "attempt-1"))
    env = {}
    local = restore_previous(first, nnodes=1, launch_env=env)
    assert env == {MIRROR_ENV: "1"} and os.listdir(local) == []  # nothing to restore in the first attempt
    monkeypatch.setenv(MIRROR_ENV, "1")
    monkeypatch.setenv(SIGNAL_ENV, "0:5")
    with _flyte_attempt(first), pytest.raises(Preempted):
        train(_spec(local), after_checkpoint=worker_hook())
    monkeypatch.delenv(SIGNAL_ENV)
    assert "step_00000005" in os.listdir(tmp_path / "flyte" / "attempt-1")  # uploaded within the grace period

    second = SyncCheckpoint(checkpoint_dest=str(tmp_path / "flyte" / "attempt-2"),
                            checkpoint_src=str(tmp_path / "flyte" / "attempt-1"))
    env = {}
    local = restore_previous(second, nnodes=1, launch_env=env)
    assert env == {MIRROR_ENV: "1", REQUIRE_KEY_ENV: "1"}
    assert "step_00000005" in os.listdir(tmp_path / "flyte" / "attempt-2")  # handed on before any new save
    monkeypatch.setenv(REQUIRE_KEY_ENV, "1")
    with _flyte_attempt(second):
        resumed = train(_spec(local), after_checkpoint=worker_hook())
    assert resumed.resumed_from_step == 5 and resumed.steps_redone == 0
    assert resumed.loss_curve == reference.loss_curve
    assert f"step_{STEPS:08d}" in os.listdir(tmp_path / "flyte" / "attempt-2")


def test_default_checkpoint_location_is_one_node_only(caplog):
    from flytekit.core.checkpointer import SyncCheckpoint

    from fuseforge_flyte.flyte_checkpoint import restore_previous

    env = {}
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        assert restore_previous(SyncCheckpoint(checkpoint_dest="/unused"), nnodes=2, launch_env=env) is None
    assert env == {} and "set checkpoint_dir to an object store" in caplog.text


# ----------------------------------------------------------------- issue 49: lost work from verified facts


def test_each_restart_counts_only_the_steps_it_repeated(tmp_path, monkeypatch):
    """Furthest step 10, checkpoint at 6; two restarts die after step 7 (1 repeated each), the third finishes
    (7..10 repeated, 11..12 new): 1 + 1 + 4 = 6 steps redone, not 3 x (10 - 6) = 12."""
    spec = _spec(tmp_path, steps=12, checkpoint_every=6)
    _interrupt(monkeypatch, spec, 10)
    _interrupt(monkeypatch, spec, 7)
    _interrupt(monkeypatch, spec, 7)
    resumed = train(spec)
    assert resumed.resumed_from_step == 6 and resumed.steps_redone == 6


def test_a_kill_between_a_step_and_anything_after_it_still_counts_that_step(tmp_path, monkeypatch):
    """Step 5's update is done, then the process dies before anything after it is written: the restart from the
    checkpoint at step 4 redoes step 5, and says 1."""
    from fuseforge_flyte.training import engine

    spec = _spec(tmp_path)
    real = engine._Run._one_step

    def dies_after_step_5(self, micro_batches, step):
        result = real(self, micro_batches, step)
        if step == 5:
            raise InjectedFault("killed right after step 5's update")
        return result

    with monkeypatch.context() as patch:
        patch.setattr(engine._Run, "_one_step", dies_after_step_5)
        with pytest.raises(InjectedFault):
            train(spec)
    resumed = train(spec)
    assert resumed.resumed_from_step == 4 and resumed.steps_redone == 1


def test_an_unreadable_progress_record_falls_back_to_the_checkpoints_and_says_so(tmp_path, monkeypatch, caplog):
    """Attempt 2 redoes step 5 and saves step 6 (carrying 1 redone step); then progress.json is garbage: the figure
    falls back to the resumed checkpoint's 1 (a lower bound, said), not 0."""
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 5)
    _interrupt(monkeypatch, spec, 7)
    (tmp_path / "progress.json").write_bytes(b"\xff\xfe{not json")
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 6 and resumed.steps_redone == 1
    assert _warned(caplog, "ignoring unreadable", "progress.json", "lower bound")


@pytest.mark.parametrize("edit", ["changed", "unsigned"])
def test_an_edited_progress_record_is_ignored_and_said(tmp_path, monkeypatch, caplog, edit):
    """furthest_step edited to 1000 (the signature kept, or dropped): ignored with a warning, the figure counted
    from the signed checkpoint (0 here: step 7 of the first attempt is not in any verified record), never 994."""
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 7)
    record = json.loads((tmp_path / "progress.json").read_text())
    record["furthest_step"] = 1000
    if edit == "unsigned":
        record = {k: v for k, v in record.items() if k not in ("hmac", "key_id")}
    (tmp_path / "progress.json").write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 6 and resumed.steps_redone == 0
    assert _warned(caplog, "ignoring", "progress.json", "does not match" if edit == "changed" else "not signed")


def test_without_a_key_an_edited_progress_record_is_capped_at_the_run_s_steps(tmp_path, monkeypatch, caplog):
    """Unsigned checkpoints (no key, the opt-in): the record cannot be authenticated, but counts at most up to the
    run's steps: resumed at 6 of 8, at most 2 steps can be repeated."""
    _no_configured_key(monkeypatch)
    monkeypatch.setenv("FUSEFORGE_CHECKPOINT_REQUIRE_KEY", "1")
    spec = _spec(tmp_path, allow_unsigned_checkpoints=True)
    _interrupt(monkeypatch, spec, 7)
    (tmp_path / "progress.json").write_text(json.dumps({"furthest_step": 1000, "steps_redone": 0}))
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 6 and resumed.steps_redone == 2
    assert _warned(caplog, "progress.json records step 1000, beyond this run's steps=8")


# ----------------------------------------------------------------- issue 49: pruning removes only what a save wrote


def test_pruning_keeps_the_user_s_files_and_cleans_the_platform_s_leftovers(tmp_path, monkeypatch, caplog):
    """A regular file and a folder of the user's named like checkpoints stay; an earlier attempt's incomplete
    checkpoint newer than the newest, a torn progress.json temp file and an unfinished save go, each said."""
    spec = _spec(tmp_path, steps=6, keep_last=1)
    (tmp_path / "step_00000001").write_text("my notes")
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / "notes.txt").write_text("mine too")
    leftover = tmp_path / "step_00000007"  # what an interrupted upload of a longer earlier run leaves
    (leftover / "rng").mkdir(parents=True)
    (leftover / "trainer_state.json").write_text("{}")
    (tmp_path / "progress.json.0123abcd.tmp").write_text('{"furthest_step": 3')
    (tmp_path / ".tmp-step_00000009-0123456789ab").mkdir()
    with caplog.at_level(logging.INFO, logger="fuseforge.training"):
        assert train(spec).steps == 6
    assert (tmp_path / "step_00000001").read_text() == "my notes"
    assert (tmp_path / "step_00000003" / "notes.txt").read_text() == "mine too"
    assert sorted(os.listdir(tmp_path)) == ["progress.json", "step_00000001", "step_00000003", "step_00000006"]
    assert _warned(caplog, "removed incomplete checkpoint", "step_00000007")
    assert _warned(caplog, "removing", "progress.json.0123abcd.tmp", "interrupted write")
    assert _warned(caplog, "leaving", "step_00000003", "notes.txt")


# ----------------------------------------------------------------- issue 49: every failure one clear line


def _cli(ckpt_dir, *extra, steps=STEPS):
    """The engine's command line with _spec's settings; its exit status."""
    from fuseforge_flyte.training import cli

    return cli.main(["--model", "tiny-llama", "--dataset", "bench:bytes", "--steps", str(steps), "--batch_size", "2",
                     "--seq_len", "32", "--lr", "3e-3", "--warmup_steps", "2", "--no_kernels", "--checkpoint_dir",
                     str(ckpt_dir), "--checkpoint_every", "2", "--keep_last", "3", "--seed", "3", "--log_level",
                     "WARNING", *extra])


def _one_line(capsys):
    err = capsys.readouterr().err.splitlines()
    assert err and err[-1].startswith("error: ") and not any("Traceback" in line for line in err), err[-8:]
    return err[-1]


def test_none_loadable_and_another_key_s_checkpoints_end_with_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 5)  # signed with the per-user key
    monkeypatch.setenv(KEY_ENV, KEY)
    assert _cli(tmp_path) == 2
    line = _one_line(capsys)
    assert str(tmp_path) in line and "none can be loaded" in line and "signed with another key" in line
    assert "allow_unsigned_checkpoints=true" in line
    monkeypatch.delenv(KEY_ENV)
    for name in ("step_00000002", "step_00000004"):
        with open(tmp_path / name / "model.pt", "r+b") as handle:
            handle.truncate(100)
    assert _cli(tmp_path) == 2
    line = _one_line(capsys)
    assert "none can be loaded" in line and "truncated" in line and "fix or move them" in line


def _read_only(monkeypatch, directory):
    """Writing under `directory` fails as on a read-only filesystem (root ignores permission bits)."""
    import builtins
    import errno

    real = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wxa+") and str(file).startswith(str(directory)):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)


def test_a_read_only_checkpoint_dir_says_so_and_a_finished_copy_resumes(tmp_path, monkeypatch, capsys, caplog):
    done, part = _spec(tmp_path / "done", steps=4), _spec(tmp_path / "part", steps=4)
    train(done)
    _interrupt(monkeypatch, part, 3)
    with monkeypatch.context() as patch:
        _read_only(patch, tmp_path)
        with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
            resumed = train(done)  # nothing left to train: resumes read-only
        assert resumed.resumed_from_step == 4 and resumed.steps == 4
        assert _warned(caplog, "not writable", "Read-only file system", "resumed from it read-only")
        assert _cli(tmp_path / "part", steps=4) == 2  # steps left: it would fail at its first save
    line = _one_line(capsys)
    assert f"checkpoint_dir '{tmp_path / 'part'}' is not writable (OSError: Read-only file system)" in line
    assert "set checkpoint_dir to that" in line and ".tmp" not in line


def _tree(directory):
    """Every name under `directory` with its bytes' digest (folders too): what must not change."""
    tree = {}
    for base, dirs, files in os.walk(directory):
        for name in dirs:
            tree[os.path.relpath(os.path.join(base, name), directory)] = "dir"
        for name in files:
            path = os.path.join(base, name)
            tree[os.path.relpath(path, directory)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return tree


@pytest.fixture
def read_only_copy(tmp_path, monkeypatch):
    """A copy of a run's good checkpoints (steps 2 and 4, progress at 5), read-only, and what it holds."""
    source = tmp_path / "source"
    _interrupt(monkeypatch, _spec(source), 5)
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    before = _tree(copy)
    _read_only(monkeypatch, copy)
    return copy, before


def test_resume_from_a_read_only_copy_with_saving_off(reference, tmp_path, read_only_copy, caplog):
    copy, before = read_only_copy
    with caplog.at_level(logging.INFO, logger="fuseforge.training"):
        resumed = train(_spec("off", checkpoint_every=0, resume_from=str(copy)))
    assert resumed.resumed_from_step == 4
    assert resumed.loss_curve == reference.loss_curve  # bitwise, as from checkpoint_dir
    assert _warned(caplog, "resumed from checkpoint", str(copy / "step_00000004"), "read only")
    assert _tree(copy) == before  # no progress record, skip mark, pruning or temp file there


def test_resume_from_a_read_only_copy_saving_elsewhere_then_restart(reference, tmp_path, monkeypatch,
                                                                    read_only_copy):
    copy, before = read_only_copy
    new = tmp_path / "new"
    spec = _spec(new, resume_from=str(copy))
    _interrupt(monkeypatch, spec, 7)  # resumed from the copy's step 4, saved step 6 into new
    assert _checkpoints(new) == ["step_00000006"]
    resumed = train(spec)  # a restart of the same run: new's step 6 is newer than the copy's 4
    assert resumed.resumed_from_step == 6 and resumed.steps_redone == 1
    assert resumed.loss_curve == reference.loss_curve
    assert _checkpoints(new) == ["step_00000006", "step_00000008"]
    assert json.loads((new / "progress.json").read_text())["furthest_step"] == 8
    assert _tree(copy) == before
    damaged = train(_spec(tmp_path / "other", resume_from=str(copy), keep_last=1))
    assert damaged.resumed_from_step == 4 and _checkpoints(tmp_path / "other") == ["step_00000008"]
    assert _tree(copy) == before  # keep_last prunes only checkpoint_dir


def test_resume_from_meets_the_same_settings_check(tmp_path, read_only_copy):
    from fuseforge_flyte.training.checkpoint import ResumeMismatch, check_resume_settings

    copy, before = read_only_copy
    spec = _spec(tmp_path / "new", lr=1e-3, resume_from=str(copy))
    with pytest.raises(ResumeMismatch, match=r"lr: 0\.003 -> 0\.001"):
        check_resume_settings(spec)  # in the launching process
    with pytest.raises(ResumeMismatch, match=r"lr: 0\.003 -> 0\.001"):
        train(spec)  # in the workers
    assert _tree(copy) == before and not (tmp_path / "new").exists()


def test_a_resume_from_without_checkpoints_is_one_line_naming_it(tmp_path, capsys):
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    assert _cli(tmp_path / "new", "--resume_from", str(missing)) == 2
    assert _one_line(capsys) == (f"error: resume_from {str(missing)!r} does not exist: set it to a folder or URI "
                                 f"that holds checkpoints")
    empty.mkdir()
    (empty / "step_00000004").mkdir()  # no manifest: not a checkpoint
    assert _cli("off", "--checkpoint_every", "0", "--resume_from", str(empty)) == 2
    line = _one_line(capsys)
    assert f"resume_from {str(empty)!r} holds no checkpoint" in line and "COMPLETE.json" in line


def test_sigterm_writes_the_metrics_file_with_the_preempted_step_and_one_line(tmp_path, monkeypatch, capsys):
    from fuseforge_flyte.training.preemption import SIGNAL_ENV

    monkeypatch.setenv(SIGNAL_ENV, "0:3")
    assert _cli(tmp_path / "ckpt", "--metrics_file", str(tmp_path / "metrics.json")) == 2
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 3
    checkpoint = tmp_path / "ckpt" / "step_00000003"
    expected = f"error: preempted (SIGTERM) after step 3: checkpoint {checkpoint} holds it; a restart resumes there"
    assert _one_line(capsys) == expected


@pytest.mark.parametrize("manifest", [b"{}", bytes(range(128, 256))], ids=["empty", "garbage"])
def test_an_empty_or_garbage_manifest_is_named_as_such(tmp_path, monkeypatch, caplog, manifest):
    spec = _spec(tmp_path)
    _interrupt(monkeypatch, spec, 5)
    (tmp_path / "step_00000004" / MARKER).write_bytes(manifest)
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        resumed = train(spec)
    assert resumed.resumed_from_step == 2
    expected = ("its manifest COMPLETE.json is {}, not a checkpoint manifest" if manifest == b"{}"
                else "its manifest COMPLETE.json is not text (128 bytes of binary data)")
    assert _warned(caplog, "step_00000004", expected)
    assert not _warned(caplog, "older fuseforge") and not _warned(caplog, "UnicodeDecodeError")
