"""Run a TrainSpec on N local worker processes through torch elastic, as torchrun and Flyte's Elastic do.

For laptops/CI (gloo on the CPU) and single-node GPU boxes without a scheduler;
workers that die are restarted up to `max_restarts` times and resume from the
newest checkpoint; a permanent failure (see training/permanent.py) is not retried.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Callable, Dict, Optional, TypeVar

import torch

from fuseforge_flyte.environ import environment
from fuseforge_flyte.training import permanent
from fuseforge_flyte.training.checkpoint import check_resume_settings
from fuseforge_flyte.training.distributed import SHARED_STORE_ENV
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.spec import TrainMetrics, TrainSpec
from fuseforge_flyte.training.tracking import TrackingSettings

T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(spec: TrainSpec, threads: Optional[int], tracking_settings: Optional[TrackingSettings]) -> TrainMetrics:
    if threads:
        torch.set_num_threads(threads)  # also keeps OpenMP from deadlocking in forked workers
    return permanent.run_worker(lambda: train(spec, tracking_settings=tracking_settings),
                                int(os.environ.get("RANK", "0")))


def run_local(spec: TrainSpec, nproc: int = 2, *, max_restarts: int = 0, start_method: str = "spawn",
              threads_per_worker: Optional[int] = 1,
              tracking_settings: Optional[TrackingSettings] = None) -> Dict[int, TrainMetrics]:
    """Train `spec` on `nproc` local workers; {rank: metrics} of the last (successful) attempt.

    tracking_settings: platform.toml's [tracking] for the workers (PlatformConfig.tracking_settings()); None: none.

    The agent gets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see distributed.py: restarts
    with the shared rendezvous store can read the dead attempt's addresses).
    start_method "fork" starts in a fraction of a second but needs a parent that has
    not initialised CUDA; "spawn" re-imports torch/transformers in each worker.
    """
    spec.validate()
    check_resume_settings(spec)  # a checkpoint of other settings: one error here, not one per worker
    with environment({SHARED_STORE_ENV: "1"}), permanent.failure_directory():
        results = launch_local(_worker, nproc, spec, threads_per_worker, tracking_settings,
                               max_restarts=max_restarts, start_method=start_method)
    for result in results.values():
        permanent.raise_if_failed(result)
    return results


def launch_local(fn: Callable[..., T], nproc: int, *args: Any, max_restarts: int = 0,
                 start_method: str = "spawn") -> Dict[int, T]:
    """`fn(*args)` on `nproc` local workers through torch elastic (RANK, WORLD_SIZE... set): {rank: result}."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"fuseforge-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=max_restarts,
        start_method=start_method, monitor_interval=0.1,
    )
    from fuseforge_flyte.quiet import worker_failures_to_log_file

    with worker_failures_to_log_file():  # raised below anyway; the agent's copy goes to a log file
        return elastic_launch(config, fn)(*args)
