"""Mixed precision with fp32 master weights: the model computes in bf16, the optimizer updates fp32 copies.

Autocast over fp32 weights (the obvious way) casts every weight in every forward, and leaves the residual
stream in fp32: the embedding output is fp32, so every norm, residual add and their saved activations move
twice the bytes. Here the model's own parameters are bf16, so it runs exactly like a plain bf16 model, while
training keeps fp32 quality:

* each parameter's fp32 master copy is what the optimizer sees and updates;
* gradients leave the bf16 parameter as soon as autograd has accumulated them (a post-accumulate-grad hook)
  and are summed into the master's fp32 gradient, so micro-batches accumulate in fp32; a step of one
  micro-batch on one rank has nothing to accumulate, and keeps the bf16 gradient as it is;
* with several ranks the same hook starts an asynchronous all-reduce of each master gradient on the last
  micro-batch of a step, so communication overlaps the rest of the backward pass, as DDP's buckets do, but
  in fp32;
* the optimizer (fuseforge.optim.MasterAdamW) reads each master's gradient in the dtype it has, updates the
  master and writes the bf16 parameter in the same pass: no fp32 copy of a bf16 gradient and no separate
  refresh of the model (`refresh_model` remains for loading and for other optimizers).

Checkpoints and exports hold the fp32 masters under the parameters' own names, so a resumed run continues
from exactly the weights an uninterrupted run would have.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(spec, device: torch.device) -> str:
    """The precision actually used: the spec's (TrainSpec.dtype) on GPU, fp32 on the CPU."""
    return spec.dtype if device.type == "cuda" else "fp32"


def compute_torch_dtype(spec, device: torch.device) -> torch.dtype:
    return TORCH_DTYPES[compute_dtype(spec, device)]


class MasterWeights:
    """fp32 masters for the trainable parameters of `model`, whose parameters become `dtype` copies."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, group_size: int = 1):
        self.dtype = dtype
        self.group_size = group_size  # > 1: all-reduce (sum) the master gradients over the default group
        self._pairs: List[Tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._names: List[str] = []
        self._reduce_now = False
        self._keep_low = False  # this micro-batch's gradients stay bf16 (the only one of the step, one rank)
        self._low_grads: Dict[int, torch.Tensor] = {}  # id(master) -> its bf16 gradient, while _keep_low
        self._pending: List = []
        for name, param in model.named_parameters():  # shared (tied) parameters come once
            if not param.requires_grad:
                continue
            if param.dtype != torch.float32:
                raise TypeError(f"master weights need an fp32 model; parameter {name!r} is {param.dtype}")
            master = torch.nn.Parameter(param.detach().clone())
            param.data = param.detach().to(dtype)
            param.register_post_accumulate_grad_hook(self._make_hook(master))
            self._pairs.append((param, master))
            self._names.append(name)
        self._by_param = {id(p): m for p, m in self._pairs}
        self._copy_of = {id(m): p for p, m in self._pairs}

    def _make_hook(self, master: torch.nn.Parameter):
        def move_grad(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            kept = self._low_grads.pop(id(master), None)
            if kept is not None:  # a second backward into the same step after all: accumulate in fp32 from here
                master.grad = kept.to(torch.float32)
            elif self._keep_low and master.grad is None:
                self._low_grads[id(master)] = grad
                return
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
            if self._reduce_now:
                self._pending.append(dist.all_reduce(master.grad, async_op=True))

        return move_grad

    def named_parameters(self) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        """The masters under their parameters' names: what the optimizer gets."""
        return zip(self._names, (m for _, m in self._pairs))

    def parameters(self) -> List[torch.nn.Parameter]:
        return [m for _, m in self._pairs]

    def model_copy_of(self, master: torch.Tensor) -> torch.Tensor:
        """The model's low-precision parameter that `master` is the master of."""
        return self._copy_of[id(master)]

    def gradient_of(self, master: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient to apply to `master`: its fp32 accumulation, or the kept bf16 gradient, or None."""
        kept = self._low_grads.get(id(master))
        return kept if kept is not None else master.grad

    def gradients(self) -> List[torch.Tensor]:
        """Every master's gradient that exists (for the gradient norm)."""
        return [g for g in (self.gradient_of(m) for _, m in self._pairs) if g is not None]

    def start_micro_batch(self, last: bool) -> None:
        """With several ranks, the last micro-batch of a step all-reduces each gradient once it is complete.
        A step's only micro-batch on a single rank keeps its bf16 gradients (nothing to sum them with)."""
        self._reduce_now = last and self.group_size > 1
        self._keep_low = (last and self.group_size == 1 and not self._low_grads
                          and all(m.grad is None for _, m in self._pairs))

    def clear_gradients(self) -> None:
        """Drop the kept bf16 gradients (the optimizer's zero_grad drops the fp32 ones)."""
        self._low_grads.clear()
        self._keep_low = False

    def finish_gradients(self) -> None:
        """Wait for the step's all-reduces (a parameter that got no gradient on this rank gets zeros first)."""
        if self.group_size > 1:
            for _, master in self._pairs:  # every rank must reduce every tensor, in the same order
                if master.grad is None:
                    master.grad = torch.zeros_like(master)
                    self._pending.append(dist.all_reduce(master.grad, async_op=True))
        for work in self._pending:
            work.wait()
        self._pending.clear()
        self._reduce_now = False

    @torch.no_grad()
    def refresh_model(self) -> None:
        """Copy the updated masters into the model's low-precision parameters (once per optimizer step)."""
        params = [p for p, _ in self._pairs]
        torch._foreach_copy_(params, [m for _, m in self._pairs])

    def state_dict(self, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """`model.state_dict()` with each trainable parameter's entry (tied names included) its fp32 master."""
        state = model.state_dict(keep_vars=True)
        return {k: (self._by_param.get(id(v), v)).detach() for k, v in state.items()}

    @torch.no_grad()
    def load_state_dict(self, model: torch.nn.Module, state: Dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a `state_dict()` of this class: masters exactly, the model's parameters rounded from them
        (strict=False: a part of it, e.g. LoRA's trained parameters only)."""
        model.load_state_dict(state, strict=strict)
        for key, value in model.state_dict(keep_vars=True).items():
            master = self._by_param.get(id(value))
            if master is not None and key in state:
                master.copy_(state[key])
        self.refresh_model()


def master_dtype_for(dtype: str, device: torch.device) -> Optional[torch.dtype]:
    """The low-precision dtype the model is held in under master weights, or None to keep fp32 + autocast.

    bf16 on GPUs. fp16 keeps autocast with a gradient scaler (fp16's narrow range needs loss scaling on fp32
    gradients); CPU runs compute in fp32.
    """
    return torch.bfloat16 if dtype == "bf16" and device.type == "cuda" else None
