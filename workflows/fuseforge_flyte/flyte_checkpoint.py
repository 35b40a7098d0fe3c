"""The task's own Flyte checkpoint as the default checkpoint location on a cluster.

A preempted GPU pod is retried by Flyte; without a checkpoint the retry starts over. With
`checkpoint_dir=""` (the default) a training task on a cluster checkpoints where Flyte keeps
intra-task checkpoints (under the execution's metadata prefix, no bucket to choose):

- before the workers start, the pod's launcher downloads the previous attempt's checkpoint into
  a local directory (`restore_previous`), and uploads it again into this attempt's checkpoint
  at once, so that an attempt evicted before its first save still hands the progress on;
- the workers checkpoint into that directory as into any local one (SIGTERM: finish the step,
  save, stop; see training/preemption.py); after each save rank 0 uploads the directory
  (`mirror`), within the pod's termination grace period on an eviction;
- the restored copy came from a bucket, so it must carry a valid signature
  (FUSEFORGE_CHECKPOINT_REQUIRE_KEY: the chart mounts the key into the training pods).

One node only: with several pods, each would hold only its own ranks' files. Multi-node runs
need an explicit checkpoint_dir (an object store all pods reach); they get a warning.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Callable, Dict, Optional

log = logging.getLogger("fuseforge.training")

# Set for the workers when their checkpoint directory is mirrored to the Flyte checkpoint.
MIRROR_ENV = "FUSEFORGE_MIRROR_TO_FLYTE_CHECKPOINT"


def restore_previous(checkpoint, *, nnodes: int, launch_env: Dict[str, str]) -> Optional[str]:
    """A local checkpoint directory for this pod's workers, holding the previous attempt's checkpoints.

    `checkpoint` is flytekit's Checkpoint of this task attempt; `launch_env` receives the workers' variables.
    None (no checkpoints) for multi-node runs.
    """
    from fuseforge_flyte.training.checkpoint.signing import REQUIRE_KEY_ENV

    if nnodes > 1:
        log.warning("checkpoint_dir is empty and this job has %d nodes: the task's own Flyte checkpoint serves one "
                    "node only, so nothing is checkpointed; set checkpoint_dir to an object store (s3://...) "
                    "that every pod can reach", nnodes)
        return None
    local = tempfile.mkdtemp(prefix="fuseforge-checkpoints-")
    if checkpoint.prev_exists():
        checkpoint.restore(local)
        if os.listdir(local):
            log.info("restored the previous attempt's checkpoints into %s", local)
            launch_env[REQUIRE_KEY_ENV] = "1"  # bytes from a bucket: only signed checkpoints are loaded
            checkpoint.save(local)  # this attempt's checkpoint holds them too, in case it saves nothing new
    launch_env[MIRROR_ENV] = "1"
    return local


def worker_hook() -> Optional[Callable[[str], None]]:
    """In a worker: `mirror` when the launcher set the checkpoint directory up for it, else None."""
    return mirror if os.environ.get(MIRROR_ENV) == "1" else None


def mirror(directory: str) -> None:
    """Upload the checkpoint directory into this attempt's Flyte checkpoint (rank 0, after each save)."""
    import flytekit

    flytekit.current_context().checkpoint.save(directory)
    log.info("checkpoint directory uploaded to the task's Flyte checkpoint")
