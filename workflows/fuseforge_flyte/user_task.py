"""`@training_task`: your own training function as an elastic multi-GPU Flyte task, set up by platform.toml.

    from fuseforge_flyte import training_task
    from fuseforge_flyte.measure import FuseforgeMetricsCallback
    
    @training_task                        # image, GPUs, CPU, memory, /dev/shm, placement, elastic: platform.toml
    def sft(model: str, steps: int) -> TrainMetrics:
        ...                               # runs on every worker (one per GPU): Trainer, TRL or a plain loop
        return callback.metrics()         # rank 0's return value is the task's output

    @training_task(gpus=4, nnodes=2, memory="400Gi", max_restarts=1)   # per-task overrides
    def big_sft(...) -> TrainMetrics: ...

What the decorator does:

- Registration (import time, i.e. `pyflyte run/register` loading your file): the @task arguments the
  built-in training task gets (fuseforge_flyte.launch.training_task_options) from platform.toml with this
  task's overrides applied first. Every override is validated as platform.toml's key would be, and a bad
  one raises here, naming the argument, before anything is registered or any worker starts. The
  resolved config travels in the task's environment, so the pod launches the workers as registered.
  nnodes > 1 registers a Kubeflow PyTorchJob; nnodes = 1 a plain pod.
- Every worker: Triton's interpreter when there is no CUDA device (as the built-in task), then your
  function. If it returns a TrainMetrics (alone, or inside a tuple / NamedTuple), rank 0 adds the same
  "Training metrics" Deck as the built-in `train` workflow. Measure with fuseforge_flyte.measure.
- Before the workers start (once per pod): FlyteFile / FlyteDirectory inputs are fetched, so every
  worker reads the same local copy; check_inputs(**inputs), if given, fails bad inputs once.
- Local runs (`pyflyte run file.py wf`, or calling the workflow in Python): one node of
  [elastic].local_nproc_per_node workers (capped at the local GPUs; gloo and the interpreter on a CPU).
  Import fuseforge's kernels inside the function, as the examples do: on a CPU with start_method =
  "fork", a module-level import would define them before Triton's interpreter is switched on.

Files outside an installed package: with the default "spawn" start method every worker imports your
file's module again. The task puts the directory that makes it importable (the one `pyflyte run` found)
on the workers' path, so `pyflyte run path/to/file.py wf` works as written; on the cluster,
`pyflyte run --remote` ships the file and the pod imports it from its working directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence

from flytekit import task
from flytekit.extend import TaskPlugins
from flytekit.image_spec import ImageSpec

from fuseforge_flyte.config import PlatformConfig, Toleration, config_from_dict, get_config
from fuseforge_flyte.environ import environment
from fuseforge_flyte.launch import ElasticTraining, ElasticTrainingTask, on_every_worker, training_task_options

# decorator argument -> (platform.toml section, key); validated by the config's own rules
CONFIG_ARGUMENTS: Dict[str, tuple] = {
    "gpus": ("cluster", "gpus"),
    "accelerator": ("cluster", "accelerator"),
    "cpu": ("cluster", "cpu"),
    "memory": ("cluster", "memory"),
    "shared_memory": ("cluster", "shared_memory"),
    "node_selector": ("cluster", "node_selector"),
    "tolerations": ("cluster", "tolerations"),
    "pod_template_name": ("cluster", "pod_template_name"),
    "nnodes": ("elastic", "nnodes"),
    "nproc_per_node": ("elastic", "nproc_per_node"),
    "local_nproc_per_node": ("elastic", "local_nproc_per_node"),
    "max_restarts": ("elastic", "max_restarts"),
    "start_method": ("elastic", "start_method"),
    "monitor_interval": ("elastic", "monitor_interval"),
    "rdzv_timeout": ("elastic", "rdzv_timeout"),
    "rdzv_join_timeout": ("elastic", "rdzv_join_timeout"),
    "rdzv_read_timeout": ("elastic", "rdzv_read_timeout"),
    "retries": ("flyte", "retries"),
}
# @task arguments the decorator sets itself, and which of its own arguments to use instead
MANAGED_TASK_ARGUMENTS = {
    "task_config": "nnodes=, nproc_per_node=, max_restarts=, start_method=, ...",
    "requests": "gpus=, cpu=, memory=",
    "limits": "gpus=, memory=",
    "resources": "gpus=, cpu=, memory=",
    "container_image": "image=",
    "pod_template": "node_selector=, tolerations= or pod_template_name=",
}
# other @task arguments (cache, timeout, interruptible, secret_requests, ...) pass through unchanged
PASSTHROUGH_TASK_ARGUMENTS = frozenset(inspect.signature(task).parameters) - {
    "_task_function", "kwargs", "environment", *MANAGED_TASK_ARGUMENTS, *CONFIG_ARGUMENTS}


@dataclasses.dataclass
class UserTraining(ElasticTraining):
    """ElasticTraining for a user's function: the task type below also makes loose files importable."""


