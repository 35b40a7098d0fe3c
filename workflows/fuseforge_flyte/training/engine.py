"""The training loop run by every worker process of an elastic job (or a single process).

`train(spec)` joins the process group from torch elastic's environment, opens the prepared data
(preparing it if given a raw source), builds the model, applies the fuseforge kernels, wraps it per
strategy, resumes from the newest good checkpoint, trains with periodic eval, writes the trained model
as a Hugging Face directory, and returns the metrics on every rank (Flyte keeps rank 0's).
Plain PyTorch + transformers: nothing here imports Flyte.

The loss of a step is the mean over every token that carries a loss in the whole global batch (all
micro-batches of all ranks), as if the batch had run at once: with masked or packed data the
micro-batches hold different numbers of loss tokens, and a mean of per-micro-batch means would weight
them wrongly. The model gets that global count as `num_items_in_batch`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from fuseforge_flyte.console import ensure_console_logging
from fuseforge_flyte.data.benchmark import benchmark_dataset, resolve_benchmark
from fuseforge_flyte.model_names import PRESETS, load_config
from fuseforge_flyte.quiet import quiet_third_party
from fuseforge_flyte.training import faults, fp8, lora
from fuseforge_flyte.training import outputs, permanent, planner, preemption, tracking
from fuseforge_flyte.training.batches import (IGNORE_INDEX, DataPosition, Prefetcher, Sample, ShardedBatches,
                                              collate, eval_batches)
from fuseforge_flyte.training.checkpoint import CheckpointManager, run_settings
from fuseforge_flyte.training.compilation import compile_layers
from fuseforge_flyte.training.distributed import DistContext
from fuseforge_flyte.training.metrics import (History, device_name, final_loss, peak_memory_gib, perplexity,
                                              reset_peak_memory, summarize)
from fuseforge_flyte.training.models import build_model, model_flops, peak_flops
from fuseforge_flyte.training.plan import Plan
from fuseforge_flyte.training.precision import compute_torch_dtype
from fuseforge_flyte.training.spec import TrainMetrics, TrainSpec
from fuseforge_flyte.training.strategies import Strategy, make_strategy, strategy_class
from fuseforge_flyte.training.training_data import TrainingData, open_training_data
from fuseforge_flyte.training.validation import skipped_kernels

log = logging.getLogger("fuseforge.training")

# Attention for packed rows on a GPU: SDPA given the block-diagonal mask falls back to a slower kernel than
# its causal flash path, while flex attention skips the masked-out blocks (see benchmarks/RESULTS.md).
PACKED_ATTENTION = "flex_attention"


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was NaN/inf and nonfinite_policy is "raise"."""


def _apply_kernels(model: torch.nn.Module, spec: TrainSpec, log_it: bool) -> List[str]:
    """Patch the model in place with fuseforge's kernels but spec.skip_kernels; the names of those applied.

    loss_chunk_size 0 means fuseforge's own default (Flyte inputs are plain ints, not Optional).
    """
    from fuseforge.transformers import apply_kernels  # lazy: the kernels need triton

    off = {name: False for name in skipped_kernels(spec)}
    report = apply_kernels(model, loss_chunk_size=spec.loss_chunk_size or None, **off)
    if log_it:
        log.info("%s", report.summary())
    return report.patched_kernels()


