"""Flyte tasks of the `dpo` workflow: preference data (CPU, cached), reference log-probs (one GPU, cached),
the policy (elastic, all of the task's GPUs).

The reference task is cached on the prepared data (itself cached on the dataset's fingerprint), the reference
model, the tokenizer, max_length and the seed: it runs once per dataset and reference model, and every DPO run
on them afterwards (another beta, learning rate, loss type) reuses its output, so the policy's pods never hold
the reference model. Bump REFERENCE_CACHE_VERSION when scoring changes.
"""

from __future__ import annotations

import enum
import os
import tempfile
from typing import NamedTuple

from flytekit import Cache, Deck, task
from flytekit.types.directory import FlyteDirectory

from fuseforge_flyte import run_outputs
from fuseforge_flyte.launch import data_task_options
from fuseforge_flyte.inputs import spec_values
from fuseforge_flyte.tasks import CONFIG, DataSource, source_path
from fuseforge_flyte.training import outputs
from fuseforge_flyte.training.dpo import LOSS_TYPES, DPOSettings, PreferenceMetrics
from fuseforge_flyte.training.spec import TrainMetrics
from fuseforge_flyte.user_task import training_task

PREFERENCE_CACHE_VERSION = "2"
REFERENCE_CACHE_VERSION = "2"

DPOLossType = enum.Enum("DPOLossType", {value.upper(): value for value in LOSS_TYPES}, module=__name__)
DPOLossType.__doc__ = "TRL's DPO loss types (sigmoid, hinge, ipo and robust run on fuseforge's fused DPO loss)."


class DPOOutput(NamedTuple):
    metrics: TrainMetrics
    preference: PreferenceMetrics
    model: FlyteDirectory


@task(**data_task_options(CONFIG), cache=True, cache_version=PREFERENCE_CACHE_VERSION,
      cache_ignore_input_vars=("dataset",))
def prepare_preference_data(dataset: DataSource, fingerprint: str, dataset_config: str, dataset_split: str,
                            eval_fraction: float, seed: int) -> FlyteDirectory:
    """Check every prompt/chosen/rejected row and save the pairs (cached on the dataset's fingerprint)."""
    from fuseforge_flyte.data.preferences import prepare_preferences

    out_dir = run_outputs.task_output_dir("preferences")
    prepare_preferences(source_path(dataset), out_dir, config=dataset_config, split=dataset_split,
                        eval_fraction=eval_fraction, seed=seed)
    return run_outputs.returned_directory(out_dir)


def _check_dpo_inputs(**inputs) -> None:
    """Bad settings fail once in the launching process, before any worker (or GPU) starts."""
    from fuseforge_flyte.model_names import is_known_model, unknown_model_message

    settings = _settings(inputs)
    for name in {settings.model, settings.reference}:
        if not is_known_model(name):
            raise ValueError(unknown_model_message(name))


def _settings(inputs: dict) -> DPOSettings:
    names = DPOSettings.__dataclass_fields__
    return DPOSettings(**{k: v for k, v in spec_values(inputs).items() if k in names}).validate()


# Scoring needs no data parallelism: one worker on one GPU (locally too).
@training_task(gpus=1, nproc_per_node=1, local_nproc_per_node=1, max_restarts=0, check_inputs=_check_dpo_inputs,
               cache=Cache(version=REFERENCE_CACHE_VERSION))
def reference_logps(data: FlyteDirectory, model: str, reference_model: str, tokenizer: str, max_length: int,
                    batch_size: int, seed: int, kernels: bool) -> FlyteDirectory:
    """Tokenize the pairs (chat template applied) and score them with the reference model (cached)."""
    from fuseforge_flyte.training.dpo import score_reference

    settings = DPOSettings(model=model, reference_model=reference_model, tokenizer=tokenizer, max_length=max_length,
                           batch_size=batch_size, seed=seed, kernels=kernels)
    out_dir = run_outputs.task_output_dir("reference")  # cached: locally it must outlive this run
    summary = score_reference(settings, data.path, out_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        from fuseforge_flyte.decks import table_html

        Deck("Reference log-probs", table_html(["", "value"], [[k, v] for k, v in summary.items()]))
    return run_outputs.returned_directory(out_dir)


@training_task(check_inputs=_check_dpo_inputs)
def dpo_train(data: FlyteDirectory, model: str, reference_model: str, tokenizer: str, beta: float,
              loss_type: DPOLossType,
              label_smoothing: float, max_length: int, steps: int, batch_size: int, grad_accum: int, lr: float,
              warmup_steps: int, eval_every: int, seed: int, kernels: bool, loss_chunk_size: int,
              lora: bool = False, lora_rank: int = 16, lora_alpha: float = 32.0, lora_dropout: float = 0.0,
              lora_target_modules: str = "", qlora: bool = False, output_dir: str = "") -> DPOOutput:
    """Train the policy with TRL's DPOTrainer on the scored pairs (fused DPO loss with kernels on; LoRA adapters
    with lora/qlora, whose reference is the scored base model)."""
    from fuseforge_flyte.measure import FuseforgeMetricsCallback
    from fuseforge_flyte.training.dpo import train_dpo

    settings = _settings(dict(locals()))
    output_dir = output_dir or tempfile.mkdtemp(prefix="fuseforge-dpo-")  # "" reaches a worker on a cluster only
    meter = FuseforgeMetricsCallback(dataset="preferences", model_name=settings.model)
    preference = train_dpo(settings, data.path, outputs.model_dir(output_dir), callbacks=[meter])
    metrics = meter.metrics()
    metrics.output_dir = output_dir if run_outputs.is_local_run() else ""
    if int(os.environ.get("RANK", "0")) == 0:
        from fuseforge_flyte.posttrain.decks import preference_deck_html

        outputs.write_run_record(output_dir, metrics, settings)
        Deck("Preference metrics", preference_deck_html(preference))
    return DPOOutput(metrics=metrics, preference=preference,
                     model=run_outputs.returned_directory(outputs.model_dir(output_dir)))
