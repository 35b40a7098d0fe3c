"""Whether a verified checkpoint may be resumed by this run: the same model and strategy, and the same run settings
unless ``TrainSpec.resume_allow_changes`` lists a difference.

The trainer state records the model config (minus volatile keys) and the run settings that shape the trajectory
(`run_settings`). Resuming with a different value stops the run, naming each differing field, unless
``resume_allow_changes`` lists it (e.g. "lr,steps" to continue training on a new schedule: schedule.py applies
them). A checkpoint beyond ``steps`` is an error. A verified checkpoint of another model, strategy or settings
stops the run at once (ResumeMismatch): falling back to an older one would silently throw progress away.
``check_resume_settings`` gives the same verdict in the launching process, before any worker starts.
"""

from __future__ import annotations

import json
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from fuseforge_flyte.training.checkpoint.errors import CheckpointError, ResumeMismatch
from fuseforge_flyte.training.checkpoint.reader import CheckpointReader, newest_verified

# Settings that shape the training trajectory; a resume must match them unless resume_allow_changes lists them.
ALLOWABLE_CHANGES = ("seed", "dataset", "seq_len", "global_batch", "lr", "weight_decay", "warmup_steps", "steps",
                     "grad_clip", "dtype", "model_config")
# model config keys that do not change what is trained (bookkeeping, output switches, dtype: see `dtype`)
_VOLATILE_CONFIG = frozenset({"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
                              "output_attentions", "output_hidden_states", "return_dict", "use_return_dict",
                              "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "torchscript",
                              "tf_legacy_loss", "is_encoder_decoder", "attn_implementation"})
_REFUSE = ("refusing to start fresh over it (or to resume a different run from it): use the original settings, "
           "or another checkpoint_dir")
_MISSING = "(not recorded)"
# Settings only a worker knows: the global batch (the planner may choose it) and the compute dtype (the device's).
_DECIDED_BY_WORKERS = ("global_batch", "dtype")


def run_settings(spec, data_manifest, *, samples_per_step: int, dtype: str) -> Dict:
    """What a resume must match (TrainSpec names; `global_batch` is samples per step; `dataset` the data's identity).

    `data_manifest` is the prepared data's DataManifest, or None for a benchmark dataset.
    """
    if data_manifest is not None:
        dataset = data_manifest.identity()
    else:
        from fuseforge_flyte.data.benchmark import resolve_benchmark

        dataset = {"benchmark": resolve_benchmark(spec.dataset) or spec.dataset}
    settings = {"seed": spec.seed, "dataset": dataset, "seq_len": spec.seq_len,
                "global_batch": samples_per_step, "lr": spec.lr, "weight_decay": spec.weight_decay,
                "warmup_steps": spec.warmup_steps, "steps": spec.steps, "grad_clip": spec.grad_clip,
                "dtype": dtype}
    if getattr(spec, "teacher", ""):  # only then: runs without a teacher resume checkpoints written before it existed
        settings["distillation"] = {"teacher": spec.teacher, "weight": spec.distill_weight,
                                    "beta": spec.distill_beta, "temperature": spec.distill_temperature}
    return jsonable(settings)


def parse_allowed_changes(value: str) -> FrozenSet[str]:
    """TrainSpec.resume_allow_changes ("lr,steps") as a set; unknown names are an error."""
    names = frozenset(part.strip() for part in (value or "").split(",") if part.strip())
    unknown = sorted(names - set(ALLOWABLE_CHANGES))
    if unknown:
        raise ValueError(f"TrainSpec.resume_allow_changes: unknown setting(s) {unknown}; "
                         f"choose from {list(ALLOWABLE_CHANGES)} (comma-separated)")
    return names


