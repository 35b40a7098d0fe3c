"""The causal-LM loss through fused linear cross-entropy, without materialising logits.

We do not re-implement the model's forward (its signature and outputs differ across
transformers versions and families). Instead the patched forward calls the original
one with `labels=None` while a loss request is pending, and the patched `lm_head`
answers that request: it receives exactly the hidden states the original would project
(after `logits_to_keep` slicing), computes the loss from them and its own weight/bias
with `fused_linear_cross_entropy`, and hands back an empty placeholder instead of
[tokens, vocab] logits. The request lives in a context variable, so concurrent
forwards in other threads are not affected.

The loss equals transformers' `ForCausalLMLoss`: labels shifted left by one and padded
with `ignore_index` (or `shift_labels` as given), mean over non-ignored tokens, or
sum / `num_items_in_batch` when the Trainer passes it for gradient accumulation;
Gemma's final-logit softcapping is applied inside the kernel; Granite's division of
the logits by `logits_scaling` is applied to the hidden states (and bias) before the
kernel, (h / s) W^T + b / s = (h W^T + b) / s; the router auxiliary loss of Mixtral and
Qwen3-MoE is added as their forwards do. The returned output has `logits=None`.
Image-text models (a family's `multimodal_lm`) take the same path: their forwards project
with the head `lm_head_of` finds, then call the stock loss, with none of those logit changes.

The forward falls back to logits (with a warning) when the fused loss cannot stand in:
a custom `loss_function`, an `lm_head` replaced after patching, or DeepSpeed ZeRO-3
partitioned head weights that are not registered as an external parameter of the model
(`deepspeed.zero.register_external_parameter`, as fuseforge's platform does).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fuseforge.functional import cross_entropy, fused_linear_cross_entropy, fused_linear_jsd
from fuseforge.loss_args import IGNORE_INDEX


LOSS_SPEC_ATTR = "_fuseforge_loss"  # where a patched causal LM keeps its LossSpec
# Text-config attributes with which families scale or cap their logits after the LM head: the trainer losses
# (fused DPO, KTO, GRPO) and a distillation teacher's head, which compute plain logits, refuse such models.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


@dataclass(frozen=True)
class LossSpec:
    """Per-model facts the fused forward needs: the family's (see families.Family) and the
    user's tokens per loss chunk (None: the op's default rule)."""

    logit_softcap_attr: str | None = None
    router_aux_loss: bool = False
    chunk_size: int | None = None
    logit_scale_attr: str | None = None


@dataclass(frozen=True)
class Distillation:
    """A teacher's view of the same tokens, for distilling into the patched model.

    Passed as `distillation=` to a patched causal LM's training forward (with labels), it makes the loss
    `(1 - weight) * cross-entropy + weight * JSD_beta(student || teacher)` over the tokens that carry a
    label, the JSD from both LM heads through fused linear JSD (fuseforge.ops.jsd: beta 0 is forward KL,
    1 reverse KL; both distributions at `temperature`), never building [tokens, vocab] logits. The teacher
    tensors are constants. `teacher_hidden` is the teacher's last hidden state (after its final norm) for
    the same input, [batch, seq, teacher hidden]; `teacher_weight` its LM head weight [vocab, teacher
    hidden], the student's vocabulary.
    """

    teacher_hidden: torch.Tensor
    teacher_weight: torch.Tensor
    weight: float = 0.5
    beta: float = 0.5
    temperature: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"Distillation.weight must be in [0, 1] (the JSD's share of the loss), got {self.weight}")


@dataclass
class _LossRequest:
    head: nn.Module
    labels: torch.Tensor | None
    shift_labels: torch.Tensor | None
    ignore_index: int
    num_items_in_batch: torch.Tensor | int | None
    softcap: float | None
    chunk_size: int | None
    logit_divisor: float | None = None  # logits = lm_head(hidden) / logit_divisor
    distillation: Distillation | None = None
    loss: torch.Tensor | None = None


_PENDING: contextvars.ContextVar[_LossRequest | None] = contextvars.ContextVar("fuseforge_pending_loss", default=None)
# While dynamo traces a patched forward the request goes through this list instead: dynamo cannot trace a
# ContextVar (a graph break per forward), but it traces list pushes/pops and resolves the head's read at
# trace time, so compiled code never consults either. _EAGER_REQUESTS counts requests set on _PENDING, so
# that a head traced on its own (the forward around it eager) still finds its request, through a graph break.
_TRACED_REQUESTS: list[_LossRequest] = []
_EAGER_REQUESTS = 0
_EAGER_LOCK = threading.Lock()


def _pending_request() -> _LossRequest | None:
    if not torch.compiler.is_compiling():
        return _PENDING.get()
    if _TRACED_REQUESTS:
        return _TRACED_REQUESTS[-1]
    return _PENDING.get() if _EAGER_REQUESTS else None


def _call_with_request(self, original, request: _LossRequest, args: tuple, kwargs: dict):
    """The original forward with `request` pending for this model's lm_head."""
    global _EAGER_REQUESTS
    if torch.compiler.is_compiling():
        _TRACED_REQUESTS.append(request)
        try:
            return original(self, *args, return_dict=True, **kwargs)
        finally:
            _TRACED_REQUESTS.pop()
    with _EAGER_LOCK:
        _EAGER_REQUESTS += 1
    token = _PENDING.set(request)
    try:
        return original(self, *args, return_dict=True, **kwargs)
    finally:
        _PENDING.reset(token)
        with _EAGER_LOCK:
            _EAGER_REQUESTS -= 1


