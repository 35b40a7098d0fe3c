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

import contextlib
import dataclasses
import os
import sys
import tempfile
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Union

from flytekit import Deck, PodTemplate, Resources, task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.extend import TaskPlugins
from flytekit.extras.accelerators import GPUAccelerator
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile
from flytekitplugins.kfpytorch.task import Elastic, PytorchElasticFunctionTask
from kubernetes.client import V1PodSpec, V1Toleration

from fuseforge_flyte.comparison import Comparison, compare_metrics
from fuseforge_flyte.config import RESOLVED_CONFIG_ENV, PlatformConfig, get_config
from fuseforge_flyte.console import ensure_console_logging
from fuseforge_flyte.image import training_image
from fuseforge_flyte.training.distributed import SHARED_STORE_ENV
from fuseforge_flyte.training.spec import TrainMetrics, TrainSpec


@dataclasses.dataclass
class ElasticTraining(Elastic):
    """kfpytorch's Elastic, plus how many workers to start when the task runs locally."""

    local_nproc_per_node: int = 2
    # Checks the task inputs in the launching process, so bad input fails once, before any worker
    # starts (else every worker fails and torch elastic restarts the group max_restarts times).
    check_inputs: Optional[Callable[..., None]] = None


class ElasticTrainingTask(PytorchElasticFunctionTask):
    """Runs as registered on the cluster; locally, one node of `local_nproc_per_node` workers."""

    def execute(self, **kwargs: Any) -> Any:
        if "data" in kwargs:  # fetched once per pod, before the workers start; they read the local copy
            kwargs["data"] = FlyteDirectory(path=kwargs["data"].download())
        if self.task_config.check_inputs is not None:
            self.task_config.check_inputs(**kwargs)
        # A fresh rendezvous store per restart round, or restarted workers can read the dead round's
        # addresses (see fuseforge_flyte.training.distributed); pods also get it from `environment`.
        launch_env = {SHARED_STORE_ENV: "1"}
        with contextlib.ExitStack() as scope:
            state = FlyteContextManager.current_context().execution_state
            if state is not None and state.is_local_execution():
                scope.enter_context(self._as_one_local_node(launch_env))
            scope.enter_context(_environment(launch_env))
            return super().execute(**kwargs)

    @contextlib.contextmanager
    def _as_one_local_node(self, launch_env: Dict[str, str]) -> Iterator[None]:
        """Swap the registered nnodes/nproc_per_node for a local run's, and back."""
        import torch

        workers = self.task_config.local_nproc_per_node
        if torch.cuda.is_available():
            workers = min(workers, torch.cuda.device_count())
        else:
            launch_env["TRITON_INTERPRET"] = "1"  # inherited by the workers before they import any kernel
        registered = (self._task_config, self.min_nodes, self.max_nodes)
        self._task_config = dataclasses.replace(self.task_config, nnodes=1, nproc_per_node=workers)
        self.min_nodes = self.max_nodes = 1
        try:
            yield
        finally:
            self._task_config, self.min_nodes, self.max_nodes = registered