def model_config_for_resume(config: Dict) -> Dict:
    """A model config dict without the keys that do not change what is trained (recursively)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG and not str(k).startswith("_")}
        return value

    return jsonable(strip(config))


def jsonable(value: Any) -> Any:
    """The value as it reads back from JSON (tuples become lists, keys strings), so that comparisons are fair."""
    return json.loads(json.dumps(value, default=str))


def _flatten(value: Any, prefix: str) -> Dict[str, Any]:
    if isinstance(value, dict) and (value or not prefix):
        out: Dict[str, Any] = {}
        for key in sorted(value):
            out.update(_flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _differences(saved: Dict, current: Dict) -> List[Tuple[str, str]]:
    """[(top-level setting, "path: saved -> current")] for every leaf that differs."""
    old, new = _flatten(saved, ""), _flatten(current, "")
    diffs = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path, _MISSING), new.get(path, _MISSING)
        if a != b:
            diffs.append((path.split(".", 1)[0], f"{path}: {a!r} -> {b!r}"))
    return diffs


def settings_verdict(state: Dict, settings: Dict, allowed: FrozenSet[str], where: str,
                     extra: Sequence[Tuple[str, str]] = ()) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """(error, allowed differences) of a verified trainer state against this run's `settings` (run_settings'
    keys, or some of them); `extra` are further (setting, "path: old -> new") differences."""
    steps = settings.get("steps")
    if steps is not None and state["step"] > steps:
        return (f"checkpoint {where} is at step {state['step']}, beyond this run's steps={steps}: that run "
                f"already trained further. Use steps >= {state['step']} (steps > {state['step']} with "
                f"resume_allow_changes='steps' continues on the longer schedule), or another checkpoint_dir"), []
    diffs = (_differences(state.get("settings", {}), settings) if settings else []) + list(extra)
    blocked = [(name, line) for name, line in diffs if name not in allowed]
    if blocked:
        names = ",".join(sorted({name for name, _ in blocked}))
        return (f"checkpoint {where} was written by a run with different settings: "
                f"{'; '.join(line for _, line in blocked)}. Resuming would silently continue a different run. "
                f"To continue with the new values on purpose set resume_allow_changes='{names}' (any of "
                f"{', '.join(ALLOWABLE_CHANGES)}); otherwise use the original settings or another "
                f"checkpoint_dir"), []
    return None, diffs


def checkpoint_verdict(state: Dict, where: str, *, strategy: str, fingerprint: Dict[str, list], model_config: Dict,
                       settings: Dict, allowed: FrozenSet[str]) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """(error, allowed differences): a verified checkpoint of another model/strategy/settings is an error."""
    if state.get("strategy") != strategy:
        return (f"checkpoint {where} was written with strategy {state.get('strategy')!r}, this run uses "
                f"{strategy!r} (checkpoint formats differ per strategy); {_REFUSE}"), []
    mismatch = _fingerprint_mismatch(state.get("model_fingerprint", {}), fingerprint)
    if mismatch:
        return f"checkpoint {where} was written for a different model: {mismatch}; {_REFUSE}", []
    diffs = []
    if model_config:
        diffs = [("model_config", f"model_config.{line}")
                 for _, line in _differences(state.get("model_config", {}), model_config)]
    return settings_verdict(state, settings, allowed, where, extra=diffs)


def _fingerprint_mismatch(saved: Dict[str, list], current: Dict[str, list]) -> Optional[str]:
    for name, shape in current.items():
        if name not in saved:
            return f"parameter {name} missing"
        if list(saved[name]) != list(shape):
            return f"{name} has shape {list(saved[name])}, the model has {list(shape)}"
    extra = sorted(set(saved) - set(current))
    return f"unexpected parameter {extra[0]}" if extra else None


def check_resume_settings(spec) -> None:
    """In the launching process, before any worker starts: ResumeMismatch when the newest verified checkpoint of
    spec.checkpoint_location and spec.resume_location (the one a worker resumes) was written with other settings
    than `spec` asks for (those the spec alone decides; the message is the one a worker would give). Anything this
    cannot read or verify is left to the workers' resume, which also compares the model, the strategy and the
    settings only they know."""
    from fuseforge_flyte.data.shards import is_prepared_dir, read_manifest
    from fuseforge_flyte.data.benchmark import resolve_benchmark

    roots = [root for root in (spec.checkpoint_location, spec.resume_location) if root]
    if not roots:
        return
    if resolve_benchmark(spec.dataset) is not None:
        data_manifest = None
    elif is_prepared_dir(spec.dataset):
        data_manifest = read_manifest(spec.dataset)
    else:  # data the workers prepare themselves: its identity is theirs to compare
        return
    try:
        newest = newest_verified([CheckpointReader(root, allow_unsigned=spec.allow_unsigned_checkpoints,
                                                   log_it=False) for root in roots])
    except (CheckpointError, OSError, ValueError):
        return
    if newest is None:
        return
    reader, entry, state = newest
    settings = {k: v for k, v in run_settings(spec, data_manifest, samples_per_step=0, dtype="").items()
                if k not in _DECIDED_BY_WORKERS}
    state = dict(state, settings={k: v for k, v in state.get("settings", {}).items() if k not in _DECIDED_BY_WORKERS})
    error, _ = settings_verdict(state, settings, parse_allowed_changes(spec.resume_allow_changes),
                                reader.store.path(entry.name))
    if error:
        raise ResumeMismatch(error)