def _fingerprint(model: torch.nn.Module) -> Dict[str, list]:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def loss_token_count(batch: Sample) -> torch.Tensor:
    """Tokens of a micro-batch that carry a loss after the model's one-token label shift."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def _build_model_for(spec: TrainSpec, data: Optional[TrainingData], device: torch.device) -> torch.nn.Module:
    """A preset's vocabulary grows to the data's tokenizer; real models must already fit (checked)."""
    if data is not None and spec.model in PRESETS:
        vocab_size = data.preset_vocab_size(load_config(spec.model).vocab_size)
        model = build_model(spec.model, seed=spec.seed, device=device, vocab_size=vocab_size)
        _use_special_tokens_of(data.manifest, model)
    else:
        model = build_model(spec.model, seed=spec.seed, device=device)
    if data is not None:
        data.check_fits(model.config)
        if data.manifest.packing and device.type == "cuda" and model.config._attn_implementation != PACKED_ATTENTION:
            model.set_attn_implementation(PACKED_ATTENTION)
    return model


def _use_special_tokens_of(manifest, model: torch.nn.Module) -> None:
    """A from-scratch model speaks the data's tokenizer: its BOS/EOS/PAD ids (which generation stops on and
    pads with) are the tokenizer's, not the config class's defaults."""
    ids = {"bos_token_id": manifest.bos_token_id, "eos_token_id": manifest.eos_token_id,
           "pad_token_id": manifest.pad_token_id}
    for name, value in ids.items():
        setattr(model.config, name, value)
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, name, value)


class _Run:
    """State of one training session on one rank."""

    def __init__(self, spec: TrainSpec, ctx: DistContext, tracker: Optional[tracking.Tracker] = None,
                 after_checkpoint: Optional[Callable[[str], None]] = None):
        self.spec = spec
        self.ctx = ctx
        self.tracker = tracker or tracking.Tracker()
        if spec.fp8:  # no FP8 on this device, or no torchao: fail before the data and the model
            fp8.check_fp8_device(ctx.device)
            fp8.import_float8()
            if not spec.compile and ctx.is_main:  # torchao's scaling casts are separate kernels when not compiled
                log.warning("fp8 without compile: the FP8 casts run unfused and the step is usually slower than "
                            "bf16; add --compile (benchmarks/RESULTS.md s9-2: Llama-3-8B 1.32x Liger with both)")
        # the data first: a bad dataset fails before any model is built, wrapped or sharded
        self.data = open_training_data(spec, ctx)
        model = _build_model_for(spec, self.data, ctx.device)
        self.lora = lora.lora_on(spec)
        if self.lora:  # adapters on the frozen base, before the kernels (which then fuse the LoRA layers too)
            model = lora.attach(model, spec, frozen_dtype=lora.frozen_dtype(spec, ctx.device), log_it=ctx.is_main)
        if self.data is not None:
            self.dataset, self.eval_dataset = self.data.train, self.data.eval
        else:
            self.dataset = benchmark_dataset(resolve_benchmark(spec.dataset), seq_len=spec.seq_len,
                                             vocab_size=model.config.vocab_size, seed=spec.seed)
            self.eval_dataset = None
        if spec.eval_every and self.eval_dataset is None:
            raise ValueError(f"TrainSpec.eval_every={spec.eval_every} but the prepared data {spec.dataset!r} "
                             "has no eval split: prepare it with eval_fraction or eval_dataset")
        self.samples_per_step = ctx.world_size * spec.batch_size * spec.grad_accum
        self.tokens_per_step = self.samples_per_step * spec.seq_len
        self._batches(DataPosition())  # raises if one global step needs more sequences than there are
        self.kernels_patched = _apply_kernels(model, spec, ctx.is_main) if spec.kernels else []
        # after the kernels (the fused loss head is then what fp8 leaves alone), before any wrapper
        self.fp8_linears = fp8.convert_to_fp8(model, log_it=ctx.is_main) if spec.fp8 else []
        self.teacher = None
        if spec.teacher:
            from fuseforge_flyte.training.distill import Teacher

            self.teacher = Teacher(spec, model, ctx.device, compute_torch_dtype(spec, ctx.device),
                                   model.config._attn_implementation, log_it=ctx.is_main)
        if spec.gradient_checkpointing:
            planner.set_activation_checkpointing(model, 1)
        if spec.compile:  # the final layers (kernels, fp8, checkpointing), before the strategy wraps them
            compile_layers(model, log_it=ctx.is_main)
        self.flops = model_flops(lora.inner(model), spec.seq_len)
        fingerprint = _fingerprint(model)
        self.strategy: Strategy = make_strategy(spec, ctx, model)
        self.history = History()
        self.position = DataPosition()
        self.step = 0
        self.resumed_from = 0
        self.session_start = time.perf_counter()
        self.session_first_step = 0
        self.ckpt = None
        if spec.checkpoint_location or spec.resume_location:
            settings = run_settings(spec, self.data.manifest if self.data is not None else None,
                                    samples_per_step=self.samples_per_step, dtype=self.strategy.dtype)
            self.ckpt = CheckpointManager(spec.checkpoint_location, ctx, self.strategy, keep_last=spec.keep_last,
                                          fingerprint=fingerprint, model_config=model.config.to_dict(),
                                          settings=settings, allow_changes=spec.resume_allow_changes,
                                          allow_unsigned=spec.allow_unsigned_checkpoints,
                                          after_save=after_checkpoint, resume_from=spec.resume_location)
        self.plan = self._plan()

    @property
    def saves(self) -> bool:
        """Whether this run writes checkpoints (checkpoint_dir set; resume_from alone only reads)."""
        return self.ckpt is not None and self.ckpt.saves

    def _plan(self) -> Optional[Plan]:
        """plan='auto': probe layouts and train with the fastest that fits (training/planner.py).

        The global batch stays: the spec's, or after a restart on another world size the checkpoint's.
        The plan replaces batch_size, grad_accum, gradient_checkpointing and loss_chunk_size.
        """
        spec, ctx = self.spec, self.ctx
        if spec.plan != "auto":
            return None
        meter = planner.meter_for(ctx.device)
        reason = planner.unsupported_reason(spec, meter)
        if reason is not None:
            if ctx.is_main:
                log.info("%s", reason)
            return None
        global_batch = self.samples_per_step
        saved = self.ckpt.saved_global_batch() if self.ckpt is not None else None
        if saved is not None and saved != global_batch:
            if ctx.is_main:
                log.info("plan: keeping the checkpoint's global batch of %d sequences per step on %d ranks "
                         "(batch_size x grad_accum x ranks gives %d now)", saved, ctx.world_size, global_batch)
            global_batch = saved
        plan = planner.plan_run(self, global_batch, meter)
        choice = plan.choice
        self.spec = self.strategy.spec = dataclasses.replace(
            spec, batch_size=choice.micro_batch, grad_accum=choice.grad_accum,
            gradient_checkpointing=choice.checkpoint_every > 0, loss_chunk_size=choice.loss_chunk_size)
        self.samples_per_step, self.tokens_per_step = global_batch, global_batch * spec.seq_len
        if self.ckpt is not None:
            self.ckpt.settings["global_batch"] = global_batch
        return plan

    def _batches(self, position: DataPosition) -> ShardedBatches:
        spec, ctx = self.spec, self.ctx
        return ShardedBatches(self.dataset, rank=ctx.rank, world_size=ctx.world_size, batch_size=spec.batch_size,
                              grad_accum=spec.grad_accum, seed=spec.seed, position=position)

    # ------------------------------------------------------------ resume

    def resume(self) -> None:
        """Restore the newest good checkpoint and begin counting this attempt's lost work."""
        if self.ckpt is None:
            return
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
        self.ckpt.start_progress(self.step, self.spec.steps)

    def _trainer_state(self, batches: Prefetcher) -> Dict:
        pos = batches.position
        return {"position": {"epoch": pos.epoch, "index": pos.index}, "history": self.history.to_dict(),
                "samples_per_step": self.samples_per_step, "model": self.spec.model}

    # ------------------------------------------------------------ loop

    def train(self) -> None:
        batches = Prefetcher(self._batches(self.position), pin_memory=self.ctx.device.type == "cuda")
        try:
            self._train(batches)
        finally:
            batches.close()

    def _train(self, batches: Prefetcher) -> None:
        spec, ctx = self.spec, self.ctx
        self.strategy.model.train()
        if self.step < spec.steps:
            self.history.warmup.append(self.step)
        self.session_start, self.session_first_step = time.perf_counter(), self.step
        while self.step < spec.steps:
            ctx.synchronize()
            reset_peak_memory(ctx.device)
            start = time.perf_counter()
            if self.ckpt is not None:
                self.ckpt.begin_step(self.step + 1)
            micro_batches = [{k: v.to(ctx.device, non_blocking=True) for k, v in b.items()}
                             for b in batches.next_step()]
            data_wait = time.perf_counter() - start
            try:
                loss, loss_tokens = self._one_step(micro_batches, self.step + 1)
            except torch.OutOfMemoryError as err:
                if self.step == self.session_first_step:  # nothing fitted yet: a restart would fail the same way
                    raise permanent.first_step_out_of_memory(err, what=f"training {spec.model}") from err
                raise
            ctx.synchronize()
            elapsed = time.perf_counter() - start
            self.step += 1
            self.history.loss.append(loss)
            self.history.step_time.append(elapsed)
            self.history.data_wait.append(data_wait)
            self.history.loss_tokens.append(loss_tokens)
            self.history.memory_gib.append(peak_memory_gib(ctx.device))
            self._log(loss, elapsed)
            faults.maybe_fail(ctx.rank, self.step, ctx.restart_count)
            if self.eval_dataset is not None and (self.step == spec.steps or
                                                  (spec.eval_every and self.step % spec.eval_every == 0)):
                self._evaluate()
            if self.saves and (self.step == spec.steps or
                                          (spec.checkpoint_every and self.step % spec.checkpoint_every == 0)):
                self.ckpt.save(self.step, self._trainer_state(batches))
            preemption.maybe_inject(ctx.rank, self.step, ctx.restart_count)
            if self.step < spec.steps and preemption.agreed(ctx):  # SIGTERM on any rank: save this step, stop
                if self.saves and self.ckpt.last_saved_step != self.step:
                    self.ckpt.save(self.step, self._trainer_state(batches))
                raise preemption.Preempted(self.step, self.ckpt.path_of(self.step) if self.saves else None)

    def _one_step(self, micro_batches: List[Sample], step: int) -> Tuple[float, int]:
        """Forward/backward every micro-batch and apply the update; the step's global mean loss and loss tokens."""
        spec, ctx, strategy = self.spec, self.ctx, self.strategy
        faults.maybe_out_of_memory(ctx.rank, step)
        loss_tokens = torch.stack([loss_token_count(b) for b in micro_batches]).sum().to(torch.float32)
        num_items = ctx.all_reduce(loss_tokens.reshape(1)).reshape(())
        total_tokens = int(num_items.item())  # one device-to-host read per step
        if total_tokens == 0:
            raise ValueError(f"step {step}: no token of the global batch carries a loss (all labels are "
                             f"{IGNORE_INDEX}); the prepared data holds rows without loss tokens")
        check_each = spec.nonfinite_policy == "skip"  # decide before backward, so nothing bad is accumulated
        stats = torch.zeros(2, device=ctx.device)  # [sum of finite loss shares, count of non-finite ones]
        skipped = False
        for index, batch in enumerate(micro_batches):
            inputs = dict(batch, num_items_in_batch=num_items)
            if self.teacher is not None:
                inputs["distillation"] = self.teacher.target(batch)
            loss = strategy.forward(inputs, index == len(micro_batches) - 1)
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
            return float("nan"), total_tokens
        strategy.optimizer_step()
        # each share is (its tokens' loss sum) / (the global count): their sum over micro-batches and ranks
        # is the global mean (under "skip" the shares were already summed over ranks one by one)
        return stats[0].item(), total_tokens

    @torch.no_grad()
    def _evaluate(self) -> None:
        """Mean loss per loss token over the whole eval split, every rank taking a share."""
        ctx, model = self.ctx, self.strategy.model
        model.eval()
        totals = torch.zeros(2, device=ctx.device, dtype=torch.float64)  # [loss sum, loss tokens]
        filler = None  # for rounds where this rank is out of samples: sharded models need it in every forward
        for batch in eval_batches(self.eval_dataset, rank=ctx.rank, world_size=ctx.world_size,
                                  batch_size=self.spec.batch_size):
            empty = batch is None
            if empty:
                filler = filler if filler is not None else collate(self.eval_dataset, [0])
                batch = filler
            batch = {k: v.to(ctx.device) for k, v in batch.items()}
            count = loss_token_count(batch)
            loss = self.strategy.forward(dict(batch, num_items_in_batch=count.clamp(min=1)), True).double()
            if not empty:
                totals += torch.stack([loss * count, count.double()])
        ctx.all_reduce(totals)
        model.train()
        loss_sum, tokens = totals.tolist()
        eval_loss = loss_sum / tokens if tokens else float("nan")
        self.history.eval_loss.append(eval_loss)
        self.history.eval_steps.append(self.step)
        if ctx.is_main:
            log.info("eval after step %d: loss %.4f perplexity %.3f (%d tokens)", self.step, eval_loss,
                     perplexity(eval_loss), int(tokens))
            self.tracker.log(self.step, {"eval/loss": eval_loss, "eval/perplexity": perplexity(eval_loss)})

    def _log(self, loss: float, elapsed: float) -> None:
        spec = self.spec
        if not self.ctx.is_main or not (self.step % spec.log_every == 0 or self.step == spec.steps):
            return
        done = self.step - self.session_first_step
        per_step = (time.perf_counter() - self.session_start) / max(done, 1)
        values = {"train/loss": loss, "train/lr": self.strategy.lr(), "train/step_time_s": elapsed,
                  "train/tokens_per_s": self.tokens_per_step / elapsed if elapsed else 0.0,
                  "train/data_wait_fraction": self.history.data_wait[-1] / elapsed if elapsed else 0.0,
                  "train/peak_memory_gib": self.history.memory_gib[-1]}
        log.info("step %d/%d loss %.4f lr %.3g | %.0f tok/s step %.3fs data %.1f%% | mem %.2f GiB | ETA %s",
                 self.step, spec.steps, loss, values["train/lr"], values["train/tokens_per_s"], elapsed,
                 100 * values["train/data_wait_fraction"], values["train/peak_memory_gib"],
                 _duration(per_step * (spec.steps - self.step)))
        self.tracker.log(self.step, values)

    def save_model(self) -> str:
        """Write the trained model (and the data's tokenizer) as a Hugging Face directory; its path on rank 0."""
        from fuseforge_flyte.training.export import save_pretrained_model

        tokenizer_dir = self.data.tokenizer_dir if self.data is not None else None
        model_dir = outputs.model_dir(self.spec.output_dir)
        if self.lora:  # the adapter directory (PEFT format), merged model on request
            out = lora.save_adapter(self.strategy, self.ctx, self.spec, model_dir, tokenizer_dir)
        else:
            out = save_pretrained_model(self.strategy, self.ctx, model_dir, tokenizer_dir=tokenizer_dir)
        if self.ctx.is_main:
            log.info("saved the trained model to %s", out)
        return out or ""

    # ------------------------------------------------------------ result

    def metrics(self) -> TrainMetrics:
        spec, ctx, h = self.spec, self.ctx, self.history
        steps_redone = self.ckpt.steps_redone if self.ckpt is not None else 0
        peak = torch.tensor([max(h.memory_gib, default=0.0)], device=ctx.device, dtype=torch.float64)
        peak = ctx.all_reduce(peak, "max").item()
        dtype = self.strategy.dtype
        summary = summarize(h, tokens_per_step=self.tokens_per_step, samples_per_step=self.samples_per_step,
                            flops_per_token=self.flops.flops_per_token,
                            peak_flops_total=peak_flops(ctx.device, dtype) * ctx.world_size)
        return TrainMetrics(
            model=spec.model, kernels=spec.kernels, strategy=spec.strategy, device=device_name(ctx.device),
            world_size=ctx.world_size, steps=self.step, tokens_per_s=summary.tokens_per_s,
            samples_per_s=summary.samples_per_s, mfu=summary.mfu, peak_memory_gib=peak,
            step_time_p50_s=summary.step_time_p50_s, step_time_p90_s=summary.step_time_p90_s,
            step_time_p99_s=summary.step_time_p99_s, final_loss=final_loss(h), loss_curve=list(h.loss),
            tokens_per_s_curve=summary.tokens_per_s_curve, memory_gib_curve=list(h.memory_gib),
            restarts=ctx.restart_count, attempt=ctx.flyte_attempt, steps_redone=steps_redone, skipped_steps=h.skipped_steps,
            resumed_from_step=self.resumed_from, dtype=dtype, num_params=self.flops.num_params,
            flops_per_token=self.flops.flops_per_token, tokens_per_step=self.tokens_per_step,
            step_time_curve=list(h.step_time), kernels_patched=list(self.kernels_patched),
            fp8_linears=len(self.fp8_linears), plan=self.plan.to_json() if self.plan is not None else "",
            eval_loss=h.eval_loss[-1] if h.eval_loss else None,
            eval_perplexity=perplexity(h.eval_loss[-1]) if h.eval_loss else None,
            eval_loss_curve=list(h.eval_loss), eval_steps=list(h.eval_steps),
            data_wait_fraction=summary.data_wait_fraction, loss_tokens_per_step=summary.loss_tokens_per_step,
            dataset=self.data.manifest.source if self.data is not None else spec.dataset,
        )


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train(spec: TrainSpec, *, after_checkpoint: Optional[Callable[[str], None]] = None,
          tracking_settings: Optional[tracking.TrackingSettings] = None) -> TrainMetrics:
    """Run `spec` in this worker process and return the metrics (identical on every rank).

    after_checkpoint: called on rank 0 with the checkpoint directory after each completed save (the Flyte
    task uploads it to its own checkpoint this way; see fuseforge_flyte.flyte_checkpoint).
    tracking_settings: platform.toml's [tracking] (PlatformConfig.tracking_settings()); None: no tracking.

    On SIGTERM (an eviction) every rank finishes the step, checkpoints it and raises
    `preemption.Preempted` (step, checkpoint, metrics): a retriable failure whose restart redoes nothing.
    """
    spec.validate()
    ensure_console_logging()
    ctx = DistContext.from_env(need_group=strategy_class(spec.strategy).needs_process_group)
    quiet_third_party(cuda=ctx.device.type == "cuda")
    run, tracker = None, tracking.Tracker()
    try:
        if ctx.device.type == "cpu" and spec.dtype != "fp32" and ctx.is_main:
            log.info("CPU run: training in fp32 (dtype=%r applies on GPU)", spec.dtype)
        tracker = tracking.start(spec, ctx.is_main, tracking_settings)  # a missing library fails here
        run = _Run(spec, ctx, tracker, after_checkpoint)
        with preemption.sigterm_handler():  # SIGTERM: finish the step, checkpoint, raise Preempted
            run.resume()
            try:
                run.train()
            except preemption.Preempted as stop:
                stop.metrics = run.metrics()
                if ctx.is_main:
                    log.warning("%s (%d steps trained, final loss %.4f)", stop, stop.metrics.steps,
                                stop.metrics.final_loss)
                raise
        metrics = run.metrics()
        if spec.output_dir:
            metrics.model_dir, metrics.output_dir = run.save_model(), spec.output_dir
            if ctx.is_main:
                outputs.write_run_record(spec.output_dir, metrics, spec)
        if ctx.is_main:
            log.info("done: %d steps, final loss %.4f, %.0f tok/s, MFU %s, peak %.2f GiB", metrics.steps,
                     metrics.final_loss if math.isfinite(metrics.final_loss) else float("nan"),
                     metrics.tokens_per_s, metrics.mfu_text(), metrics.peak_memory_gib)
        tracker.finish(metrics)
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
        tracker.finish()  # after a failure or preemption (no-op after a completed run)
