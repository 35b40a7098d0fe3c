"""The training loop run by every worker process of an elastic job (or a single process).

`train(spec)` joins the process group from torch elastic's environment, builds the
model, applies the fuseforge kernels, wraps it per strategy, resumes from the
newest good checkpoint, trains, and returns the metrics on every rank (Flyte keeps
rank 0's). Plain PyTorch + transformers: nothing here imports Flyte.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from typing import Dict, List

import torch

from fuseforge_flyte.training import faults
from fuseforge_flyte.training.checkpoint import CheckpointManager
from fuseforge_flyte.training.data import DataPosition, ShardedBatches, load_dataset
from fuseforge_flyte.training.distributed import DistContext
from fuseforge_flyte.training.metrics import (History, final_loss, peak_memory_gib, reset_peak_memory,
                                              summarize)
from fuseforge_flyte.training.models import build_model, model_flops, peak_flops
from fuseforge_flyte.training.spec import TrainMetrics, TrainSpec
from fuseforge_flyte.training.strategies import Strategy, make_strategy, strategy_class

log = logging.getLogger("fuseforge.training")


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was NaN/inf and nonfinite_policy is "raise"."""


def _apply_kernels(model: torch.nn.Module, loss_chunk_size: int, log_it: bool) -> List[str]:
    """Patch the model in place with fuseforge's kernels; the names of the kernels that were applied.

    loss_chunk_size 0 means fuseforge's own default (Flyte inputs are plain ints, not Optional).
    """
    from fuseforge.transformers import apply_kernels  # lazy: the kernels need triton

    report = apply_kernels(model, loss_chunk_size=loss_chunk_size or None)
    if log_it:
        log.info("%s", report.summary())
    return report.patched_kernels()


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant checkpointing of every decoder layer (newer transformers renamed the method)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _fingerprint(model: torch.nn.Module) -> Dict[str, list]:
    return {name: list(p.shape) for name, p in model.named_parameters()}


