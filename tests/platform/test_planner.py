"""The batch-layout planner: the pure choice, candidate order and early stop, the model switches, the probe
runner on a tiny model, and the engine with plan='auto' (on the CPU through an injected memory meter)."""

import json
import random

import pytest
import torch
import transformers

from fuseforge_flyte.data.benchmark import benchmark_dataset
from fuseforge_flyte.decks import training_deck_html
from fuseforge_flyte.training import planner
from fuseforge_flyte.training.batches import DataPosition, ShardedBatches
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.plan import Candidate, Plan, Probe
from fuseforge_flyte.training.planner import (PlanError, ProbeRunner, candidates, choose, memory_budget,
                                              micro_batch_sizes, per_rank_sequences, search,
                                              set_activation_checkpointing)
from fuseforge_flyte.training.spec import TrainMetrics, TrainSpec
import forking  # tests/support

GIB = 2**30


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""


def probe(b, ga, ckpt=0, chunk=0, peak=1, speed=1.0, oom=False):
    return Probe(Candidate(b, ga, ckpt, chunk), peak_bytes=peak, tokens_per_s=speed, oom=oom,
                 seconds_per_micro_batch=1.0)


# ---------------------------------------------------------------- the pure choice


def test_choose_picks_the_fastest_layout_that_fits():
    probes = [probe(1, 8, peak=40, speed=100), probe(2, 4, peak=60, speed=130), probe(4, 2, peak=90, speed=150),
              probe(8, 1, oom=True), probe(8, 1, ckpt=1, peak=70, speed=120)]
    assert choose(probes, budget_bytes=80, global_batch=16, world_size=2) == Candidate(2, 4)
    assert choose(probes, budget_bytes=90, global_batch=16, world_size=2) == Candidate(4, 2)  # the peak may equal it


def test_choose_never_exceeds_memory_never_changes_the_global_batch_and_is_the_best_that_fits():
    rng = random.Random(3)
    for _ in range(200):
        per_rank = rng.choice([1, 4, 6, 12, 16])
        world = rng.choice([1, 2, 8])
        probes = [probe(c.micro_batch, c.grad_accum, c.checkpoint_every, c.loss_chunk_size, peak=rng.randrange(1, 100),
                        speed=rng.uniform(1, 10), oom=rng.random() < 0.2)
                  for c in candidates(per_rank, (0, 2, 1), (0, 4096)) if rng.random() < 0.7]
        budget = rng.randrange(1, 100)
        fitting = [p for p in probes if not p.oom and p.peak_bytes <= budget]
        if not fitting:
            with pytest.raises(PlanError):
                choose(probes, budget, per_rank * world, world)
            continue
        chosen = choose(probes, budget, per_rank * world, world)
        got = next(p for p in probes if p.candidate == chosen)
        assert not got.oom and got.peak_bytes <= budget
        assert chosen.micro_batch * chosen.grad_accum * world == per_rank * world
        assert got.tokens_per_s == max(p.tokens_per_s for p in fitting)


def test_out_of_memory_layouts_are_never_chosen():
    """An OOM probe is excluded whatever its numbers say."""
    fast_but_oom = Probe(Candidate(4, 1), peak_bytes=1, tokens_per_s=1e9, oom=True)
    assert choose([fast_but_oom, probe(2, 2, peak=5, speed=1.0)], 10, 4, 1) == Candidate(2, 2)


def test_no_layout_fits_names_every_configuration_tried_and_its_memory():
    probes = [probe(4, 1, oom=True), probe(2, 2, peak=12 * GIB), probe(2, 2, ckpt=1, peak=11 * GIB)]
    with pytest.raises(PlanError) as err:
        choose(probes, 10 * GIB, 4, 1)
    text = str(err.value)
    assert "10.00 GiB" in text
    assert "micro-batch 4 x accum 1, no checkpointing, default loss chunk: out of memory" in text
    assert "micro-batch 2 x accum 2, no checkpointing, default loss chunk: peak 12.00 GiB (over the budget)" in text
    assert "checkpointing every layer, default loss chunk: peak 11.00 GiB" in text


