"""The memory/throughput planner: pick the fastest per-rank batch layout that fits the GPU, by measuring it.

Turning spare memory into speed (bigger micro-batches, less activation checkpointing, bigger fused-loss
chunks) is worth 15-20% on large models, but the right setting depends on the model, the kernels, the
sequence length and the GPU. So rather than modelling memory, the engine probes: a few real forward+backward
micro-batches of the run's own data per candidate layout, before the first optimizer step, measuring peak
memory and time; then `choose` takes the fastest candidate whose peak fits.

A layout never changes the global batch: micro_batch * grad_accum * world_size is the run's sequences per
step, always. Each step's samples (and so its loss and gradient, a global token mean) are the same for any
layout; only how they are split into micro-batches differs.

Memory accounting: the probes run before the optimizer has allocated its state, so that state is
subtracted from the budget (`memory_budget`): budget = what this process may allocate on the device
(free + already reserved by torch) - the optimizer state - a safety margin (allocator fragmentation,
communication buffers). A probe's peak (max_memory_allocated) already holds the weights, gradients and
everything else allocated so far. The optimizer step's own transients (e.g. torch's foreach AdamW
temporaries) happen after the activations are freed and are not counted.

Cost: at most MAX_PROBES probes of MICRO_BATCHES_PER_PROBE micro-batches each (the first a warm-up), and
probing stops once it has spent PROBE_SHARE of the run's estimated time (steps x the best step time found),
as soon as some candidate fits. Supported: strategy ddp (one process or DDP) on CUDA; FSDP and DeepSpeed
keep their layout as given (see `unsupported_reason`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from fuseforge_flyte.training.models import decoder_layers
from fuseforge_flyte.training.plan import Candidate, Plan, Probe, format_gib

log = logging.getLogger("fuseforge.training")

CHECKPOINT_CHOICES = (0, 2, 1)  # none, every 2nd decoder layer, every layer: less recompute first
LOSS_CHUNK_CHOICES = (0, 2048, 8192)  # tokens per fused-loss chunk; 0: fuseforge's default rule
MAX_PROBES = 12
MICRO_BATCHES_PER_PROBE = 3  # one warm-up (allocator, autotuning), then timed ones
PROBE_SHARE = 0.03  # of the run's estimated time
SAFETY_FRACTION = 0.05  # of the device's memory kept free
MIN_SAFETY_BYTES = 2**30
SLOWER = 0.02  # a bigger micro-batch this much slower ends the growth for a checkpointing choice
_clock = time.perf_counter  # what probes are timed with (tests give a fake one)


class PlanError(ValueError):
    """No layout fits the memory budget, or the global batch cannot be split over the ranks."""


# ----------------------------------------------------------------------------- the pure part


def per_rank_sequences(global_batch: int, world_size: int) -> int:
    """Sequences each rank handles per step; the global batch must split evenly over the ranks."""
    if global_batch < 1 or world_size < 1 or global_batch % world_size:
        raise PlanError(f"the global batch of {global_batch} sequences per step cannot be split over "
                        f"{world_size} ranks: use a world size that divides it (or change batch_size/grad_accum)")
    return global_batch // world_size


def micro_batch_sizes(per_rank: int) -> List[int]:
    """The micro-batch sizes that divide the per-rank sequences (grad_accum is then an integer), ascending."""
    return [b for b in range(1, per_rank + 1) if per_rank % b == 0]


def candidates(per_rank: int, checkpoint_choices: Sequence[int] = CHECKPOINT_CHOICES,
               chunk_sizes: Sequence[int] = (0,)) -> List[Candidate]:
    """Every layout, in the order probing goes: per chunk size and checkpointing choice (least recompute
    first), micro-batches ascending (probing grows them until out of memory or slower)."""
    return [Candidate(b, per_rank // b, ckpt, chunk) for chunk in chunk_sizes for ckpt in checkpoint_choices
            for b in micro_batch_sizes(per_rank)]


def memory_budget(capacity_bytes: int, optimizer_bytes: int, total_bytes: int,
                  safety_fraction: float = SAFETY_FRACTION) -> int:
    """Bytes a probe's peak may reach: what the process may allocate, minus the optimizer state the probes
    have not allocated yet, minus a margin for fragmentation and communication buffers."""
    margin = max(int(total_bytes * safety_fraction), MIN_SAFETY_BYTES)
    return capacity_bytes - optimizer_bytes - margin


def choose(probes: Sequence[Probe], budget_bytes: int, global_batch: int, world_size: int) -> Candidate:
    """The fastest probed layout (tokens/s) whose peak fits the budget; ties go to the smaller peak.

    Raises PlanError naming every layout tried and its memory when none fits.
    """
    per_rank = per_rank_sequences(global_batch, world_size)
    for p in probes:
        c = p.candidate
        if c.micro_batch * c.grad_accum != per_rank:
            raise PlanError(f"probe of {c.describe()} does not hold {per_rank} sequences per rank "
                            f"(global batch {global_batch} over {world_size} ranks)")
    fitting = [p for p in probes if p.fits(budget_bytes)]
    if not fitting:
        tried = "; ".join(p.describe(budget_bytes) for p in probes) or "nothing"
        raise PlanError(f"no layout of {per_rank} sequences per rank fits the memory budget of "
                        f"{format_gib(budget_bytes)} per GPU. Tried: {tried}. Use shorter seq_len, a smaller "
                        f"global batch, more GPUs, or strategy='fsdp'")
    return max(fitting, key=lambda p: (p.tokens_per_s, -p.peak_bytes)).candidate


class _Stop(Exception):
    pass


def search(per_rank: int, measure: Callable[[Candidate], Probe], budget_bytes: int, *,
           checkpoint_choices: Sequence[int] = CHECKPOINT_CHOICES, chunk_sizes: Sequence[int] = (0,),
           start_micro_batch: int = 1, max_probes: int = MAX_PROBES,
           time_left: Callable[[List[Probe]], bool] = lambda probes: True) -> List[Probe]:
    """Probe layouts in an order that can stop early; the probes made.

    Per checkpointing choice (least recompute first): from the start micro-batch (the largest divisor
    <= start_micro_batch, for the first choice) grow until a layout does not fit or is slower; if the first
    does not fit, shrink instead. A choice with more checkpointing is tried only when memory stopped the
    previous one, from the micro-batches that did not fit there. Then larger loss chunks on the best layout.
    Stops after max_probes, or once a layout fits and `time_left(probes)` is False.
    """
    sizes = micro_batch_sizes(per_rank)
    probes: List[Probe] = []

    def run(candidate: Candidate) -> Probe:
        fits_yet = any(p.fits(budget_bytes) for p in probes)
        if len(probes) >= max_probes or (fits_yet and not time_left(probes)):
            raise _Stop
        probe = measure(candidate)
        probes.append(probe)
        return probe

    def grow(ckpt: int, index: int):
        """Probe sizes[index:] upwards; (stopped by memory, index of the largest that fitted or None)."""
        best, largest = None, None
        for i in range(index, len(sizes)):
            p = run(Candidate(sizes[i], per_rank // sizes[i], ckpt, chunk))
            if not p.fits(budget_bytes):
                return True, largest
            largest = i
            if best is not None and p.tokens_per_s < best.tokens_per_s * (1 - SLOWER):
                return False, largest
            if best is None or p.tokens_per_s > best.tokens_per_s:
                best = p
        return False, largest

    chunk = chunk_sizes[0]
    index = max(i for i, b in enumerate(sizes) if b <= max(start_micro_batch, 1))
    try:
        for n, ckpt in enumerate(checkpoint_choices):
            memory_bound, largest = grow(ckpt, index)
            if n == 0 and largest is None:  # the starting layout did not fit: shrink to the largest that does
                for i in range(index - 1, -1, -1):
                    if run(Candidate(sizes[i], per_rank // sizes[i], ckpt, chunk)).fits(budget_bytes):
                        largest = i
                        break
                else:
                    largest = -1  # nothing fits without checkpointing: the next choice starts at the smallest
            if not memory_bound:
                break  # more checkpointing only adds recompute
            index = largest + 1 if largest is not None else index  # past the sizes that fitted with less
            if index >= len(sizes):
                break
        fitting = [p for p in probes if p.fits(budget_bytes)]
        if fitting and len(chunk_sizes) > 1:
            best = max(fitting, key=lambda p: p.tokens_per_s)
            for size in chunk_sizes[1:]:
                p = run(dataclasses.replace(best.candidate, loss_chunk_size=size))
                if not p.fits(budget_bytes) or p.tokens_per_s <= best.tokens_per_s:
                    break
                best = p
    except _Stop:
        pass
    return probes


# ----------------------------------------------------------------------------- switches on the model


def set_activation_checkpointing(model: torch.nn.Module, every: int) -> None:
    """Non-reentrant activation checkpointing of every `every`-th decoder layer (1: all), or none (0).

    transformers' layers decide per call from their own `gradient_checkpointing` attribute, so after
    enabling it for all (the model's method, which also installs the checkpoint function) the others are
    switched back off; older transformers have no every_n_layers argument, this works on both.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"checkpoint_every must be an int >= 0 (0 none, 1 every layer, k every k-th), got {every!r}")
    if every == 0:
        if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
            if hasattr(model, "activation_checkpointing_disable"):
                model.activation_checkpointing_disable()
            else:
                model.gradient_checkpointing_disable()
        return
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers renamed the method
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if every > 1:
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} has no GradientCheckpointingLayer: it can checkpoint every "
                             f"layer or none, not every {every}th")
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index % every == 0


