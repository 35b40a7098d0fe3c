"""Scale-out (issue 9) and elastic restarts (issue 7) on the CPU: gloo, 2 local worker processes.

Workers are started by torch elastic (the launcher behind torchrun and Flyte's
Elastic task) with start_method "fork", which takes a fraction of a second.
Every multi-process run uses the same global batch as a single-process reference
run, so their loss curves must agree to fp32 reduction-order noise.

DeepSpeed (optional extra) is tested when importable. Its CPU backend JIT-compiles
a shared-memory all-reduce op on first use (1-3 minutes); that op serves only
inference all-reduce, so these tests replace its builder with "not available"
(gloo does all the collectives). Set FUSEFORGE_TEST_DS_SHM=1 to build it instead.
"""

import logging
import math
import os

import pytest
import torch

from fuseforge_flyte.training.distributed import DistContext
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.faults import FAULT_ENV, NONFINITE_ENV
from fuseforge_flyte.training.lm_head import PartitionedWeightError, check_full_lm_head
from fuseforge_flyte.training.local import run_local
from fuseforge_flyte.training.models import build_model
from fuseforge_flyte.training.spec import TrainSpec
from fuseforge_flyte.training.strategies import make_strategy
import forking  # tests/support

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

GLOBAL_BATCH = 4
STEPS = 4


def _spec(**overrides):
    base = dict(model="tiny-llama", dataset="bench:bytes", steps=STEPS, batch_size=GLOBAL_BATCH, seq_len=32,
                lr=3e-3, kernels=False, seed=5)
    base.update(overrides)
    return TrainSpec(**base)


def _launch(spec, nproc=2, **kwargs):
    return run_local(spec, nproc, start_method=forking.start_method(), **kwargs)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""




@pytest.fixture(scope="module")
def reference():
    """Plain single-process training with the global batch."""
    return train(_spec())


