"""How fuseforge's GPU tasks launch: the elastic task type (local runs as one node of a few workers,
inputs checked once before any worker starts) and the @task arguments that platform.toml decides
(image, resources, /dev/shm, placement, elastic settings). Shared by the built-in tasks and the
own-code task decorator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import sys
from typing import Any, Callable, Dict, Optional

from flytekit import Deck, PodTemplate, Resources
from flytekit.core.context_manager import FlyteContextManager
from flytekit.extend import TaskPlugins
from flytekit.extras.accelerators import GPUAccelerator
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile
from flytekitplugins.kfpytorch.task import Elastic, PytorchElasticFunctionTask
from kubernetes.client import V1PodSpec, V1Toleration

from fuseforge_flyte import flyte_checkpoint, quiet, run_outputs
from fuseforge_flyte.config import RESOLVED_CONFIG_ENV, PlatformConfig
from fuseforge_flyte.environ import environment
from fuseforge_flyte.image.spec import training_image
from fuseforge_flyte.object_store import share_flyte_s3_settings
from fuseforge_flyte.training import outputs, permanent
from fuseforge_flyte.training.distributed import SHARED_STORE_ENV
from fuseforge_flyte.training.spec import CHECKPOINT_OFF, TrainMetrics

# Task pods (and the training workers they start) read datasets and models from Flyte's object store.
share_flyte_s3_settings()

log = logging.getLogger("fuseforge.training")


@dataclasses.dataclass
class ElasticTraining(Elastic):
    """kfpytorch's Elastic, plus how many workers to start when the task runs locally."""

    local_nproc_per_node: int = 2
    # Checks the task inputs in the launching process, so bad input fails once, before any worker
    # starts (else every worker fails and torch elastic restarts the group max_restarts times).
    check_inputs: Optional[Callable[..., None]] = None
    # fit_inputs(world_size, inputs) -> the inputs to launch with: settings adapted to the number of workers
    # (e.g. a batch that the data can fill), decided once in the launching process.
    fit_inputs: Optional[Callable[[int, Dict[str, Any]], Dict[str, Any]]] = None


class ElasticTrainingTask(PytorchElasticFunctionTask):
    """Runs as registered on the cluster; locally, one node of `local_nproc_per_node` workers.

    A str input named `checkpoint_dir` left empty gets, on a cluster, a local directory that holds the
    previous attempt's checkpoints and is mirrored to the task's own Flyte checkpoint (see flyte_checkpoint).
    A str input named `output_dir` left empty gets, locally, a new ./outputs/<model>-<UTC time> (training/outputs.py).
    """

    checkpoint_input = "checkpoint_dir"
    output_input = "output_dir"

    def execute(self, **kwargs: Any) -> Any:
        for name, value in kwargs.items():  # fetched once per pod, not once per worker racing on one path
            if isinstance(value, (FlyteFile, FlyteDirectory)):
                kwargs[name] = type(value)(path=value.download())
        if self.task_config.check_inputs is not None:
            self.task_config.check_inputs(**kwargs)
        # A fresh rendezvous store per restart round, or restarted workers can read the dead round's
        # addresses (see fuseforge_flyte.training.distributed); pods also get it from `environment`.
        launch_env = {SHARED_STORE_ENV: "1"}
        launcher: Any = super()
        temp_root: Any = contextlib.nullcontext()
        state = FlyteContextManager.current_context().execution_state
        local = state is not None and state.is_local_execution()
        if local:
            launcher = self._one_local_node(launch_env)
        if self.task_config.fit_inputs is not None:
            launched = (launcher if local else self).task_config
            kwargs = self.task_config.fit_inputs(self._world_size(launched), dict(kwargs))
        if local:
            launch_env[run_outputs.LOCAL_RUN_ENV] = "1"
            run_outputs.remove_temp_dirs_at_exit()
            temp_root = run_outputs.private_temp_dir()
            if kwargs.get(self.output_input) == "":
                kwargs[self.output_input] = outputs.new_output_dir("", str(kwargs.get("model") or "run"))
        elif kwargs.get(self.checkpoint_input) == "":
            kwargs[self.checkpoint_input] = self._default_checkpoint_dir(launch_env) or CHECKPOINT_OFF
        # an explicit user setting wins over the launch's own
        # locally, the agent's copy of a worker's traceback goes to a log file (quiet.py): the failure is raised below
        agent_log = quiet.worker_failures_to_log_file() if local else contextlib.nullcontext()
        with temp_root, environment(launch_env, override=False), permanent.failure_directory(), agent_log:
            result = launcher.execute(**kwargs)
        permanent.raise_if_failed(result)  # a failure that restarts cannot fix: raised once, not retried
        return result

    @staticmethod
    def _world_size(config: Elastic) -> int:
        """Workers of a launch: nodes (the most an elastic range allows) x processes per node."""
        nodes = int(str(config.nnodes).split(":")[-1])
        return nodes * int(config.nproc_per_node)

    def _default_checkpoint_dir(self, launch_env: Dict[str, str]) -> Optional[str]:
        import flytekit

        try:
            checkpoint = flytekit.current_context().checkpoint
        except (NotImplementedError, AttributeError):
            log.warning("checkpoint_dir is empty and Flyte gave this task no checkpoint location: nothing is "
                        "checkpointed; set checkpoint_dir to keep progress across retries")
            return None
        return flyte_checkpoint.restore_previous(checkpoint, nnodes=self.max_nodes, launch_env=launch_env)

    def _one_local_node(self, launch_env: Dict[str, str]) -> PytorchElasticFunctionTask:
        """This task as one node of `local_nproc_per_node` workers: a separate plain elastic task of the same
        function, so the registered one is never changed (kfpytorch reads the launch settings from its config)."""
        import torch

        workers = self.task_config.local_nproc_per_node
        if torch.cuda.is_available():
            workers = min(workers, torch.cuda.device_count())
        else:
            launch_env["TRITON_INTERPRET"] = "1"  # inherited by the workers before they import any kernel
        local = dataclasses.replace(self.task_config, nnodes=1, nproc_per_node=workers)
        return PytorchElasticFunctionTask(task_config=local, task_function=self.task_function)


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