def shifted_targets(
    labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """Next-token targets, flattened, as transformers' ForCausalLMLoss builds them."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _divide(loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _loss_from_hidden(hidden: torch.Tensor, head: nn.Linear, request: _LossRequest) -> torch.Tensor:
    rows = hidden.reshape(-1, hidden.shape[-1])
    targets = shifted_targets(request.labels, request.shift_labels, request.ignore_index).to(rows.device)
    if targets.numel() != rows.shape[0]:
        given = request.labels if request.shift_labels is None else request.shift_labels
        raise ValueError(
            f"labels of shape {tuple(given.shape)} give {targets.numel()} next-token targets but the model "
            f"kept {rows.shape[0]} positions for the head (logits_to_keep): pass labels for the kept "
            "positions only, or logits_to_keep=0"
        )
    bias = head.bias
    if request.logit_divisor is not None and request.logit_divisor != 1:
        # logits / s, without the logits: (h / s) W^T + b / s. Gradients flow through the division.
        rows = rows / request.logit_divisor
        bias = None if bias is None else bias / request.logit_divisor
    # Under torch.autocast the op casts to the autocast dtype itself, as nn.Linear would.
    loss = fused_linear_cross_entropy(
        rows,
        head.weight,
        targets,
        bias=bias,
        ignore_index=request.ignore_index,
        softcap=request.softcap,
        num_items_in_batch=request.num_items_in_batch,
        chunk_size=request.chunk_size,
    )
    if request.distillation is None:
        return loss
    return _distilled(loss, rows, head, targets, request)


def _distilled(ce: torch.Tensor, rows: torch.Tensor, head: nn.Linear, targets: torch.Tensor,
               request: _LossRequest) -> torch.Tensor:
    """The cross-entropy `ce` mixed with the fused linear JSD to the teacher, normalised as `ce` is."""
    d = request.distillation
    teacher = d.teacher_hidden.reshape(-1, d.teacher_hidden.shape[-1])
    if teacher.shape[0] != rows.shape[0]:
        raise ValueError(f"Distillation.teacher_hidden of shape {tuple(d.teacher_hidden.shape)} covers "
                         f"{teacher.shape[0]} positions, the student's head sees {rows.shape[0]}: give the teacher "
                         "the same input_ids (and no logits_to_keep)")
    device = rows.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    jsd = fused_linear_jsd(rows.to(dtype), head.weight.to(dtype), teacher.to(rows.device, dtype),
                           d.teacher_weight.to(rows.device, dtype), targets, beta=d.beta, temperature=d.temperature,
                           ignore_index=request.ignore_index, chunk_size=request.chunk_size)
    if request.num_items_in_batch is not None:  # a share of the global mean, as the cross-entropy's
        counted = (targets != request.ignore_index).sum().to(jsd.dtype)
        jsd = _divide(jsd * counted, request.num_items_in_batch)
    return (1.0 - d.weight) * ce + d.weight * jsd.to(ce.dtype)


class FusedLossHeadMixin:
    """lm_head that answers a pending loss request instead of computing logits."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        request = _pending_request()
        if request is None or request.head is not self or request.loss is not None:
            return super().forward(input)
        request.loss = _loss_from_hidden(input, self, request)
        return input.new_empty((*input.shape[:-1], 0))  # placeholder "logits": no [tokens, vocab] tensor


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for transformers' ForCausalLMLoss (same arguments) on fuseforge's cross-entropy kernel."""
    targets = shifted_targets(labels, shift_labels, ignore_index).to(logits.device)
    logits = logits.float().reshape(-1, vocab_size)  # fp32 loss, as transformers upcasts
    if num_items_in_batch is None:
        return cross_entropy(logits, targets, ignore_index=ignore_index, reduction="mean").float()
    loss = cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum").float()
    return _divide(loss, num_items_in_batch)


def is_stock_loss(loss_function) -> bool:
    """True for transformers' causal-LM loss (or ours): what the fused path reproduces."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return loss_function is ForCausalLMLoss or loss_function is causal_lm_loss


@functools.lru_cache(maxsize=None)
def _labels_position(original) -> int | None:
    """Index of `labels` among the forward's positional parameters (after self)."""
    params = list(inspect.signature(original).parameters)
    return params.index("labels") - 1 if "labels" in params else None


def lm_head_of(model: nn.Module) -> nn.Module | None:
    """The model's output projection: its `lm_head`, or where it says it is (Llama 4's image-text
    model projects through its inner language model's head)."""
    head = getattr(model, "lm_head", None)
    return head if head is not None else model.get_output_embeddings()


def head_modules(head: nn.Module) -> list[nn.Module]:
    """The projections behind an lm_head: itself, or for peft's ModulesToSaveWrapper (a trainable copy of the
    head per adapter: `modules_to_save=["lm_head"]`) its original and every copy."""
    if _is_modules_to_save(head):
        return [head.original_module, *head.modules_to_save.values()]
    return [head]


def active_head(head: nn.Module) -> nn.Module:
    """The projection this forward computes with: for peft's ModulesToSaveWrapper, the one its forward picks
    (the active adapter's copy; the original while adapters are disabled), else the head itself."""
    if not _is_modules_to_save(head):
        return head
    adapters = head.active_adapters
    if head.disable_adapters or not adapters or any(a not in head._adapters for a in adapters):
        return head.original_module
    return head.modules_to_save[adapters[0]]


def _is_modules_to_save(head) -> bool:
    return type(head).__name__ == "ModulesToSaveWrapper" and hasattr(head, "modules_to_save")


def _fallback_reason(model: nn.Module) -> str | None:
    """Why the fused loss cannot stand in for this forward's loss right now, if it cannot."""
    if not is_stock_loss(model.loss_function):
        return "has a custom loss_function"
    head = active_head(lm_head_of(model))
    if not isinstance(head, FusedLossHeadMixin):
        return "has an lm_head that was replaced after apply_kernels"
    if hasattr(head.weight, "ds_id") and not _gathered_for(model, head.weight):
        # DeepSpeed ZeRO-3 re-gathers a module's weights for backward through hooks on that module's
        # outputs; the placeholder the head returns is not in the loss graph, so they would be missing.
        return ("has DeepSpeed ZeRO-3 partitioned lm_head weights (register them with "
                "deepspeed.zero.register_external_parameter(model, lm_head.weight) to keep the fused loss)")
    return None


def _gathered_for(model: nn.Module, weight: nn.Parameter) -> bool:
    """Whether ZeRO-3 gathers `weight` for the whole of `model`'s forward and backward: registered as an
    external parameter of `model` (DeepSpeed's protocol for a weight used outside its module), and whole now."""
    external = getattr(model, "ds_external_parameters", None)
    return external is not None and weight.numel() > 0 and any(p is weight for _, p in external())


def _fused_forward(self, original, args: tuple, kwargs: dict):
    skip_logits = kwargs.pop("skip_logits", None)
    distillation = kwargs.pop("distillation", None)
    position = _labels_position(original)
    positional_labels = position is not None and len(args) > position
    labels = args[position] if positional_labels else kwargs.get("labels")
    shift_labels = kwargs.get("shift_labels")
    wants_loss = labels is not None or shift_labels is not None
    fused = wants_loss and (self.training if skip_logits is None else skip_logits)
    if distillation is not None and not fused:
        raise ValueError(f"{type(self).__name__}: distillation= needs a training forward with labels (the fused "
                         "loss computes it); evaluate without it")
    if not fused:
        return original(self, *args, **kwargs)
    fallback = _fallback_reason(self)
    if distillation is not None and fallback is not None:
        raise ValueError(f"{type(self).__name__} {fallback}: the fused loss cannot run, and distillation= needs it")
    if fallback is not None:
        warnings.warn(
            f"fuseforge: {type(self).__name__} {fallback}; computing logits and the loss from them instead of "
            "fused linear cross-entropy",
            RuntimeWarning,
            stacklevel=3,
        )
        return original(self, *args, **kwargs)

    spec: LossSpec = getattr(self, LOSS_SPEC_ATTR)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if positional_labels:
        args = args[:position] + (None,) + args[position + 1 :]
    else:
        kwargs["labels"] = None
    softcap = getattr(self.config, spec.logit_softcap_attr, None) if spec.logit_softcap_attr else None
    divisor = getattr(self.config, spec.logit_scale_attr, None) if spec.logit_scale_attr else None
    if distillation is not None and (softcap or divisor not in (None, 1)):
        raise ValueError(f"{type(self).__name__} caps or scales its logits ({spec.logit_softcap_attr or ''}"
                         f"{spec.logit_scale_attr or ''}); the fused JSD of distillation= does not apply that")
    request = _LossRequest(
        head=active_head(lm_head_of(self)),
        labels=labels,
        shift_labels=shift_labels,
        ignore_index=kwargs.get("ignore_index", IGNORE_INDEX),
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        softcap=softcap,
        chunk_size=spec.chunk_size,
        logit_divisor=divisor,
        distillation=distillation,
    )
    output = _call_with_request(self, original, request, args, kwargs)
    if request.loss is None:
        raise RuntimeError(
            f"fuseforge: {type(self).__name__}.forward did not call its lm_head; cannot compute the fused loss"
        )
    loss = request.loss
    aux_loss = output.get("aux_loss") if spec.router_aux_loss else None
    if aux_loss is not None:
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    output = type(output)(**{**dict(output.items()), "loss": loss, "logits": None})
    return output if return_dict else output.to_tuple()


@functools.lru_cache(maxsize=None)
def fused_forward_for(cls: type):
    """The patched forward for a causal-LM class, with the original's signature and docs.

    Installed per instance (as a bound method), so `inspect.signature(model.forward)`,
    which Trainer uses to pick dataset columns, still shows the original parameters.
    """
    original = cls.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return _fused_forward(self, original, args, kwargs)

    forward._fuseforge_fused_forward = True
    return forward