def test_a_probe_of_another_global_batch_is_refused():
    with pytest.raises(PlanError, match="does not hold 8 sequences per rank"):
        choose([probe(2, 2)], 10, global_batch=16, world_size=2)


def test_candidates_divide_the_per_rank_sequences():
    assert micro_batch_sizes(12) == [1, 2, 3, 4, 6, 12]
    assert per_rank_sequences(48, 8) == 6
    with pytest.raises(PlanError, match="global batch of 16 sequences per step cannot be split over 3 ranks"):
        per_rank_sequences(16, 3)
    grid = candidates(12, (0, 2, 1), (0, 2048))
    assert len(grid) == 6 * 3 * 2 and len(set(grid)) == len(grid)
    assert all(c.micro_batch * c.grad_accum == 12 for c in grid)
    assert [c.micro_batch for c in grid[:6]] == [1, 2, 3, 4, 6, 12]  # ascending within a choice
    assert [c.checkpoint_every for c in grid[::6][:3]] == [0, 2, 1]  # least recompute first


def test_memory_budget_sets_the_optimizer_state_and_a_margin_aside():
    assert memory_budget(100 * GIB, 30 * GIB, 140 * GIB) == 100 * GIB - 30 * GIB - 7 * GIB
    assert memory_budget(10 * GIB, 0, 10 * GIB) == 9 * GIB  # at least 1 GiB of margin


# ---------------------------------------------------------------- search order


def fake_measure(log, fits_up_to, speed=None):
    """Memory grows with the micro-batch, less so with checkpointing; speed grows with the micro-batch."""
    def measure(c):
        log.append(c)
        limit = fits_up_to[c.checkpoint_every]
        rate = speed(c) if speed else c.micro_batch * (1.0 - 0.1 * (c.checkpoint_every > 0))
        return Probe(c, peak_bytes=10 if c.micro_batch <= limit else 1000, tokens_per_s=rate,
                     seconds_per_micro_batch=1.0)
    return measure


def test_search_grows_the_micro_batch_then_checkpoints_only_when_memory_stopped_it():
    log = []
    probes = search(16, fake_measure(log, {0: 2, 2: 4, 1: 8}), 100, checkpoint_choices=(0, 2, 1))
    assert [(c.micro_batch, c.checkpoint_every) for c in log] == [(1, 0), (2, 0), (4, 0), (4, 2), (8, 2), (8, 1),
                                                                   (16, 1)]
    assert choose(probes, 100, 16, 1) == Candidate(8, 2, 1)
    log.clear()  # everything fits without checkpointing: no checkpointing choice is probed
    search(4, fake_measure(log, {0: 4, 2: 4, 1: 4}), 100, checkpoint_choices=(0, 2, 1))
    assert [(c.micro_batch, c.checkpoint_every) for c in log] == [(1, 0), (2, 0), (4, 0)]


def test_search_starts_at_the_given_micro_batch_and_shrinks_when_it_does_not_fit():
    log = []
    search(16, fake_measure(log, {0: 2, 1: 16}), 100, checkpoint_choices=(0, 1), start_micro_batch=8)
    assert [(c.micro_batch, c.checkpoint_every) for c in log] == [(8, 0), (4, 0), (2, 0), (4, 1), (8, 1), (16, 1)]
    log.clear()  # nothing fits without checkpointing: checkpointing starts from the smallest
    search(4, fake_measure(log, {0: 0, 1: 4}), 100, checkpoint_choices=(0, 1), start_micro_batch=3)
    assert [(c.micro_batch, c.checkpoint_every) for c in log] == [(2, 0), (1, 0), (1, 1), (2, 1), (4, 1)]


def test_search_stops_growing_when_slower_and_tries_bigger_loss_chunks_on_the_best():
    log = []
    speed = lambda c: {1: 1.0, 2: 2.0, 4: 1.5, 8: 3.0}[c.micro_batch] + (0.1 if c.loss_chunk_size == 2048 else 0)
    probes = search(8, fake_measure(log, {0: 8, 1: 8}, speed), 100, checkpoint_choices=(0, 1),
                    chunk_sizes=(0, 2048, 8192))  # slower, not memory, stopped the growth: no checkpointing
    assert [(c.micro_batch, c.loss_chunk_size) for c in log] == [(1, 0), (2, 0), (4, 0), (2, 2048), (2, 8192)]
    assert choose(probes, 100, 8, 1) == Candidate(2, 4, 0, 2048)


