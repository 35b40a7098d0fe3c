"""Flyte tasks: data preparation on a CPU pod (cached), elastic multi-GPU training, and the
with/without-kernels summary.

Data flows as: `fingerprint_data` (hashes what the dataset, tokenizer and model config hold) ->
`prepare_data` (cached on that fingerprint and the preparation options: tokenize, mask, pack, write
shards to a FlyteDirectory) -> `train_model` (reads only the shards; returns the metrics and the
trained model as a FlyteDirectory in Hugging Face format).

Registration-time config: the decorator arguments (image, GPUs, CPU, memory, /dev/shm, node selector,
tolerations, elastic nnodes/nproc_per_node/max_restarts) are read from platform.toml when this module
is imported, i.e. when `pyflyte run`/`pyflyte register` loads it. The resolved config also travels in
the task's environment (FUSEFORGE_RESOLVED_CONFIG), so the pod launches the workers exactly as registered.

Local runs (`pyflyte run` without --remote, or calling a workflow in Python) use one node and
[elastic].local_nproc_per_node workers (capped at the local GPU count); without CUDA they use gloo and
run the Triton kernels through the interpreter.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any, Dict, List, NamedTuple, Union

from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from fuseforge_flyte.comparison import Comparison, compare_metrics
from fuseforge_flyte.config import get_config
from fuseforge_flyte.console import ensure_console_logging
from fuseforge_flyte.fast_register import ship_whole_source_root
from fuseforge_flyte.inputs import DataFormat, spec_values, summary_only, training_inputs
from fuseforge_flyte.launch import (data_task_options, on_every_worker, summary_task_options,
                                    training_task_options)
from fuseforge_flyte.run_outputs import local_outputs_identity, returned_directory, task_output_dir
from fuseforge_flyte.sampling import Samples
from fuseforge_flyte.training import outputs
from fuseforge_flyte.training.spec import TrainMetrics, TrainSpec


def check_train_inputs(data: FlyteDirectory, **inputs: Any) -> None:
    """The run as the workers will see it, checked in the launching process: bad inputs, an unknown model,
    or data that does not fit the model fail once, before any worker (or GPU) starts."""
    spec = TrainSpec(dataset=data.path, **spec_values(inputs)).validate()
    from fuseforge_flyte.training.checkpoint import check_resume_settings
    from fuseforge_flyte.training.distill import check_teacher_fits
    from fuseforge_flyte.training.training_data import check_prepared_fits

    check_prepared_fits(spec)
    check_teacher_fits(spec)
    check_resume_settings(spec)


def fit_train_inputs(world_size: int, inputs: Dict[str, Any]) -> Dict[str, Any]:
    """The inputs with a batch_size that the prepared data fills on `world_size` workers (see fit_batch_to_data)."""
    from fuseforge_flyte.training.training_data import fit_batch_to_data

    data = inputs["data"]
    spec = TrainSpec(dataset=data.path, **spec_values({k: v for k, v in inputs.items() if k != "data"}))
    return dict(inputs, batch_size=fit_batch_to_data(spec, world_size))


# ------------------------------------------------------------------------------- tasks

CONFIG = get_config()
DEFAULTS = CONFIG.train_spec()


# A dataset is a hub id or URI (str), or local files that `pyflyte run --remote` uploads (FlyteFile/-Directory).
DataSource = Union[FlyteFile, FlyteDirectory, str]
# Bump when the prepared format, the preparation's results or where they are kept change: cached preparations are
# then redone (3: local outputs live in fuseforge's cache, not flytekit's temporary sandbox).
DATA_CACHE_VERSION = "3"


class TrainOutput(NamedTuple):
    metrics: TrainMetrics
    model: FlyteDirectory

    def __repr__(self) -> str:
        """The metrics' summary, which names where the model went (pyflyte prints outputs through repr)."""
        return str(self.metrics)

    __str__ = __repr__


def source_path(dataset: DataSource) -> str:
    """A local path (uploaded files downloaded) or the string as given (hub id, URI, builtin:, bench:)."""
    if isinstance(dataset, (FlyteFile, FlyteDirectory)):
        return dataset.download()
    return dataset


@task(**data_task_options(CONFIG))
def fingerprint_data(dataset: DataSource, eval_dataset: str, tokenizer: str, model: str) -> str:
    """A hash of what the sources hold (file bytes, object ETags), the key prepare_data is cached on."""
    from fuseforge_flyte.data.fingerprint import fingerprint

    if isinstance(dataset, (FlyteFile, FlyteDirectory)) and dataset.remote_source:
        dataset = dataset.remote_source  # uploaded: the store's own identity, no download
    key = fingerprint(source_path(dataset), eval_dataset, tokenizer, model)
    local = local_outputs_identity()  # locally the shards stay in fuseforge's cache: a removed one is a miss
    return f"{key}-{local}" if local else key