def checkpoint_choices(model: torch.nn.Module) -> List[int]:
    """CHECKPOINT_CHOICES the model can take (every k-th needs per-layer switches, and more than k layers)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return [0]
    layers = len(decoder_layers(model))
    return [c for c in CHECKPOINT_CHOICES if c <= 1 or layers > c]


def has_fused_loss(model: torch.nn.Module) -> bool:
    from fuseforge.transformers import get_patch_report

    report = get_patch_report(model)
    return report is not None and "fused_linear_cross_entropy" in report.patched_kernels()


def set_loss_chunk(model: torch.nn.Module, chunk_size: int) -> None:
    """Tokens per fused-loss chunk (0: fuseforge's default) on a model patched with the fused loss head."""
    from fuseforge.transformers import set_loss_chunk_size

    set_loss_chunk_size(model, chunk_size or None)


# ----------------------------------------------------------------------------- measuring


class CudaMeter:
    """Peak memory allocated by torch on one GPU, and how much this process may allocate there."""

    def __init__(self, device: torch.device):
        self.device = device

    def clear(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def capacity(self) -> int:
        """Free device memory plus what torch's allocator already holds (after emptying its cache)."""
        self.clear()
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device)

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def meter_for(device: torch.device):
    """The memory meter of a device, or None where the planner does not probe (the CPU)."""
    return CudaMeter(device) if device.type == "cuda" else None


def optimizer_state_bytes(strategy) -> int:
    """Bytes the optimizer will allocate at its first step: the strategy's own count when it has one
    (`optimizer_state_bytes()`, e.g. with master weights), else AdamW's two moments per parameter it
    updates, in that parameter's dtype and local (sharded) size."""
    own = getattr(strategy, "optimizer_state_bytes", None)
    if callable(own):
        return int(own())
    total = 0
    for group in strategy.optimizer.param_groups:
        for p in group["params"]:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += 2 * local.numel() * local.element_size()
    return total


class ProbeRunner:
    """Measures a Candidate with real forward+backward micro-batches; never steps the optimizer.

    forward(batch, sync) -> loss and backward(loss) are the training's own (the strategy's), zero_grad drops
    the probe's gradients, batches(micro_batch, count) gives real micro-batches on the device. The first
    micro-batch is a warm-up (not timed); the peak covers all of them (gradients accumulate as in a step).
    agree(tensor) reduces [oom, peak, seconds] to their max over ranks so every rank decides alike.
    """

    def __init__(self, model: torch.nn.Module, *, forward: Callable, backward: Callable, zero_grad: Callable,
                 batches: Callable[[int, int], List[Dict[str, torch.Tensor]]], seq_len: int, meter,
                 agree: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                 micro_batches: int = MICRO_BATCHES_PER_PROBE, fused_loss: Optional[bool] = None):
        self.model = model
        self.forward, self.backward, self.zero_grad = forward, backward, zero_grad
        self.batches = batches
        self.seq_len = seq_len
        self.meter = meter
        self.agree = agree
        self.micro_batches = max(micro_batches, 2)
        self.fused_loss = has_fused_loss(model) if fused_loss is None else fused_loss
        self.seconds = 0.0  # spent probing so far

    def apply(self, candidate: Candidate) -> None:
        """Put the candidate's checkpointing and loss chunk on the model."""
        set_activation_checkpointing(self.model, candidate.checkpoint_every)
        if self.fused_loss:
            set_loss_chunk(self.model, candidate.loss_chunk_size)

    def __call__(self, candidate: Candidate) -> Probe:
        began = _clock()
        self.apply(candidate)
        self.meter.clear()
        oom, times, loss, batch = False, [], None, None
        try:
            for index, batch in enumerate(self.batches(candidate.micro_batch, self.micro_batches)):
                self.meter.synchronize()
                start = _clock()
                loss = self.forward(batch, False)
                self.backward(loss)
                loss = None
                self.meter.synchronize()
                if index:
                    times.append(_clock() - start)
            peak = self.meter.peak()
        except torch.OutOfMemoryError:
            oom, peak = True, 0
        finally:
            loss = batch = None  # a loss whose backward ran out of memory still holds its graph's activations
            self.zero_grad()
        if oom:
            self.meter.clear()  # outside the except block: the traceback's frames are gone
        seconds = sum(times) / len(times) if times else 0.0
        flag, peak, seconds = self.agree(torch.tensor([float(oom), float(peak), seconds],
                                                      dtype=torch.float64)).tolist()
        self.seconds += _clock() - began
        if flag:
            return Probe(candidate, oom=True)
        tokens = candidate.micro_batch * self.seq_len / seconds if seconds > 0 else 0.0
        return Probe(candidate, peak_bytes=int(peak), seconds_per_micro_batch=seconds, tokens_per_s=tokens)


def time_budget(steps: int, per_rank: int, seq_len: int, runner: ProbeRunner,
                share: Optional[float] = None) -> Callable[[List[Probe]], bool]:
    """Whether probing may go on: spent < share (PROBE_SHARE) x steps x (the best step time so far)."""
    share = PROBE_SHARE if share is None else share

    def left(probes: List[Probe]) -> bool:
        rates = [p.tokens_per_s for p in probes if not p.oom and p.tokens_per_s > 0]
        if not rates:
            return True
        step_seconds = per_rank * seq_len / max(rates)
        return runner.seconds < share * steps * step_seconds

    return left


# ----------------------------------------------------------------------------- the engine's use


def unsupported_reason(spec, meter) -> Optional[str]:
    """Why plan='auto' keeps the layout as given for this run (meter: `meter_for` its device), or None."""
    if meter is None:
        return "plan='auto' probes on GPUs only: this CPU run uses batch_size/grad_accum as given"
    if spec.strategy != "ddp":
        return (f"plan='auto' supports strategy='ddp' so far: strategy={spec.strategy!r} uses "
                "batch_size/grad_accum/gradient_checkpointing/loss_chunk_size as given")
    if getattr(spec, "compile", False):
        return "plan='auto' is off with compile=True (each probed shape would recompile): layout as given"
    return None


def plan_run(run, global_batch: int, meter) -> Plan:
    """Probe and choose a layout for the engine's run (`engine._Run`, strategy built, before the first step).

    Every rank probes the same candidates in the same order on its own real batches (the first global
    step's samples; the run's data position is untouched); the RNG state is restored afterwards, weights
    never change (no optimizer step) and the probes' gradients are dropped. The run's model is left
    with the chosen checkpointing and loss chunk.
    """
    from fuseforge_flyte.training.batches import IGNORE_INDEX, DataPosition, ShardedBatches

    spec, ctx, strategy = run.spec, run.ctx, run.strategy
    per_rank = per_rank_sequences(global_batch, ctx.world_size)
    optimizer_bytes = optimizer_state_bytes(strategy)
    budget = memory_budget(meter.capacity(), optimizer_bytes, meter.total())
    negative = torch.tensor([-float(budget)], device=ctx.device, dtype=torch.float64)
    budget = int(-ctx.all_reduce(negative, "max").item())  # the smallest over ranks

    def batches(micro_batch: int, count: int) -> List[Dict[str, torch.Tensor]]:
        steps = ShardedBatches(run.dataset, rank=ctx.rank, world_size=ctx.world_size, batch_size=micro_batch,
                               grad_accum=min(count, per_rank // micro_batch), seed=spec.seed,
                               position=DataPosition()).next_step()
        return [{k: v.to(ctx.device) for k, v in steps[i % len(steps)].items()} for i in range(count)]

    def forward(batch: Dict[str, torch.Tensor], sync: bool) -> torch.Tensor:
        count = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().clamp(min=1)
        inputs = dict(batch, num_items_in_batch=count)
        if run.teacher is not None:
            inputs["distillation"] = run.teacher.target(batch)
        return strategy.forward(inputs, sync)

    def agree(values: torch.Tensor) -> torch.Tensor:
        return ctx.all_reduce(values.to(ctx.device), "max").cpu()

    runner = ProbeRunner(strategy.inner, forward=forward, backward=strategy.backward,
                         zero_grad=strategy.discard_step, batches=batches, seq_len=spec.seq_len, meter=meter,
                         agree=agree)
    chunks = LOSS_CHUNK_CHOICES if runner.fused_loss else (0,)
    devices = [ctx.device] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        probes = search(per_rank, runner, budget, checkpoint_choices=checkpoint_choices(strategy.inner),
                        chunk_sizes=chunks, start_micro_batch=spec.batch_size,
                        time_left=time_budget(spec.steps, per_rank, spec.seq_len, runner))
    if ctx.is_main:
        for p in probes:
            log.info("plan probe: %s", p.describe(budget))
    plan = Plan(choose(probes, budget, global_batch, ctx.world_size), ctx.world_size, global_batch, budget,
                optimizer_bytes, probes, runner.seconds)
    runner.apply(plan.choice)
    meter.clear()
    if ctx.is_main:
        log.info("plan: %s", plan.summary())
    return plan
