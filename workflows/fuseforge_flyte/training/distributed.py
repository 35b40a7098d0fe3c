"""The process's place in the job (from torch elastic's environment) and the collectives the engine needs.

torchrun / the kfpytorch Elastic plugin start one process per device and export
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT and TORCHELASTIC_RESTART_COUNT.
A single process without them is world size 1.

Restarts: torch >= 2.5's c10d rendezvous shares the agent's TCPStore with the
workers and keeps it across restart rounds, so a restarted worker can read the
dead attempt's connection keys and fail to connect (pytorch/pytorch#135712; still
so in torch 2.13). Launch the agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a
fresh store each round): `run_local` does, and Flyte Elastic tasks must set it in
the task environment. The engine warns when a restarted worker sees a shared store.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_TIMEOUT = timedelta(minutes=30)  # checkpoint uploads and first-step compiles can be slow


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool  # this context initialised the process group and must destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @classmethod
    def from_env(cls, *, need_group: bool) -> "DistContext":
        """Read the elastic environment, pick the device and join the process group.

        A group is created when WORLD_SIZE > 1, or for a single process when the
        strategy needs one (FSDP, DeepSpeed): then an in-memory store, no network.
        """
        rank = _env_int("RANK", 0)
        world = _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", 0)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"invalid torch elastic environment: RANK={rank}, WORLD_SIZE={world}")
        if torch.cuda.is_available():
            if local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible: "
                    f"nproc_per_node must not exceed the GPUs per node"
                )
            torch.cuda.set_device(local_rank)
            device, backend = torch.device("cuda", local_rank), "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        if _env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            logging.getLogger("fuseforge.training").warning(
                "restarted worker on a shared rendezvous store: if joining the process group fails, launch the "
                "elastic agent with %s=1 (pytorch/pytorch#135712)", SHARED_STORE_ENV)
        owns = False
        if (world > 1 or need_group) and not dist.is_initialized():
            kwargs: dict = {"backend": backend, "timeout": _TIMEOUT}
            if device.type == "cuda":
                kwargs["device_id"] = device
            if world == 1:
                kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
            dist.init_process_group(**kwargs)
            owns = True
        return cls(rank, world, local_rank, device, owns)

    @property
    def restart_count(self) -> int:
        return _env_int("TORCHELASTIC_RESTART_COUNT", 0)

    @property
    def flyte_attempt(self) -> int:
        """Flyte's attempt number of the task (set in its pods; 0 outside Flyte)."""
        return _env_int("FLYTE_ATTEMPT_NUMBER", 0)

    def barrier(self) -> None:
        if self.distributed:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a tensor on self.device (a no-op for one process)."""
        if self.distributed and self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not (self.distributed and self.world_size > 1):
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, device=self.device if self.device.type == "cuda" else None)
        return holder[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(self.all_reduce(t, "max").item() > 0)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