class UserTrainingTask(ElasticTrainingTask):
    """ElasticTrainingTask whose workers can import the module of a function defined outside a package."""

    def execute(self, **kwargs: Any) -> Any:
        with _importable(self.task_function.__module__):
            return super().execute(**kwargs)


TaskPlugins.register_pythontask_plugin(UserTraining, UserTrainingTask)


@contextlib.contextmanager
def _importable(module_name: str) -> Iterator[None]:
    """The module's import root on sys.path (spawned workers copy it) and PYTHONPATH (their own children)."""
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if module is None or not file or module_name == "__main__":
        yield
        return
    path = Path(file).resolve()
    depth = module_name.count(".") + (1 if path.name == "__init__.py" else 0)
    root = str(path.parents[depth])
    if root in sys.path:
        yield
        return
    saved_path, inherited = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path.insert(0, root)
    try:
        with environment({"PYTHONPATH": os.pathsep.join([root] + ([inherited] if inherited else []))}):
            yield
    finally:
        sys.path[:] = saved_path


# ------------------------------------------------------------------------------------------ arguments


def _plain(arg: str, value: Any) -> Any:
    """A decorator argument as platform.toml would hold it (tolerations as tables)."""
    if arg == "tolerations" and isinstance(value, (list, tuple)):
        return [t.model_dump(exclude_none=True) if isinstance(t, Toleration) else t for t in value]
    return value


def resolve_config(base: PlatformConfig, overrides: Mapping[str, Any]) -> PlatformConfig:
    """`base` with the decorator's overrides applied and validated; errors name the argument."""
    if not overrides:
        return base
    data = base.to_dict()
    sources = {}
    for arg, value in overrides.items():
        section, key = CONFIG_ARGUMENTS[arg]
        data[section][key] = _plain(arg, value)
        sources[f"[{section}].{key}"] = f"@training_task({arg}={value!r})"
    # nproc_per_node that followed [cluster].gpus keeps following it (0 = one worker per GPU)
    if "gpus" in overrides and "nproc_per_node" not in overrides and \
            base.elastic.nproc_per_node == max(base.cluster.gpus, 1):
        data["elastic"]["nproc_per_node"] = 0
    return config_from_dict(data, base.source, sources)


def _check_arguments(image: Any, environment: Any, check_inputs: Any, config: Any,
                     task_arguments: Mapping[str, Any]) -> None:
    for name in task_arguments:
        if name in MANAGED_TASK_ARGUMENTS:
            raise TypeError(f"@training_task sets {name}= itself from platform.toml; use "
                            f"{MANAGED_TASK_ARGUMENTS[name]} instead")
        if name not in PASSTHROUGH_TASK_ARGUMENTS:
            known = sorted(set(CONFIG_ARGUMENTS) | PASSTHROUGH_TASK_ARGUMENTS | {"image", "environment", "config",
                                                                                 "check_inputs"})
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
            raise TypeError(f"@training_task got an unexpected keyword argument {name!r}{hint}")
    if image is not None and not (isinstance(image, ImageSpec) or (isinstance(image, str) and image.strip())):
        raise TypeError(f"@training_task(image={image!r}): must be an image name such as "
                        "'ghcr.io/acme/train:v1' or a flytekit ImageSpec")
    if environment is not None and not (isinstance(environment, Mapping) and
                                        all(isinstance(k, str) and isinstance(v, str) for k, v in environment.items())):
        raise TypeError(f"@training_task(environment={environment!r}): must be a dict of strings")
    if check_inputs is not None and not callable(check_inputs):
        raise TypeError(f"@training_task(check_inputs={check_inputs!r}): must be a function of the task's inputs")
    if config is not None and not isinstance(config, PlatformConfig):
        raise TypeError(f"@training_task(config={config!r}): must be a fuseforge_flyte.config.PlatformConfig "
                        "(from load_config)")