class _Run:
    """State of one training session on one rank."""

    def __init__(self, spec: TrainSpec, ctx: DistContext):
        self.spec = spec
        self.ctx = ctx
        model = build_model(spec.model, seed=spec.seed, device=ctx.device)
        # the data next, so that a bad dataset fails before the model is wrapped and sharded
        self.dataset = load_dataset(spec.dataset, seq_len=spec.seq_len, vocab_size=model.config.vocab_size,
                                    seed=spec.seed)
        self.samples_per_step = ctx.world_size * spec.batch_size * spec.grad_accum
        self.tokens_per_step = self.samples_per_step * spec.seq_len
        self._batches(DataPosition())  # raises if one global step needs more sequences than there are
        self.kernels_patched = _apply_kernels(model, spec.loss_chunk_size, ctx.is_main) if spec.kernels else []
        if spec.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        self.flops = model_flops(model, spec.seq_len)
        fingerprint = _fingerprint(model)
        self.strategy: Strategy = make_strategy(spec, ctx, model)
        self.history = History()
        self.position = DataPosition()
        self.step = 0
        self.resumed_from = 0
        self.ckpt = None
        if spec.checkpoint_dir:
            self.ckpt = CheckpointManager(spec.checkpoint_dir, ctx, self.strategy, keep_last=spec.keep_last,
                                          fingerprint=fingerprint)

    def _batches(self, position: DataPosition) -> ShardedBatches:
        spec, ctx = self.spec, self.ctx
        return ShardedBatches(self.dataset, rank=ctx.rank, world_size=ctx.world_size, batch_size=spec.batch_size,
                              grad_accum=spec.grad_accum, seed=spec.seed, position=position)

    # ------------------------------------------------------------ resume

    def resume(self) -> int:
        """Restore the newest good checkpoint; returns the steps redone so far in this run."""
        if self.ckpt is None:
            return 0
        state = self.ckpt.resume()
        if state is not None:
            self.step = self.resumed_from = int(state["step"])
            self.position = DataPosition(**state["position"])
            self.history = History.from_dict(state["history"])
            if state.get("samples_per_step") != self.samples_per_step and self.ctx.is_main:
                log.warning("the global batch changed from %s to %s samples since the checkpoint: "
                            "the data order after it differs from an uninterrupted run",
                            state.get("samples_per_step"), self.samples_per_step)
        self.history.truncate(self.step)
        return self.ckpt.start_progress(self.step)

    def _trainer_state(self, batches: ShardedBatches) -> Dict:
        pos = batches.position
        return {"position": {"epoch": pos.epoch, "index": pos.index}, "history": self.history.to_dict(),
                "samples_per_step": self.samples_per_step, "model": self.spec.model}

    # ------------------------------------------------------------ loop

    def train(self) -> None:
        spec, ctx = self.spec, self.ctx
        batches = self._batches(self.position)
        self.strategy.model.train()
        if self.step < spec.steps:
            self.history.warmup.append(self.step)
        while self.step < spec.steps:
            ctx.synchronize()
            reset_peak_memory(ctx.device)
            start = time.perf_counter()
            loss = self._one_step(batches.next_step(), self.step + 1)
            ctx.synchronize()
            elapsed = time.perf_counter() - start
            self.step += 1
            self.history.loss.append(loss)
            self.history.step_time.append(elapsed)
            self.history.memory_gib.append(peak_memory_gib(ctx.device))
            self._log(loss, elapsed)
            if self.ckpt is not None:
                self.ckpt.record_progress(self.step)
            faults.maybe_fail(ctx.rank, self.step, ctx.restart_count)
            if self.ckpt is not None and (self.step == spec.steps or
                                          (spec.checkpoint_every and self.step % spec.checkpoint_every == 0)):
                self.ckpt.save(self.step, self._trainer_state(batches))

    def _one_step(self, micro_batches: List[torch.Tensor], step: int) -> float:
        """Forward/backward every micro-batch and apply the update; the step's loss averaged over ranks."""
        spec, ctx, strategy = self.spec, self.ctx, self.strategy
        check_each = spec.nonfinite_policy == "skip"  # decide before backward, so nothing bad is accumulated
        stats = torch.zeros(2, device=ctx.device)  # [sum of finite losses, count of non-finite ones]
        skipped = False
        for index, ids in enumerate(micro_batches):
            loss = strategy.forward(ids.to(ctx.device, non_blocking=True), index == len(micro_batches) - 1)
            loss = faults.maybe_poison(loss, ctx.rank, step)
            value = loss.detach().float()
            finite = torch.isfinite(value)
            part = torch.stack([torch.where(finite, value, torch.zeros_like(value)), (~finite).float()])
            if check_each:
                ctx.all_reduce(part)
            stats += part
            if check_each and part[1].item() > 0:
                skipped = True  # every rank saw the same reduced flag, so all stop here
                break
            strategy.backward(loss)
        if not check_each:
            ctx.all_reduce(stats)
            if stats[1].item() > 0:
                raise NonFiniteLossError(
                    f"non-finite training loss at step {step} ({int(stats[1].item())} micro-batch(es) over "
                    f"{ctx.world_size} rank(s)) with nonfinite_policy='raise': lower lr, keep grad_clip on, "
                    f"or set nonfinite_policy='skip'"
                )
        if skipped:
            strategy.discard_step()
            self.history.skipped_steps += 1
            if ctx.is_main:
                log.warning("step %d: non-finite loss, optimizer step skipped (nonfinite_policy='skip')", step)
            return float("nan")
        strategy.optimizer_step()
        return stats[0].item() / (ctx.world_size * len(micro_batches))

    def _log(self, loss: float, elapsed: float) -> None:
        if self.ctx.is_main and (self.step % self.spec.log_every == 0 or self.step == self.spec.steps):
            log.info("step %d/%d loss %.4f lr %.3g step %.3fs %.0f tok/s", self.step, self.spec.steps, loss,
                     self.strategy.lr(), elapsed, self.tokens_per_step / elapsed if elapsed > 0 else 0.0)

    # ------------------------------------------------------------ result

    def metrics(self, steps_redone: int) -> TrainMetrics:
        spec, ctx, h = self.spec, self.ctx, self.history
        peak = torch.tensor([max(h.memory_gib, default=0.0)], device=ctx.device, dtype=torch.float64)
        peak = ctx.all_reduce(peak, "max").item()
        dtype = self.strategy.dtype
        summary = summarize(h, tokens_per_step=self.tokens_per_step, samples_per_step=self.samples_per_step,
                            flops_per_token=self.flops.flops_per_token,
                            peak_flops_total=peak_flops(ctx.device, dtype) * ctx.world_size)
        return TrainMetrics(
            model=spec.model, kernels=spec.kernels, strategy=spec.strategy, device=_device_name(ctx.device),
            world_size=ctx.world_size, steps=self.step, tokens_per_s=summary.tokens_per_s,
            samples_per_s=summary.samples_per_s, mfu=summary.mfu, peak_memory_gib=peak,
            step_time_p50_s=summary.step_time_p50_s, step_time_p90_s=summary.step_time_p90_s,
            step_time_p99_s=summary.step_time_p99_s, final_loss=final_loss(h), loss_curve=list(h.loss),
            tokens_per_s_curve=summary.tokens_per_s_curve, memory_gib_curve=list(h.memory_gib),
            restarts=ctx.restart_count, steps_redone=steps_redone, skipped_steps=h.skipped_steps,
            resumed_from_step=self.resumed_from, dtype=dtype, num_params=self.flops.num_params,
            flops_per_token=self.flops.flops_per_token, tokens_per_step=self.tokens_per_step,
            step_time_curve=list(h.step_time), kernels_patched=list(self.kernels_patched),
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def train(spec: TrainSpec) -> TrainMetrics:
    """Run `spec` in this worker process and return the metrics (identical on every rank)."""
    spec.validate()
    ctx = DistContext.from_env(need_group=strategy_class(spec.strategy).needs_process_group)
    run = None
    try:
        if ctx.device.type == "cpu" and spec.dtype != "fp32" and ctx.is_main:
            log.info("CPU run: training in fp32 (dtype=%r applies on GPU)", spec.dtype)
        run = _Run(spec, ctx)
        steps_redone = run.resume()
        run.train()
        metrics = run.metrics(steps_redone)
        if ctx.is_main:
            log.info("done: %d steps, final loss %.4f, %.0f tok/s, MFU %.1f%%, peak %.2f GiB", metrics.steps,
                     metrics.final_loss if math.isfinite(metrics.final_loss) else float("nan"),
                     metrics.tokens_per_s, 100 * metrics.mfu, metrics.peak_memory_gib)
        return metrics
    finally:
        if run is not None:
            run.strategy.close()
            # Free the wrapped model (DDP's reducer holds the process group) while the group is
            # still alive: freed after destroy_process_group, gloo's destructor can hang joining
            # its worker threads.
            run = None
            gc.collect()
        ctx.close()