@pytest.mark.parametrize("strategy,extra", [
    ("ddp", {}),
    ("ddp", {"grad_accum": 2}),
    ("fsdp", {}),
    ("fsdp", {"kernels": True}),  # fused linear CE with lm_head in the sharded root unit
    ("deepspeed", {"zero_stage": 2}),
    ("deepspeed", {"zero_stage": 3}),
    ("deepspeed", {"zero_stage": 3, "kernels": True}),  # fused linear CE with a ZeRO-3 partitioned lm_head
], ids=["ddp", "ddp-accum", "fsdp", "fsdp-kernels", "zero2", "zero3", "zero3-kernels"])
def test_two_processes_match_single_process(reference, strategy, extra, request):
    if strategy == "deepspeed":
        request.getfixturevalue("deepspeed_on_cpu")
    accum = extra.get("grad_accum", 1)
    results = _launch(_spec(strategy=strategy, batch_size=GLOBAL_BATCH // 2 // accum, **extra))
    assert sorted(results) == [0, 1]
    for metrics in results.values():  # every rank returns the same, all-reduced numbers
        assert metrics.world_size == 2 and metrics.strategy == strategy
        assert metrics.tokens_per_step == reference.tokens_per_step
        torch.testing.assert_close(metrics.loss_curve, reference.loss_curve, rtol=2e-5, atol=2e-5)
    assert results[0].loss_curve == results[1].loss_curve
    assert results[0].loss_curve[-1] < results[0].loss_curve[0]
    if extra.get("kernels"):  # the unfused reference: fused kernels + sharding change nothing numerically
        assert "fused_linear_cross_entropy" in results[0].kernels_patched
    assert results[0].tokens_per_s > 0 and results[0].peak_memory_gib > 0


def test_elastic_restart_resumes_and_matches_unkilled_run(tmp_path, monkeypatch):
    """SIGKILL rank 0 after step 5; the restarted workers resume from step 4 and finish identically."""
    spec = dict(strategy="fsdp", batch_size=2, steps=7, checkpoint_every=2, keep_last=2)
    unkilled = _launch(_spec(checkpoint_dir=str(tmp_path / "unkilled"), **spec))[0]

    monkeypatch.setenv(FAULT_ENV, "0:5")  # only in the first attempt (TORCHELASTIC_RESTART_COUNT=0)
    restarted = _launch(_spec(checkpoint_dir=str(tmp_path / "killed"), **spec), max_restarts=1)
    for metrics in restarted.values():
        assert metrics.restarts == 1
        assert metrics.resumed_from_step == 4
        assert metrics.steps_redone == 1
        assert metrics.loss_curve == unkilled.loss_curve  # same world size: bitwise identical
        assert metrics.final_loss == unkilled.final_loss
    assert sorted(os.listdir(tmp_path / "killed")) == ["progress.json", "step_00000006", "step_00000007"]


def _count_attempts(monkeypatch, tmp_path):
    """Record TORCHELASTIC_RESTART_COUNT each time a (forked) worker starts training."""
    import fuseforge_flyte.training.local as local

    log = tmp_path / "attempts.txt"

    def counted(spec, **options):
        with open(log, "a") as handle:
            handle.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "\n")
        return train(spec, **options)

    monkeypatch.setattr(local, "train", counted)
    forking.required()
    return lambda: sorted(set(log.read_text().split())) if log.exists() else []


def test_out_of_memory_in_the_first_step_is_not_retried(tmp_path, monkeypatch):
    """OOM on rank 1 before any step finished: one fast replay round ends the run, not max_restarts attempts."""
    from fuseforge_flyte.training.permanent import PermanentFailure

    attempts = _count_attempts(monkeypatch, tmp_path)
    monkeypatch.setenv(FAULT_ENV, "1:1:oom")
    with pytest.raises(PermanentFailure, match=r"(?s)not retried.*rank 1: FirstStepOutOfMemory: out of memory in "
                                               r"the first step.*batch_size.*injected out of memory"):
        _launch(_spec(steps=3, batch_size=2), max_restarts=3)
    assert attempts() == ["0"]  # training ran in the first round only; the restarted workers did not train


def test_out_of_memory_after_a_finished_step_is_retried(tmp_path, monkeypatch):
    """The same error after step 1 fitted may be transient (fragmentation, a neighbour): restarts go on."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    attempts = _count_attempts(monkeypatch, tmp_path)
    monkeypatch.setenv(FAULT_ENV, "1:2:oom")
    with pytest.raises(ChildFailedError, match="injected out of memory"):
        _launch(_spec(steps=3, batch_size=2), max_restarts=1)
    assert attempts() == ["0", "1"]


@pytest.mark.parametrize("strategy,extra", [("ddp", {}), ("fsdp", {}), ("deepspeed", {"zero_stage": 3})],
                         ids=["ddp", "fsdp", "zero3"])
def test_nonfinite_skip_is_agreed_by_all_ranks(monkeypatch, request, strategy, extra):
    """NaN on rank 1 only: every rank skips that step, and training continues as in one process."""
    if strategy == "deepspeed":
        request.getfixturevalue("deepspeed_on_cpu")
    monkeypatch.setenv(NONFINITE_ENV, "0:2")
    single = train(_spec(steps=5, nonfinite_policy="skip"))
    monkeypatch.setenv(NONFINITE_ENV, "1:2")
    results = _launch(_spec(steps=5, strategy=strategy, batch_size=2, nonfinite_policy="skip", **extra))
    for metrics in results.values():
        assert metrics.skipped_steps == single.skipped_steps == 1
        assert math.isnan(metrics.loss_curve[1]) and math.isnan(single.loss_curve[1])
        torch.testing.assert_close(metrics.loss_curve[2:], single.loss_curve[2:], rtol=2e-5, atol=2e-5)


def _fsdp_guard_worker():
    """Outside the root forward FSDP2 holds lm_head.weight as a DTensor shard; inside it is whole."""
    torch.set_num_threads(1)
    ctx = DistContext.from_env(need_group=True)
    try:
        spec = _spec(strategy="fsdp")
        strategy = make_strategy(spec, ctx, build_model(spec.model, seed=0, device=ctx.device), fused_loss=True)
        with pytest.raises(PartitionedWeightError, match="DTensor shard"):
            check_full_lm_head(strategy.inner)
        ids = torch.randint(0, 259, (2, 16))
        strategy.backward(strategy.forward({"input_ids": ids, "labels": ids}, True))  # the guard passes inside
        return True
    finally:
        ctx.close()


def test_fsdp_lm_head_guard():
    from fuseforge_flyte.training.local import launch_local

    assert launch_local(_fsdp_guard_worker, 2, start_method=forking.start_method()) == {0: True, 1: True}


def test_zero3_lm_head_guard(deepspeed_on_cpu, monkeypatch):
    """ZeRO-3 leaves an empty placeholder outside the root forward; registered as external, it is whole inside."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    ctx = DistContext.from_env(need_group=True)
    spec = _spec(strategy="deepspeed", zero_stage=3)
    strategy = None
    try:
        strategy = make_strategy(spec, ctx, build_model(spec.model, seed=0, device=ctx.device), fused_loss=True)
        with pytest.raises(PartitionedWeightError, match="numel 0"):
            check_full_lm_head(strategy.inner)
        ids = torch.randint(0, 259, (2, 16))
        strategy.backward(strategy.forward({"input_ids": ids, "labels": ids}, True))  # guard inside the forward passes
    finally:
        if strategy is not None:
            strategy.close()
        ctx.close()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_checkpoint_resume(deepspeed_on_cpu, tmp_path, monkeypatch, zero_stage):
    spec = _spec(strategy="deepspeed", zero_stage=zero_stage, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    uninterrupted = train(_spec(strategy="deepspeed", zero_stage=zero_stage))
    monkeypatch.setenv(FAULT_ENV, "0:3:raise")
    with pytest.raises(RuntimeError, match="injected fault"):
        train(spec)
    monkeypatch.delenv(FAULT_ENV)
    resumed = train(spec)
    assert resumed.resumed_from_step == 2 and resumed.steps_redone == 1
    assert resumed.loss_curve == uninterrupted.loss_curve


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_resume_with_allowed_schedule_changes(deepspeed_on_cpu, tmp_path, caplog, zero_stage):
    """lr, weight_decay and steps changed on resume under ZeRO (whose optimizer state ZeRO-3 keeps outside the
    optimizer's param_groups): the resumed steps train at the new schedule's lr."""
    import re

    from fuseforge_flyte.training.optim import scheduler

    base = dict(strategy="deepspeed", zero_stage=zero_stage, checkpoint_dir=str(tmp_path), checkpoint_every=0,
                warmup_steps=2)
    train(_spec(steps=4, lr=3e-3, weight_decay=0.0, **base))
    with caplog.at_level(logging.INFO, logger="fuseforge.training"):
        resumed = train(_spec(steps=8, lr=1e-3, weight_decay=0.1, resume_allow_changes="steps,lr,weight_decay", **base))
    assert resumed.resumed_from_step == 4
    logged = {int(m.group(1)): float(m.group(2)) for record in caplog.records
              for m in [re.search(r"step (\d+)/8 loss \S+ lr (\S+)", record.getMessage())] if m}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule, wanted = scheduler(optimizer, 2, 8), {}
    for step in range(1, 9):
        optimizer.step()
        schedule.step()
        wanted[step] = schedule.get_last_lr()[0]  # the lr the engine logs after step `step`
    assert [logged[step] for step in range(5, 9)] == pytest.approx([wanted[step] for step in range(5, 9)], rel=1e-2)


def test_zero3_in_process_leaves_torch_linear_as_it_was(deepspeed_on_cpu):
    """ZeRO-3 replaces torch.nn.functional.linear process-wide; the strategy puts torch's back when done."""
    original = torch.nn.functional.linear
    train(_spec(steps=1, batch_size=2, strategy="deepspeed", zero_stage=3))
    assert torch.nn.functional.linear is original


@pytest.mark.parametrize("strategy,extra", [("fsdp", {}), ("deepspeed", {"zero_stage": 3})], ids=["fsdp", "zero3"])
def test_fused_loss_gives_the_unfused_lm_head_gradient_under_sharding(strategy, extra, request):
    """benchmarks/bench_scaling.py's lm-head check on gloo: with lm_head sharded (FSDP2) or partitioned (ZeRO-3),
    the fused loss runs (its calls counted: a fallback would leave 0) and the whole lm_head gradient it gives
    equals the unfused loss's."""
    import sys

    if strategy == "deepspeed":
        request.getfixturevalue("deepspeed_on_cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from bench_scaling import compare_lm_head_gradients

    result = compare_lm_head_gradients(_spec(strategy=strategy, batch_size=1, **extra), 2, start_method=forking.start_method())
    assert result["fused_calls"] == 1 and result["unfused_run_fused_calls"] == 0
    assert result["max_abs_gradient"] > 0
    assert result["max_abs_difference"] <= 1e-5 * result["max_abs_gradient"], result
    assert result["loss_fused"] == pytest.approx(result["loss_unfused"], rel=1e-5)