def _returned_metrics(result: Any) -> Optional[TrainMetrics]:
    if isinstance(result, TrainMetrics):
        return result
    if isinstance(result, tuple):
        return next((r for r in result if isinstance(r, TrainMetrics)), None)
    return None


def on_every_worker(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn as each worker of a training task runs it (the built-in one and @training_task's): Triton's
    interpreter decision first; an error no restart can fix ends the launch (see training/permanent.py);
    rank 0 adds the "Training metrics" Deck when fn returns a TrainMetrics (alone or in a tuple)."""

    @functools.wraps(fn)  # Flyte names, types and resolves the task by the user's function
    def run_on_worker(*args: Any, **kwargs: Any) -> Any:
        use_triton_interpreter_without_cuda()
        result = permanent.run_worker(lambda: fn(*args, **kwargs), int(os.environ.get("RANK", "0")))
        if isinstance(result, permanent.FailedPermanently):
            return result
        metrics = _returned_metrics(result)
        if metrics is not None and int(os.environ.get("RANK", "0")) == 0:
            from fuseforge_flyte.decks import training_deck_html

            Deck("Training metrics", training_deck_html(metrics))
        return result

    return run_on_worker


# ------------------------------------------------------------------------------- decorator arguments


def elastic_config(config: PlatformConfig, check_inputs: Optional[Callable[..., None]] = None,
                   fit_inputs: Optional[Callable[[int, Dict[str, Any]], Dict[str, Any]]] = None) -> ElasticTraining:
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
        fit_inputs=fit_inputs,
    )


# Pod annotation: the digest of the platform.toml a task was registered with.
CONFIG_ANNOTATION = "fuseforge.dev/platform-config-sha256"


def config_digest(config: PlatformConfig) -> str:
    return hashlib.sha256(config.to_json().encode()).hexdigest()[:16]


def pod_template(config: PlatformConfig, *, placement: bool = True) -> PodTemplate:
    """The pod settings of a task: the training pods' node selector and tolerations (placement), and on every
    pod the digest of its platform.toml. flytekit versions `pyflyte run --remote` registrations by code,
    images and pod templates: with the digest here, a changed platform.toml (resources, settings) gets a new
    version instead of "task with different structure already exists"."""
    cluster = config.cluster
    tolerations = [
        V1Toleration(
            key=t.key or None,
            operator=t.operator,
            value=t.value or None,
            effect=t.effect or None,
            toleration_seconds=t.toleration_seconds,
        )
        for t in (cluster.tolerations if placement else ())
    ]
    node_selector = dict(cluster.node_selector) if placement else {}
    spec = V1PodSpec(containers=[], node_selector=node_selector or None, tolerations=tolerations or None)
    return PodTemplate(pod_spec=spec, annotations={CONFIG_ANNOTATION: config_digest(config)})


def training_task_options(config: PlatformConfig, check_inputs: Optional[Callable[..., None]] = None,
                          fit_inputs: Optional[Callable[[int, Dict[str, Any]], Dict[str, Any]]] = None
                          ) -> Dict[str, Any]:
    """Keyword arguments of @task for the training task, all from platform.toml (check_inputs, fit_inputs: see
    ElasticTraining)."""
    cluster = config.cluster
    # Strings: the kubernetes client behind pod templates rejects integer quantities.
    gpu = {"gpu": str(cluster.gpus)} if cluster.gpus > 0 else {}
    options: Dict[str, Any] = dict(
        task_config=elastic_config(config, check_inputs, fit_inputs),
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
    options["pod_template"] = pod_template(config)
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
        pod_template=pod_template(config, placement=False),
    )


def summary_task_options(config: PlatformConfig) -> Dict[str, Any]:
    """The comparison summary is light: same image, a small pod, no GPU."""
    return dict(
        container_image=training_image(config),
        requests=Resources(cpu="1", mem="2Gi"),
        limits=Resources(mem="2Gi"),
        environment={RESOLVED_CONFIG_ENV: config.to_json()},
        pod_template=pod_template(config, placement=False),
        enable_deck=True,
        deck_fields=(),  # only our metrics Deck: the console opens on it, not on flytekit's Timeline
    )
