"""Checkpoints: atomic, verified before anything is loaded, resumable; on a local/shared filesystem or any fsspec store.

One module per concern:

    layout.py         the on-disk layout: directory names, marker files, the manifest's shape
    integrity.py      sha256 of every file, hashed once when written and checked before loading
    signing.py        the manifest's HMAC: the key, and the opt-in to load unsigned checkpoints
    storage.py        the fsspec root, atomic JSON writes, fsync before the commit
    space.py          free space before a save, and telling a full disk from other failures
    rng.py            the RNG states saved per rank
    dcp_metadata.py   DCP's .metadata and DeepSpeed's files read through allow-lists: no code runs
    compatibility.py  whether a verified checkpoint fits this run (model, strategy, run settings)
    schedule.py       the restored optimizer and LR schedule retargeted to allowed changes
    collectives.py    agreement between ranks on each step of a save or a check
    progress.py       progress.json: the furthest step and the steps redone, from signed records
    reader.py         reading a checkpoint root, trusting only what verifies
    manager.py        CheckpointManager: save and resume, on every rank together
"""

from fuseforge_flyte.training.checkpoint.compatibility import (ALLOWABLE_CHANGES, check_resume_settings,
                                                               parse_allowed_changes, run_settings, settings_verdict)
from fuseforge_flyte.training.checkpoint.errors import CheckpointError, CheckpointUserError, ResumeMismatch
from fuseforge_flyte.training.checkpoint.layout import MARKER, SKIPPED, checkpoint_name
from fuseforge_flyte.training.checkpoint.manager import CheckpointManager
from fuseforge_flyte.training.checkpoint.reader import CheckpointReader
from fuseforge_flyte.training.checkpoint.rng import rng_state, set_rng_state

__all__ = ["ALLOWABLE_CHANGES", "MARKER", "SKIPPED", "CheckpointError", "CheckpointManager", "CheckpointReader",
           "CheckpointUserError",
           "ResumeMismatch", "check_resume_settings", "checkpoint_name", "parse_allowed_changes", "rng_state",
           "run_settings", "set_rng_state", "settings_verdict"]