def test_search_is_bounded_by_probes_and_by_time_once_something_fits():
    log = []
    search(64, fake_measure(log, {0: 64}), 100, checkpoint_choices=(0,), max_probes=5)
    assert len(log) == 5  # 7 micro-batch sizes, 5 probes at most
    log.clear()
    search(64, fake_measure(log, {0: 64}), 100, checkpoint_choices=(0,), time_left=lambda probes: False)
    assert len(log) == 1  # the first probe fits and the time is up
    log.clear()
    search(64, fake_measure(log, {0: 0, 1: 64}), 100, checkpoint_choices=(0, 1), time_left=lambda probes: False)
    assert [c.checkpoint_every for c in log] == [0, 1]  # no time, but nothing fitted yet: go on until one does


def test_plan_round_trips_through_json():
    probes = [probe(2, 2, peak=5, speed=3.0), probe(4, 1, oom=True)]
    plan = Plan(Candidate(2, 2), 2, 8, 10, 4, probes, 1.5)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.chosen == probes[0]
    assert "micro-batch 2 x accum 2" in plan.summary() and "2 probes in 1.5 s" in plan.summary()


# ---------------------------------------------------------------- the input


def test_plan_input_is_validated_and_defaults_to_auto():
    assert TrainSpec().plan == "auto"
    with pytest.raises(ValueError, match=r"TrainSpec.plan: 'on' is not one of \['auto', 'off'\]"):
        TrainSpec(plan="on").validate()
    from fuseforge_flyte.config import load_config

    assert load_config().train_spec().plan == "auto"


# ---------------------------------------------------------------- switches on a real model


