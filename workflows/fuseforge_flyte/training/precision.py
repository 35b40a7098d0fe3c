"""Mixed precision with fp32 master weights: the model computes in bf16, the optimizer updates fp32 copies.

Autocast over fp32 weights (the obvious way) casts every weight in every forward, and leaves the residual
stream in fp32: the embedding output is fp32, so every norm, residual add and their saved activations move
twice the bytes. Here the model's own parameters are bf16, so it runs exactly like a plain bf16 model, while
training keeps fp32 quality:

* each parameter's fp32 master copy is what the optimizer sees and updates;
* gradients leave the bf16 parameter as soon as autograd has accumulated them (a post-accumulate-grad hook)
  and are summed into the master's fp32 gradient, so micro-batches accumulate in fp32;
* with several ranks the same hook starts an asynchronous all-reduce of each master gradient on the last
  micro-batch of a step, so communication overlaps the rest of the backward pass, as DDP's buckets do, but
  in fp32;
* after the optimizer step the bf16 parameters are refreshed from the masters, once per step.

Checkpoints and exports hold the fp32 masters under the parameters' own names, so a resumed run continues
from exactly the weights an uninterrupted run would have.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist


class MasterWeights:
    """fp32 masters for the trainable parameters of `model`, whose parameters become `dtype` copies."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, group_size: int = 1):
        self.dtype = dtype
        self.group_size = group_size  # > 1: all-reduce (sum) the master gradients over the default group
        self._pairs: List[Tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._names: List[str] = []
        self._reduce_now = False
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

    def _make_hook(self, master: torch.nn.Parameter):
        def move_grad(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
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

    def start_micro_batch(self, last: bool) -> None:
        """With several ranks, the last micro-batch of a step all-reduces each gradient once it is complete."""
        self._reduce_now = last and self.group_size > 1

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
    def load_state_dict(self, model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
        """Load a `state_dict()` of this class: masters exactly, the model's parameters rounded from them."""
        model.load_state_dict(state)
        for key, value in model.state_dict(keep_vars=True).items():
            master = self._by_param.get(id(value))
            if master is not None:
                master.copy_(state[key])
        self.refresh_model()


def master_dtype_for(dtype: str, device: torch.device) -> Optional[torch.dtype]:
    """The low-precision dtype the model is held in under master weights, or None to keep fp32 + autocast.

    bf16 on GPUs. fp16 keeps autocast with a gradient scaler (fp16's narrow range needs loss scaling on fp32
    gradients); CPU runs compute in fp32.
    """
    return torch.bfloat16 if dtype == "bf16" and device.type == "cuda" else None