@task(**data_task_options(CONFIG), cache=True, cache_version=DATA_CACHE_VERSION, cache_ignore_input_vars=("dataset",))
def prepare_data(
    dataset: DataSource,
    fingerprint: str,
    model: str,
    tokenizer: str,
    data_format: DataFormat,
    dataset_config: str,
    dataset_split: str,
    seq_len: int,
    packing: bool,
    eval_fraction: float,
    eval_dataset: str,
    seed: int,
) -> FlyteDirectory:
    """Tokenize, mask and pack `dataset` into shards for `model` (cached on `fingerprint` and the options)."""
    from fuseforge_flyte.data.benchmark import BENCHMARK_DATASETS, write_benchmark_marker
    from fuseforge_flyte.data.prepare import prepare
    from fuseforge_flyte.data.spec import DataSpec

    out_dir = task_output_dir("data")
    source = source_path(dataset)
    if source in BENCHMARK_DATASETS:
        write_benchmark_marker(out_dir, source)
        return returned_directory(out_dir)
    spec = DataSpec(dataset=source, model=model, seq_len=seq_len, tokenizer=tokenizer, data_format=data_format.value,
                    dataset_config=dataset_config, dataset_split=dataset_split, eval_fraction=eval_fraction,
                    eval_dataset=eval_dataset, packing=packing, seed=seed).validate()
    ensure_console_logging()
    prepare(spec, out_dir)
    return returned_directory(out_dir)


def _train_on_worker(spec: TrainSpec) -> TrainOutput:
    """One elastic worker's training: the engine, with each save mirrored to the task's Flyte checkpoint."""
    try:
        # Imported only now, after the interpreter decision: the engine imports the Triton kernels.
        from fuseforge_flyte.training.engine import train
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"{exc}. If this runs on a cluster: `pyflyte run --remote` uploads only the modules it imported "
            "unless given `--copy all`, and that partial fuseforge_flyte hides the image's complete one; "
            "run `pyflyte run --remote --copy all ...`."
        ) from exc

    from flytekit.exceptions.user import FlyteRecoverableException

    from fuseforge_flyte import flyte_checkpoint
    from fuseforge_flyte.training.preemption import Preempted

    if not spec.output_dir:  # on a cluster: a scratch directory that flytekit uploads as the model
        spec = dataclasses.replace(spec, output_dir=tempfile.mkdtemp(prefix="fuseforge-model-"))
    try:
        # [tracking] as the task was registered with (in a pod, the config in its environment)
        metrics = train(spec, after_checkpoint=flyte_checkpoint.worker_hook(),
                        tracking_settings=get_config().tracking_settings())
    except Preempted as err:  # SIGTERM: checkpointed; Flyte retries the task and it resumes there
        raise FlyteRecoverableException(str(err)) from err
    return TrainOutput(metrics=metrics, model=returned_directory(outputs.model_dir(spec.output_dir)))


def run_training(spec: TrainSpec) -> TrainOutput:
    """One elastic worker, as every training task's (launch.on_every_worker): rank 0 adds the metrics Deck."""
    spec.validate()
    return on_every_worker(_train_on_worker)(spec)


@task(**training_task_options(CONFIG, check_inputs=check_train_inputs, fit_inputs=fit_train_inputs))
@training_inputs(DEFAULTS)
def train_model(data: FlyteDirectory, **settings: Any) -> TrainOutput:
    """Train a model on the prepared `data` with torch elastic on this task's GPUs; returns rank 0's
    throughput/memory/loss metrics and the trained model (Hugging Face format).

    :param data: shards written by prepare_data (or a benchmark marker)
    """
    return run_training(TrainSpec(dataset=data.path, **spec_values(settings)))


summary_only(train_model)


@task(**summary_task_options(CONFIG))
def sample_model(model: FlyteDirectory, prompts: List[str], max_new_tokens: int = 32) -> Samples:
    """Load a trained model directory with plain transformers and answer `prompts` (greedy): a smoke test
    of what `train` returned, shown in a Deck. Uses the tokenizer's chat template when it has one."""
    from fuseforge_flyte.sampling import generate, samples_html

    answers = generate(model.download(), prompts, max_new_tokens=max_new_tokens)
    Deck("Samples", samples_html(prompts, answers))
    return Samples(prompts=list(prompts), answers=answers)


@task(**summary_task_options(CONFIG))
def summarize_comparison(with_kernels: TrainMetrics, without_kernels: TrainMetrics) -> Comparison:
    """Throughput gain and memory reduction of the kernels, with a side-by-side Deck."""
    from fuseforge_flyte.decks import comparison_deck_html

    comparison = compare_metrics(with_kernels, without_kernels)
    Deck("Kernels vs no kernels", comparison_deck_html(comparison))
    return comparison


ship_whole_source_root()  # before `pyflyte run --remote` packs this checkout's code (see fast_register)