def four_layer_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def grads_of(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_every_kth_layer_switches_layers_and_keeps_gradients():
    model = four_layer_llama().train()
    ids = torch.randint(0, 64, (2, 16))
    reference = grads_of(model, ids)
    for every, expected in ((2, [True, False, True, False]), (1, [True] * 4), (0, [False] * 4),
                            (3, [True, False, False, True])):
        set_activation_checkpointing(model, every)
        assert [layer.gradient_checkpointing for layer in planner.decoder_layers(model)] == expected
        got = grads_of(model, ids)
        for name, grad in reference.items():
            assert grad.abs().sum() > 0
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert planner.checkpoint_choices(model) == [0, 2, 1]
    with pytest.raises(ValueError, match="checkpoint_every must be an int >= 0"):
        set_activation_checkpointing(model, -1)


def test_loss_chunk_setter_changes_the_fused_loss_chunks_not_the_loss():
    from fuseforge.transformers import apply_kernels, get_patch_report, set_loss_chunk_size
    from fuseforge.transformers.loss import LOSS_SPEC_ATTR

    model = four_layer_llama().train()
    with pytest.raises(ValueError, match="not patched by apply_kernels"):
        set_loss_chunk_size(model, 8)
    apply_kernels(model)
    ids = torch.randint(0, 64, (2, 16))
    reference = grads_of(model, ids)
    loss = model(input_ids=ids, labels=ids).loss.item()
    set_loss_chunk_size(model, 5)
    assert getattr(model, LOSS_SPEC_ATTR).chunk_size == 5 and get_patch_report(model).loss_chunk_size == 5
    assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(loss, rel=1e-5)
    got = grads_of(model, ids)
    torch.testing.assert_close(got["lm_head.weight"], reference["lm_head.weight"], rtol=1e-4, atol=1e-6)
    assert apply_kernels(model, loss_chunk_size=5) is get_patch_report(model)  # same options: no re-patch
    set_loss_chunk_size(model, None)
    assert getattr(model, LOSS_SPEC_ATTR).chunk_size is None
    with pytest.raises(ValueError, match="loss_chunk_size"):
        set_loss_chunk_size(model, 0)


# ---------------------------------------------------------------- the probe runner


class FakeMeter:
    """Memory numbers from a function of the candidate being probed (set by the runner's apply)."""

    def __init__(self, peak_of=lambda c: GIB, capacity=100 * GIB):
        self.peak_of, self._capacity, self.candidate, self.cleared = peak_of, capacity, None, 0

    def clear(self):
        self.cleared += 1

    def peak(self):
        return self.peak_of(self.candidate)

    def capacity(self):
        return self._capacity

    def total(self):
        return self._capacity

    def synchronize(self):
        pass


@pytest.fixture
def meter_sees_candidates(monkeypatch):
    """The runner's apply also tells the FakeMeter which candidate runs."""
    apply = ProbeRunner.apply

    def tracked(self, candidate):
        self.meter.candidate = candidate
        apply(self, candidate)

    monkeypatch.setattr(ProbeRunner, "apply", tracked)


def tiny_runner(model, meter, forward=None):
    dataset = benchmark_dataset("bench:synthetic", seq_len=16, vocab_size=64, seed=0)

    def batches(micro_batch, count):
        steps = ShardedBatches(dataset, rank=0, world_size=1, batch_size=micro_batch, grad_accum=count, seed=0,
                               position=DataPosition()).next_step()
        return steps

    return ProbeRunner(model, forward=forward or (lambda batch, sync: model(**batch).loss),
                       backward=lambda loss: loss.backward(), zero_grad=lambda: model.zero_grad(set_to_none=True),
                       batches=batches, seq_len=16, meter=meter, fused_loss=False)


def test_probe_runner_measures_applies_the_layout_and_leaves_weights_and_gradients_alone(meter_sees_candidates):
    model = four_layer_llama().train()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    meter = FakeMeter(lambda c: (c.micro_batch * 10 + 100) * 2**20)
    runner = tiny_runner(model, meter)
    got = runner(Candidate(2, 2, 2))
    assert not got.oom and got.peak_bytes == 120 * 2**20
    assert got.seconds_per_micro_batch > 0 and got.tokens_per_s == pytest.approx(2 * 16 / got.seconds_per_micro_batch)
    assert [layer.gradient_checkpointing for layer in planner.decoder_layers(model)] == [True, False, True, False]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert runner.seconds > 0 and meter.cleared >= 1


def test_probe_runner_catches_out_of_memory_and_drops_partial_gradients(meter_sees_candidates):
    model = four_layer_llama().train()
    calls = []

    def forward(batch, sync):
        calls.append(batch["input_ids"].shape[0])
        if batch["input_ids"].shape[0] >= 4 and len(calls) > 1 and calls[-2] >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")  # after one backward accumulated
        return model(**batch).loss

    meter = FakeMeter()
    runner = tiny_runner(model, meter, forward)
    assert runner(Candidate(4, 1)).oom
    assert all(p.grad is None for p in model.parameters())
    cleared = meter.cleared
    assert not runner(Candidate(2, 2)).oom  # the next probe runs normally
    assert meter.cleared > cleared


# ---------------------------------------------------------------- the engine with plan='auto'

TINY = dict(model="tiny-llama", dataset="bench:bytes", seq_len=32, kernels=False, steps=3, lr=3e-3, seed=5)


@pytest.fixture
def probing_on_cpu(monkeypatch, meter_sees_candidates):
    """plan='auto' probes on this CPU: an injected meter (memory from a rule) and clock (speed from a rule)."""
    state = {"meter": None, "now": 0.0}

    def install(peak_of, speed_of=lambda c: 1.0, share=1e6):
        meter = state["meter"] = FakeMeter(peak_of)
        monkeypatch.setattr(planner, "meter_for", lambda device: meter)
        monkeypatch.setattr(planner, "PROBE_SHARE", share)

        def clock():  # each reading advances by one micro-batch of the candidate running
            c = meter.candidate
            state["now"] += c.micro_batch / speed_of(c) if c is not None else 0.0
            return state["now"]

        monkeypatch.setattr(planner, "_clock", clock)
        return meter

    return install


def only(*layouts):
    return lambda c: GIB if (c.micro_batch, c.checkpoint_every) in layouts else 1000 * GIB


def test_planned_run_that_keeps_the_layout_trains_exactly_like_an_unplanned_one(probing_on_cpu):
    """Probing changes no weight, RNG state or data position: same losses as plan='off'."""
    probing_on_cpu(only((2, 0)))
    planned = train(TrainSpec(plan="auto", batch_size=2, grad_accum=2, **TINY))
    plain = train(TrainSpec(plan="off", batch_size=2, grad_accum=2, **TINY))
    assert planned.loss_curve == plain.loss_curve
    plan = Plan.from_json(planned.plan)
    assert plan.choice == Candidate(2, 2) and plan.global_batch == 4 and plan.world_size == 1
    assert [p.candidate for p in plan.probes] == [Candidate(2, 2), Candidate(4, 1), Candidate(4, 1, 1)]
    assert plain.plan == ""
    assert planned.tokens_per_step == plain.tokens_per_step == 4 * 32


def test_planned_run_takes_the_fastest_fitting_layout_with_the_same_global_batch(probing_on_cpu):
    probing_on_cpu(lambda c: GIB if c.micro_batch <= 4 and c.checkpoint_every == 0 else 1000 * GIB,
                   speed_of=lambda c: {1: 1.0, 2: 2.0, 4: 3.0}[c.micro_batch])
    planned = train(TrainSpec(plan="auto", batch_size=1, grad_accum=4, **TINY))
    plan = Plan.from_json(planned.plan)
    assert plan.choice == Candidate(4, 1)
    assert [p.candidate.micro_batch for p in plan.probes] == [1, 2, 4]
    as_chosen = train(TrainSpec(plan="off", batch_size=4, grad_accum=1, **TINY))
    as_given = train(TrainSpec(plan="off", batch_size=1, grad_accum=4, **TINY))
    assert planned.loss_curve == as_chosen.loss_curve
    # the same samples per step, split differently: the same losses up to float rounding
    assert planned.loss_curve == pytest.approx(as_given.loss_curve, rel=1e-5)
    assert planned.tokens_per_step == 4 * 32


def test_probing_stops_within_its_share_of_the_run(probing_on_cpu):
    probing_on_cpu(lambda c: GIB, share=planner.PROBE_SHARE)
    plan = Plan.from_json(train(TrainSpec(plan="auto", batch_size=2, grad_accum=2, **TINY)).plan)
    assert len(plan.probes) == 1 and plan.choice == Candidate(2, 2)  # a 3-step run affords one probe


def test_planned_run_fails_clearly_when_no_layout_fits(probing_on_cpu):
    probing_on_cpu(lambda c: 1000 * GIB)
    with pytest.raises(PlanError, match=r"no layout of 4 sequences per rank fits .* Tried: micro-batch 2 x accum 2"):
        train(TrainSpec(plan="auto", batch_size=2, grad_accum=2, **TINY))


def test_cpu_runs_do_not_plan_and_the_deck_shows_a_plan(caplog):
    with caplog.at_level("INFO", logger="fuseforge.training"):
        m = train(TrainSpec(plan="auto", batch_size=2, grad_accum=1, **dict(TINY, steps=1)))
    assert m.plan == "" and "plan='auto' probes on GPUs only" in caplog.text
    plan = Plan(Candidate(2, 2), 1, 4, 10 * GIB, GIB, [probe(4, 1, oom=True), probe(2, 2, peak=3 * GIB, speed=5.0)],
                0.5)
    html = training_deck_html(TrainMetrics(steps=1, loss_curve=[1.0], plan=plan.to_json()))
    assert "batch layout plan" in html and "out of memory" in html and "chosen" in html and "3.00" in html
    assert "plan: micro-batch 2 x accum 2" in str(TrainMetrics(plan=plan.to_json()))


def test_a_restart_with_another_layout_keeps_the_checkpoints_global_batch(probing_on_cpu, tmp_path):
    """After a restart where batch_size x grad_accum x ranks no longer gives the checkpoint's global batch (as
    on another world size), the planned run keeps the checkpoint's and resumes; an unplanned one refuses."""
    probing_on_cpu(lambda c: GIB if c.micro_batch <= 2 else 1000 * GIB)
    first = train(TrainSpec(plan="auto", batch_size=2, grad_accum=2, checkpoint_dir=str(tmp_path), **TINY))
    assert first.tokens_per_step == 4 * 32
    again = dict(TINY, steps=5)
    with pytest.raises(Exception, match="global_batch"):
        train(TrainSpec(plan="off", batch_size=1, grad_accum=2, checkpoint_dir=str(tmp_path),
                        resume_allow_changes="steps", **again))
    resumed = train(TrainSpec(plan="auto", batch_size=1, grad_accum=2, checkpoint_dir=str(tmp_path),
                              resume_allow_changes="steps", **again))
    assert resumed.resumed_from_step == 3 and resumed.steps == 5 and resumed.tokens_per_step == 4 * 32
    assert Plan.from_json(resumed.plan).global_batch == 4
    copied = train(TrainSpec(plan="auto", batch_size=1, grad_accum=2, checkpoint_dir="off", resume_from=str(tmp_path),
                             resume_allow_changes="steps", **dict(again, steps=6)))  # the hint read from resume_from
    assert copied.resumed_from_step == 5 and Plan.from_json(copied.plan).global_batch == 4


def test_planned_run_with_kernels_tries_loss_chunks_on_the_best_layout(probing_on_cpu):
    probing_on_cpu(lambda c: GIB if c.micro_batch <= 2 else 1000 * GIB,
                   speed_of=lambda c: c.micro_batch + {0: 0.0, 2048: 0.5, 8192: 0.2}[c.loss_chunk_size])
    spec = dict(TINY, kernels=True, steps=2)
    planned = train(TrainSpec(plan="auto", batch_size=1, grad_accum=2, **spec))
    plan = Plan.from_json(planned.plan)
    assert [(p.candidate.micro_batch, p.candidate.loss_chunk_size) for p in plan.probes] == [(1, 0), (2, 0),
                                                                                             (2, 2048), (2, 8192)]
    assert plan.choice == Candidate(2, 1, 0, 2048)
    plain = train(TrainSpec(plan="off", batch_size=2, grad_accum=1, loss_chunk_size=2048, **spec))
    assert planned.loss_curve == plain.loss_curve


def test_probe_runner_frees_the_graph_of_a_backward_that_ran_out_of_memory(meter_sees_candidates):
    import weakref

    model = four_layer_llama().train()
    losses = []

    def forward(batch, sync):
        loss = model(**batch).loss
        losses.append(weakref.ref(loss))
        return loss

    class Meter(FakeMeter):
        def clear(self):  # when the runner frees memory after the failure, nothing may hold the graph
            self.alive = [ref() is not None for ref in losses]

    meter = Meter()
    runner = tiny_runner(model, meter, forward)

    def backward(loss):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated, in backward)")

    runner.backward = backward
    assert runner(Candidate(2, 2)).oom
    assert meter.alive == [False]  # no activations kept alive for the next probe


