"""Training metrics for your own training code: the same `TrainMetrics` (and Deck) as the built-in `train`.

Two ways in, one result:

- Hugging Face `Trainer` and TRL trainers: pass a `FuseforgeMetricsCallback` and return
  `callback.metrics()` after `trainer.train()`::

      callback = FuseforgeMetricsCallback(dataset="my-data")
      trainer = SFTTrainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
      trainer.train()
      return callback.metrics()

- a plain PyTorch loop: a `StepMeter`, told about each optimizer step::

      meter = StepMeter(model, dataset="my-data")          # the clock starts here
      for batch in meter.batches(loader):                  # optional: times the wait for each batch
          loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
          meter.step(loss=loss, batch=batch)               # or tokens=..., samples=...
      return meter.metrics()                               # on every rank: it reduces over ranks

Returned from a `@training_task` function, the metrics come back from rank 0 and the task adds the
"Training metrics" Deck (fuseforge_flyte.user_task).

What is measured, as the built-in engine measures it (training/metrics.py): the tokens actually seen per
optimizer step, summed over ranks (non-padding tokens: the batch's attention_mask, or the Trainer's
`num_input_tokens_seen` with include_num_input_tokens_seen="non_padding" unless set otherwise); step
time from the end of one step to the end of the next, the wait for data included (the Trainer's logging,
evaluation and checkpointing excluded); tokens/s, samples/s, MFU and step-time percentiles over the
steady steps (the first step is a warm-up: allocator, autotuning, compilation); MFU = training FLOPs
per token of the model (training/models.py) x tokens/s / (device peak x world size), 0 where the peak
is unknown (CPU); peak memory (max over ranks; the curve is rank 0's); the loss curve (the Trainer's
logged losses, one per `logging_steps`, averaged over ranks; the meter's per step, averaged over ranks);
the fuseforge kernels patched into the model.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Iterable, Iterator, List, Mapping, Optional

import torch

from fuseforge.loss_args import IGNORE_INDEX  # labels that carry no loss (transformers' convention)
from fuseforge_flyte.training.metrics import (History, device_name, final_loss, peak_memory_gib, perplexity,
                                              reset_peak_memory, summarize)
from fuseforge_flyte.training.spec import TrainMetrics

try:  # the callback needs transformers; the meter does not
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - depends on the environment
    TrainerCallback = object  # type: ignore[assignment,misc]

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# ------------------------------------------------------------------------------------------ helpers


def _unwrap(model: Any) -> Any:
    """The model inside DDP / FSDP / DeepSpeed wrappers (they keep it as `.module`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _world_size() -> int:
    """The process group's size: ranks that never joined one are not counted (nothing is summed over them)."""
    return torch.distributed.get_world_size() if _distributed() else 1


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_dtype(model: Any) -> str:
    param = next(iter(model.parameters()), None) if model is not None else None
    return _DTYPES.get(param.dtype, "fp32") if param is not None else "fp32"


def _model_name(model: Any) -> str:
    config = getattr(model, "config", None)
    return (getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or type(model).__name__) if model is not None else ""


def kernels_patched(model: Any) -> List[str]:
    """The fuseforge kernels `apply_kernels` swapped into `model` ([] when it was not patched)."""
    patching = sys.modules.get("fuseforge.transformers")  # not imported: nothing can have been patched
    if patching is None or model is None:
        return []
    report = patching.get_patch_report(_unwrap(model))
    return report.patched_kernels() if report is not None else []


def _flops_per_token(model: Any, seq_len: float) -> tuple[int, float]:
    """(parameters, training FLOPs per token): training/models.py's count for Hugging Face causal LMs,
    6 x parameters for any other module (no attention term)."""
    from fuseforge_flyte.training.models import model_flops

    model = _unwrap(model)
    if model is None:
        return 0, 0.0
    try:
        flops = model_flops(model, max(int(round(seq_len)), 1))
        return flops.num_params, flops.flops_per_token
    except (AttributeError, TypeError):
        params = sum(p.numel() for p in model.parameters())
        return params, 6.0 * params


def _count(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().sum().item()) if value.numel() != 1 else float(value.item())
    return float(value)


def batch_counts(batch: Mapping[str, Any]) -> tuple[int, int, int]:
    """(tokens, samples, loss tokens) of one batch: non-padding tokens (attention_mask, else all of
    input_ids), rows, and the labels that carry a loss after the causal shift."""
    ids = batch.get("input_ids")
    mask = batch.get("attention_mask")
    if ids is None and mask is None:
        raise ValueError("StepMeter.step(batch=...): the batch has neither input_ids nor attention_mask; "
                         "pass tokens=... (and samples=...) instead")
    tokens = int(mask.sum().item()) if mask is not None else ids.numel()
    samples = (ids if ids is not None else mask).shape[0]
    labels = batch.get("labels")
    loss_tokens = int((labels[..., 1:] != IGNORE_INDEX).sum().item()) if labels is not None else 0
    return tokens, samples, loss_tokens


def _build(*, model: Any, history: History, tokens: List[float], samples: List[float], loss_curve: List[float],
           device: torch.device, dtype: str, strategy: str, world_size: int, peak_memory: float,
           seq_len: Optional[int], model_name: str, dataset: str) -> TrainMetrics:
    """TrainMetrics from per-step global counts and rank 0's times, with training/metrics.py's summary."""
    steps = len(history.step_time)
    warm = set(history.warmup)
    steady = [i for i in range(steps) if i not in warm] or list(range(steps))
    tokens_per_step = _mean([tokens[i] for i in steady])  # summarize divides by the steady steps' mean time
    samples_per_step = _mean([samples[i] for i in steady])
    if seq_len is None:
        seq_len = int(round(sum(tokens) / sum(samples))) if sum(samples) else 0
    num_params, flops_per_token = _flops_per_token(model, seq_len)
    from fuseforge_flyte.training.models import peak_flops

    summary = summarize(history, tokens_per_step=tokens_per_step, samples_per_step=samples_per_step,
                        flops_per_token=flops_per_token, peak_flops_total=peak_flops(device, dtype) * world_size)
    patched = kernels_patched(model)
    return TrainMetrics(
        model=model_name or _model_name(_unwrap(model)), kernels=bool(patched), strategy=strategy,
        device=device_name(device), world_size=world_size, steps=steps, tokens_per_s=summary.tokens_per_s,
        samples_per_s=summary.samples_per_s, mfu=summary.mfu, peak_memory_gib=peak_memory,
        step_time_p50_s=summary.step_time_p50_s, step_time_p90_s=summary.step_time_p90_s,
        step_time_p99_s=summary.step_time_p99_s, final_loss=final_loss(history),
        loss_curve=list(loss_curve),
        tokens_per_s_curve=[n / t if t > 0 else 0.0 for n, t in zip(tokens, history.step_time)],
        memory_gib_curve=list(history.memory_gib), dtype=dtype, num_params=num_params,
        flops_per_token=flops_per_token, tokens_per_step=int(round(tokens_per_step)),
        step_time_curve=list(history.step_time), kernels_patched=patched,
        eval_loss=history.eval_loss[-1] if history.eval_loss else None,
        eval_perplexity=perplexity(history.eval_loss[-1]) if history.eval_loss else None,
        eval_loss_curve=list(history.eval_loss), eval_steps=list(history.eval_steps),
        data_wait_fraction=summary.data_wait_fraction, loss_tokens_per_step=summary.loss_tokens_per_step,
        dataset=dataset,
    )


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _max_over_ranks(value: float, device: torch.device) -> float:
    if not (_distributed() and _world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


# ------------------------------------------------------------------------------------------ plain PyTorch


class StepMeter:
    """Per-step measurements of a plain PyTorch training loop; `metrics()` gives TrainMetrics.

    model: the model being trained (FLOPs per token, parameters, dtype, device, kernels patched).
    seq_len: tokens per sequence for the attention FLOPs (default: the mean tokens per sample seen).
    dtype: "bf16" / "fp16" / "fp32" for the device peak of MFU (default: the parameters' dtype; pass
    "bf16" when training under autocast). strategy, dataset, model_name: labels for the report.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, *, dataset: str = "", model_name: str = "",
                 seq_len: Optional[int] = None, dtype: Optional[str] = None, strategy: str = "ddp",
                 device: Optional[torch.device | str] = None):
        if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"StepMeter(dtype={dtype!r}): must be 'fp32', 'bf16' or 'fp16'")
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
            raise ValueError(f"StepMeter(seq_len={seq_len!r}): must be a positive integer")
        self.model = model
        self.dataset, self.model_name, self.seq_len, self.strategy = dataset, model_name, seq_len, strategy
        self.dtype = dtype or _model_dtype(model)
        if device is None:
            param = next(iter(model.parameters()), None) if model is not None else None
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.history = History(warmup=[0])
        self.tokens: List[float] = []  # this rank's, per step (summed over ranks by metrics())
        self.samples: List[float] = []
        self.losses: List[float] = []  # this rank's; NaN where no loss was given
        self._wait = 0.0
        self.start()

    def start(self) -> "StepMeter":
        """(Re)start the clock of the next step: call right before the loop if setup came in between."""
        _synchronize(self.device)
        reset_peak_memory(self.device)
        self._mark = time.perf_counter()
        self._wait = 0.0
        return self

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from `iterable`, counting the time spent waiting for each item as the step's data wait."""
        iterator = iter(iterable)
        while True:
            begin = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            self._wait += time.perf_counter() - begin
            yield item

    def step(self, *, loss: Any = None, batch: Optional[Mapping[str, Any]] = None, tokens: Any = None,
             samples: Any = None, loss_tokens: Any = None) -> None:
        """Record one optimizer step of this rank: its loss and what it consumed (a `batch` dict with
        input_ids/attention_mask/labels, or the counts; with gradient accumulation, the step's totals)."""
        if batch is not None and tokens is not None:
            raise ValueError("StepMeter.step: pass batch=... or tokens=..., not both")
        if batch is None and tokens is None:
            raise ValueError("StepMeter.step: pass batch=... (a dict with input_ids / attention_mask) or tokens=...")
        if batch is not None:
            n_tokens, n_samples, n_loss = batch_counts(batch)
        else:
            n_tokens, n_samples, n_loss = _count(tokens), 0, 0
        if samples is not None:
            n_samples = _count(samples)
        if loss_tokens is not None:
            n_loss = _count(loss_tokens)
        value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else (
            float(loss) if loss is not None else float("nan"))
        _synchronize(self.device)
        now = time.perf_counter()
        self.history.step_time.append(now - self._mark)
        self.history.data_wait.append(self._wait)
        self.history.memory_gib.append(peak_memory_gib(self.device))
        self.history.loss_tokens.append(int(n_loss))
        self.tokens.append(float(n_tokens))
        self.samples.append(float(n_samples))
        self.losses.append(value)
        reset_peak_memory(self.device)
        self._mark, self._wait = time.perf_counter(), 0.0

    def evaluation(self, loss: float) -> None:
        """Record an eval loss (per token, already global) after the latest step."""
        self.history.eval_loss.append(float(loss))
        self.history.eval_steps.append(len(self.history.step_time))
        self.start()  # evaluation time is not the next step's

    def metrics(self) -> TrainMetrics:
        """The run's TrainMetrics: a collective, call it on every rank (the counts are summed over ranks,
        the losses averaged); rank 0's step times and memory curve."""
        steps = len(self.tokens)
        if steps == 0:
            raise ValueError("StepMeter.metrics(): no step recorded; call meter.step(...) after each optimizer step")
        tokens, samples, loss_tokens = list(self.tokens), list(self.samples), list(self.history.loss_tokens)
        losses = list(self.losses)
        world = _world_size()
        if _distributed() and world > 1:
            dist = torch.distributed
            counts = torch.tensor([steps, -steps], dtype=torch.float64, device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            if int(counts[0]) != steps or int(-counts[1]) != steps:
                raise ValueError(f"StepMeter.metrics(): the ranks recorded different numbers of steps "
                                 f"({int(-counts[1])} to {int(counts[0])}); call meter.step once per optimizer step on every rank")
            finite = [0.0 if math.isnan(x) else x for x in losses]
            reported = [0.0 if math.isnan(x) else 1.0 for x in losses]
            packed = torch.tensor(tokens + samples + loss_tokens + finite + reported, dtype=torch.float64,
                                  device=self.device)
            dist.all_reduce(packed)
            parts = packed.tolist()
            tokens, samples, loss_tokens = parts[:steps], parts[steps:2 * steps], parts[2 * steps:3 * steps]
            sums, counts_ = parts[3 * steps:4 * steps], parts[4 * steps:]
            losses = [s / c if c else float("nan") for s, c in zip(sums, counts_)]
        history = History(loss=losses, step_time=list(self.history.step_time),
                          memory_gib=list(self.history.memory_gib), warmup=[0], data_wait=list(self.history.data_wait),
                          loss_tokens=[int(x) for x in loss_tokens], eval_loss=list(self.history.eval_loss),
                          eval_steps=list(self.history.eval_steps))
        peak = _max_over_ranks(max(history.memory_gib, default=0.0), self.device)
        return _build(model=self.model, history=history, tokens=tokens, samples=samples, loss_curve=losses,
                      device=self.device, dtype=self.dtype, strategy=self.strategy, world_size=world,
                      peak_memory=peak, seq_len=self.seq_len, model_name=self.model_name, dataset=self.dataset)


# ------------------------------------------------------------------------------------------ Trainer / TRL


class FuseforgeMetricsCallback(TrainerCallback):
    """A `transformers.TrainerCallback` (TRL trainers included) recording what `metrics()` returns.

    Tokens come from the Trainer's own count (`state.num_input_tokens_seen`, gathered over ranks): the
    callback turns it on as "non_padding" when the run left it off. The loss curve is the logged loss,
    one point per `logging_steps` (use logging_steps=1 for one per step).
    """

    def __init__(self, *, dataset: str = "", model_name: str = "", seq_len: Optional[int] = None):
        if TrainerCallback is object:
            raise ImportError("FuseforgeMetricsCallback needs transformers: pip install transformers")
        self.dataset, self.model_name, self.seq_len = dataset, model_name, seq_len
        self._metrics: Optional[TrainMetrics] = None
        self.history = History(warmup=[0])
        self.tokens: List[float] = []  # global, per optimizer step
        self.samples: List[float] = []
        self.losses: List[float] = []  # logged, global mean
        self.loss_steps: List[int] = []

    # -- clock

    def _restart(self) -> None:
        _synchronize(self._device)
        reset_peak_memory(self._device)
        self._mark = time.perf_counter()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.include_num_input_tokens_seen in ("no", False):
            args.include_num_input_tokens_seen = "non_padding"  # read by the Trainer at every micro-batch
        self._model, self._args, self._device = model, args, torch.device(args.device)
        self._seen = state.num_input_tokens_seen
        self._samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        self._metrics = None
        self._wait = 0.0
        self._restart()

    def on_step_begin(self, args, state, control, **kwargs):
        self._wait = time.perf_counter() - self._mark  # fetching the step's batches happens before this

    def on_step_end(self, args, state, control, **kwargs):
        _synchronize(self._device)
        self.history.step_time.append(time.perf_counter() - self._mark)
        self.history.data_wait.append(self._wait)
        self.history.memory_gib.append(peak_memory_gib(self._device))
        self.tokens.append(float(state.num_input_tokens_seen - self._seen))
        self.samples.append(float(self._samples_per_step))
        self._seen = state.num_input_tokens_seen
        self._restart()

    # Logging, evaluation and saving run after on_step_end; their callbacks fire when they are done,
    # so restarting the clock there leaves their time out of the next step.
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.loss_steps.append(state.global_step)
        self._restart()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics and "eval_loss" in metrics:
            self.history.eval_loss.append(float(metrics["eval_loss"]))
            self.history.eval_steps.append(state.global_step)
        self._restart()

    def on_save(self, args, state, control, **kwargs):
        self._restart()

    def on_train_end(self, args, state, control, **kwargs):
        """Runs on every rank: the memory peak is reduced over ranks here, so metrics() is local."""
        args = self._args
        strategy = "deepspeed" if args.deepspeed else "fsdp" if args.fsdp else "ddp"
        dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else _model_dtype(self._model)
        peak = _max_over_ranks(max(self.history.memory_gib, default=0.0), self._device)
        history = History(loss=list(self.losses), step_time=list(self.history.step_time),
                          memory_gib=list(self.history.memory_gib), warmup=[0],
                          data_wait=list(self.history.data_wait), eval_loss=list(self.history.eval_loss),
                          eval_steps=list(self.history.eval_steps))
        self._metrics = _build(model=self._model, history=history, tokens=self.tokens, samples=self.samples,
                               loss_curve=self.losses, device=self._device, dtype=dtype, strategy=strategy,
                               world_size=args.world_size, peak_memory=peak, seq_len=self.seq_len,
                               model_name=self.model_name, dataset=self.dataset)

    def metrics(self) -> TrainMetrics:
        """The run's TrainMetrics (after `trainer.train()` returned)."""
        if self._metrics is None:
            raise RuntimeError("FuseforgeMetricsCallback.metrics(): training has not ended; call it after "
                               "trainer.train(), with the callback passed in Trainer(callbacks=[...])")
        return self._metrics