def task_options(config: PlatformConfig, *, image: Any = None, environment: Optional[Mapping[str, str]] = None,
                 check_inputs: Optional[Callable[..., None]] = None,
                 task_arguments: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The @task keyword arguments of a user training task: the built-in training task's, then ours."""
    options = training_task_options(config, check_inputs=check_inputs)
    elastic = options["task_config"]
    options["task_config"] = UserTraining(**{f.name: getattr(elastic, f.name) for f in dataclasses.fields(elastic)})
    if image is not None:
        options["container_image"] = image
    if environment:
        # the platform's own variables (the resolved config, the fresh rendezvous store) win
        options["environment"] = {**environment, **options["environment"]}
    options.update(task_arguments or {})
    return options


# ------------------------------------------------------------------------------------------ the decorator


def training_task(
    _fn: Optional[Callable[..., Any]] = None,
    *,
    gpus: Optional[int] = None,
    accelerator: Optional[str] = None,
    cpu: Optional[str] = None,
    memory: Optional[str] = None,
    shared_memory: Optional[str] = None,
    node_selector: Optional[Mapping[str, str]] = None,
    tolerations: Optional[Sequence[Any]] = None,
    pod_template_name: Optional[str] = None,
    nnodes: Optional[int] = None,
    nproc_per_node: Optional[int] = None,
    local_nproc_per_node: Optional[int] = None,
    max_restarts: Optional[int] = None,
    start_method: Optional[str] = None,
    monitor_interval: Optional[int] = None,
    rdzv_timeout: Optional[int] = None,
    rdzv_join_timeout: Optional[int] = None,
    rdzv_read_timeout: Optional[int] = None,
    retries: Optional[int] = None,
    image: Any = None,
    environment: Optional[Mapping[str, str]] = None,
    check_inputs: Optional[Callable[..., None]] = None,
    config: Optional[PlatformConfig] = None,
    **task_arguments: Any,
) -> Any:
    """Make `_fn` an elastic GPU training task configured by platform.toml (see the module docstring).

    Overrides (None = platform.toml's value): gpus, accelerator, cpu, memory, shared_memory ("" = no
    memory-backed /dev/shm), node_selector, tolerations (dicts with key/operator/value/effect/
    toleration_seconds, or config.Toleration) and pod_template_name for [cluster]; nnodes, nproc_per_node
    (0 = one per GPU), local_nproc_per_node, max_restarts, start_method, monitor_interval and rdzv_*
    timeouts for [elastic]; retries for [flyte]. image: an image name or ImageSpec instead of the
    platform image. environment: extra variables for the pods. check_inputs(**inputs): runs in the
    launching process before any worker starts. config: a PlatformConfig instead of get_config().
    Other @task arguments (cache, timeout, interruptible, secret_requests, ...) pass through.
    """
    values = dict(gpus=gpus, accelerator=accelerator, cpu=cpu, memory=memory, shared_memory=shared_memory,
                  node_selector=node_selector, tolerations=tolerations, pod_template_name=pod_template_name,
                  nnodes=nnodes, nproc_per_node=nproc_per_node, local_nproc_per_node=local_nproc_per_node,
                  max_restarts=max_restarts, start_method=start_method, monitor_interval=monitor_interval,
                  rdzv_timeout=rdzv_timeout, rdzv_join_timeout=rdzv_join_timeout,
                  rdzv_read_timeout=rdzv_read_timeout, retries=retries)
    overrides = {k: v for k, v in values.items() if v is not None}
    _check_arguments(image, environment, check_inputs, config, task_arguments)
    resolved = resolve_config(config if config is not None else get_config(), overrides)  # ConfigError names the argument
    options = task_options(resolved, image=image, environment=environment, check_inputs=check_inputs,
                           task_arguments=task_arguments)

    def decorate(fn: Callable[..., Any]) -> Any:
        if not inspect.isfunction(fn):
            raise TypeError(f"@training_task decorates a function, got {fn!r}")
        return task(**options)(on_every_worker(fn))

    if _fn is not None:
        return decorate(_fn)
    return decorate