def test_two_ddp_ranks_agree_on_every_probe_and_keep_the_global_batch(probing_on_cpu):
    """Rank 1 alone finds micro-batch 2 too big: the max over ranks rules it out on both, and the two-process
    run trains like one process on the whole global batch."""
    import os

    from fuseforge_flyte.training.local import run_local

    probing_on_cpu(lambda c: 1000 * GIB if c.micro_batch == 2 and os.environ.get("RANK") == "1" else GIB,
                   speed_of=lambda c: float(c.micro_batch))
    results = run_local(TrainSpec(plan="auto", batch_size=2, grad_accum=1, **TINY), 2, start_method=forking.required())
    plans = [Plan.from_json(results[rank].plan) for rank in (0, 1)]
    assert plans[0] == plans[1] and plans[0].choice == Candidate(1, 2) and plans[0].world_size == 2
    tried = [(p.candidate.micro_batch, p.candidate.checkpoint_every, p.fits(plans[0].budget_bytes))
             for p in plans[0].probes]
    assert tried == [(2, 0, False), (1, 0, True), (2, 1, False)]
    single = train(TrainSpec(plan="off", batch_size=4, grad_accum=1, **TINY))
    assert results[0].tokens_per_step == single.tokens_per_step
    torch.testing.assert_close(results[0].loss_curve, single.loss_curve, rtol=2e-5, atol=2e-5)