@contextlib.contextmanager
def _environment(values: Dict[str, str]) -> Iterator[None]:
    """Set the variables that are not set yet (an explicit user setting wins), then restore."""
    added = [name for name in values if name not in os.environ]
    os.environ.update({name: values[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


TaskPlugins.register_pythontask_plugin(ElasticTraining, ElasticTrainingTask)


def use_triton_interpreter_without_cuda() -> None:
    """TRITON_INTERPRET=1 when there is no GPU; it only works if set before any @triton.jit kernel is defined."""
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("TRITON_INTERPRET") != "1" and any(m.startswith("fuseforge.ops") for m in sys.modules):
        raise RuntimeError(
            "no CUDA device and fuseforge's Triton kernels were imported before TRITON_INTERPRET=1 was set; "
            "set TRITON_INTERPRET=1 in the environment before starting the run"
        )
    os.environ["TRITON_INTERPRET"] = "1"


# ------------------------------------------------------------------------------- decorator arguments


def elastic_config(config: PlatformConfig, check_inputs: Optional[Callable[..., None]] = None) -> ElasticTraining:
    e = config.elastic
    return ElasticTraining(
        nnodes=e.nnodes,
        nproc_per_node=e.nproc_per_node,
        local_nproc_per_node=e.local_nproc_per_node,
        start_method=e.start_method,
        monitor_interval=e.monitor_interval,
        max_restarts=e.max_restarts,
        rdzv_configs={
            "timeout": e.rdzv_timeout,
            "join_timeout": e.rdzv_join_timeout,
            "read_timeout": e.rdzv_read_timeout,
        },
        increase_shared_mem=False,  # /dev/shm comes from @task(shared_memory=...) below
        check_inputs=check_inputs,
    )


def check_train_inputs(data: FlyteDirectory, **inputs: Any) -> None:
    """The run as the workers will see it, checked in the launching process: bad inputs, an unknown model,
    or data that does not fit the model fail once, before any worker (or GPU) starts."""
    spec = TrainSpec(dataset=data.path, **inputs).validate()
    from fuseforge_flyte.training.data import check_prepared_fits

    check_prepared_fits(spec)


def pod_template(config: PlatformConfig) -> Optional[PodTemplate]:
    """Node selector and tolerations for the training pods (None when there are none)."""
    cluster = config.cluster
    if not cluster.node_selector and not cluster.tolerations:
        return None
    tolerations = [
        V1Toleration(
            key=t.key or None,
            operator=t.operator,
            value=t.value or None,
            effect=t.effect or None,
            toleration_seconds=t.toleration_seconds,
        )
        for t in cluster.tolerations
    ]
    spec = V1PodSpec(containers=[], node_selector=dict(cluster.node_selector) or None, tolerations=tolerations or None)
    return PodTemplate(pod_spec=spec)


def training_task_options(config: PlatformConfig, check_inputs: Optional[Callable[..., None]] = None) -> Dict[str, Any]:
    """Keyword arguments of @task for the training task, all from platform.toml (check_inputs: see ElasticTraining)."""
    cluster = config.cluster
    # Strings: the kubernetes client behind pod templates rejects integer quantities.
    gpu = {"gpu": str(cluster.gpus)} if cluster.gpus > 0 else {}
    options: Dict[str, Any] = dict(
        task_config=elastic_config(config, check_inputs),
        container_image=training_image(config),
        requests=Resources(cpu=cluster.cpu, mem=cluster.memory, **gpu),
        limits=Resources(mem=cluster.memory, **gpu),
        environment={RESOLVED_CONFIG_ENV: config.to_json(), SHARED_STORE_ENV: "1"},
        retries=config.flyte.retries,
        enable_deck=True,
        deck_fields=(),  # only our metrics Deck: the console opens on it, not on flytekit's Timeline
    )
    if cluster.accelerator:
        options["accelerator"] = GPUAccelerator(cluster.accelerator)
    if cluster.shared_memory:
        options["shared_memory"] = cluster.shared_memory
    template = pod_template(config)
    if template is not None:
        options["pod_template"] = template
    if cluster.pod_template_name:
        options["pod_template_name"] = cluster.pod_template_name
    return options


def data_task_options(config: PlatformConfig) -> Dict[str, Any]:
    """Data preparation runs on a CPU pod of [data]'s size, in the training image."""
    return dict(
        container_image=training_image(config),
        requests=Resources(cpu=config.data.cpu, mem=config.data.memory),
        limits=Resources(mem=config.data.memory),
        environment={RESOLVED_CONFIG_ENV: config.to_json()},
        retries=config.flyte.retries,
    )


def summary_task_options(config: PlatformConfig) -> Dict[str, Any]:
    """The comparison summary is light: same image, a small pod, no GPU."""
    return dict(
        container_image=training_image(config),
        requests=Resources(cpu="1", mem="2Gi"),
        limits=Resources(mem="2Gi"),
        environment={RESOLVED_CONFIG_ENV: config.to_json()},
        enable_deck=True,
        deck_fields=(),  # only our metrics Deck: the console opens on it, not on flytekit's Timeline
    )


# ------------------------------------------------------------------------------- tasks

CONFIG = get_config()
DEFAULTS = CONFIG.train_spec()


# A dataset is a hub id or URI (str), or local files that `pyflyte run --remote` uploads (FlyteFile/-Directory).
DataSource = Union[FlyteFile, FlyteDirectory, str]
# Bump when the prepared format or the preparation's results change: cached preparations are then redone.
DATA_CACHE_VERSION = "1"


class TrainOutput(NamedTuple):
    metrics: TrainMetrics
    model: FlyteDirectory


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
    return fingerprint(source_path(dataset), eval_dataset, tokenizer, model)


@task(**data_task_options(CONFIG), cache=True, cache_version=DATA_CACHE_VERSION, cache_ignore_input_vars=("dataset",))
def prepare_data(
    dataset: DataSource,
    fingerprint: str,
    model: str,
    tokenizer: str,
    data_format: str,
    dataset_config: str,
    dataset_split: str,
    seq_len: int,
    packing: bool,
    eval_fraction: float,
    eval_dataset: str,
    seed: int,
) -> FlyteDirectory:
    """Tokenize, mask and pack `dataset` into shards for `model` (cached on `fingerprint` and the options)."""
    from fuseforge_flyte.data.prepare import prepare
    from fuseforge_flyte.data.spec import DataSpec
    from fuseforge_flyte.training.data import BENCHMARK_DATASETS, write_benchmark_marker

    out_dir = tempfile.mkdtemp(prefix="fuseforge-data-")
    source = source_path(dataset)
    if source in BENCHMARK_DATASETS:
        write_benchmark_marker(out_dir, source)
        return FlyteDirectory(path=out_dir)
    spec = DataSpec(dataset=source, model=model, seq_len=seq_len, tokenizer=tokenizer, data_format=data_format,
                    dataset_config=dataset_config, dataset_split=dataset_split, eval_fraction=eval_fraction,
                    eval_dataset=eval_dataset, packing=packing, seed=seed).validate()
    ensure_console_logging()
    prepare(spec, out_dir)
    return FlyteDirectory(path=out_dir)


def run_training(spec: TrainSpec) -> TrainOutput:
    """One elastic worker: train, and on global rank 0 add the metrics Deck (only rank 0's comes back)."""
    spec.validate()
    use_triton_interpreter_without_cuda()
    try:
        # Imported only now, after the interpreter decision: the engine imports the Triton kernels.
        from fuseforge_flyte.decks import training_deck_html
        from fuseforge_flyte.training.engine import train
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"{exc}. If this runs on a cluster: `pyflyte run --remote` uploads only the modules it imported "
            "unless given `--copy all`, and that partial fuseforge_flyte hides the image's complete one; "
            "run `pyflyte run --remote --copy all ...`."
        ) from exc

    from flytekit.exceptions.user import FlyteRecoverableException

    from fuseforge_flyte.training.preemption import Preempted

    try:
        metrics = train(spec)
    except Preempted as err:  # SIGTERM: checkpointed; Flyte retries the task and it resumes there
        raise FlyteRecoverableException(str(err)) from err
    if int(os.environ.get("RANK", "0")) == 0:
        Deck("Training metrics", training_deck_html(metrics))
    return TrainOutput(metrics=metrics, model=FlyteDirectory(path=spec.output_dir))


@task(**training_task_options(CONFIG, check_inputs=check_train_inputs))
def train_model(
    data: FlyteDirectory,
    model: str = DEFAULTS.model,
    eval_every: int = DEFAULTS.eval_every,
    steps: int = DEFAULTS.steps,
    batch_size: int = DEFAULTS.batch_size,
    seq_len: int = DEFAULTS.seq_len,
    grad_accum: int = DEFAULTS.grad_accum,
    lr: float = DEFAULTS.lr,
    weight_decay: float = DEFAULTS.weight_decay,
    warmup_steps: int = DEFAULTS.warmup_steps,
    grad_clip: float = DEFAULTS.grad_clip,
    kernels: bool = DEFAULTS.kernels,
    loss_chunk_size: int = DEFAULTS.loss_chunk_size,
    strategy: str = DEFAULTS.strategy,
    zero_stage: int = DEFAULTS.zero_stage,
    offload: bool = DEFAULTS.offload,
    dtype: str = DEFAULTS.dtype,
    gradient_checkpointing: bool = DEFAULTS.gradient_checkpointing,
    seed: int = DEFAULTS.seed,
    checkpoint_dir: Optional[str] = DEFAULTS.checkpoint_dir,
    checkpoint_every: int = DEFAULTS.checkpoint_every,
    keep_last: int = DEFAULTS.keep_last,
    resume_allow_changes: str = DEFAULTS.resume_allow_changes,
    nonfinite_policy: str = DEFAULTS.nonfinite_policy,
    log_every: int = DEFAULTS.log_every,
) -> TrainOutput:
    """Train `model` on the prepared `data` with torch elastic on this task's GPUs; returns rank 0's
    throughput/memory/loss metrics and the trained model (Hugging Face format)."""
    return run_training(
        TrainSpec(
            dataset=data.path,
            model=model,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            grad_accum=grad_accum,
            lr=lr,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            grad_clip=grad_clip,
            kernels=kernels,
            loss_chunk_size=loss_chunk_size,
            strategy=strategy,
            zero_stage=zero_stage,
            offload=offload,
            dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
            seed=seed,
            eval_every=eval_every,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            keep_last=keep_last,
            resume_allow_changes=resume_allow_changes,
            nonfinite_policy=nonfinite_policy,
            log_every=log_every,
            output_dir=tempfile.mkdtemp(prefix="fuseforge-model-"),
        )
    )


@task(**summary_task_options(CONFIG))
def sample_model(model: FlyteDirectory, prompts: List[str], max_new_tokens: int = 32) -> List[str]:
    """Load a trained model directory with plain transformers and answer `prompts` (greedy): a smoke test
    of what `train` returned, shown in a Deck. Uses the tokenizer's chat template when it has one."""
    from fuseforge_flyte.sampling import generate, samples_html

    answers = generate(model.download(), prompts, max_new_tokens=max_new_tokens)
    Deck("Samples", samples_html(prompts, answers))
    return answers


@task(**summary_task_options(CONFIG))
def summarize_comparison(with_kernels: TrainMetrics, without_kernels: TrainMetrics) -> Comparison:
    """Throughput gain and memory reduction of the kernels, with a side-by-side Deck."""
    from fuseforge_flyte.decks import comparison_deck_html

    comparison = compare_metrics(with_kernels, without_kernels)
    Deck("Kernels vs no kernels", comparison_deck_html(comparison))
    return comparison
