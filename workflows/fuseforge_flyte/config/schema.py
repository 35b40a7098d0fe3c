"""platform.toml's schema: one frozen, strict pydantic model per table, and PlatformConfig, the whole file.

A field's `description` completes "must be ..." in error messages (see messages.py); [training] is made from
TrainSpec's own fields, so the platform defaults and the engine cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Annotated, Any, Dict, Literal, Optional, Tuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StringConstraints, create_model

from fuseforge_flyte.training.spec import TrainSpec
from fuseforge_flyte.training.tracking import TrackingSettings

_QUANTITY = r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?"
_REGISTRY = r"^(localhost:\d{1,5}|[a-z\d._-]+(:\d{1,5})?)(/[\w.-]+)*$"
_IMAGE_NAME = r"^[a-z0-9]+([._/-][a-z0-9]+)*$"
_TAG = r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$"
_URL = r"^(https?://\S+)?$"
_NONEMPTY = r"^\s*\S"


class ConfigError(ValueError):
    """A bad platform configuration; the message names the source file/variable and the key."""


def _int_as_text(value: Any) -> Any:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


INT_AS_TEXT = BeforeValidator(_int_as_text)
# A Kubernetes resource quantity ("16", "500m", "64Gi"); TOML integers are accepted and kept as strings.
Quantity = Annotated[str, INT_AS_TEXT, StringConstraints(pattern=f"^{_QUANTITY}$")]
# TOML arrays arrive as lists: only the container is lax, its items stay strict.
_List = Strict(False)


class _Section(BaseModel):
    """A platform.toml table. Strict, so that `gpus = "2"` or `gpus = true` is an error, not a guess;
    a field's `description` completes "must be ..." in error messages."""

    # python-re: the patterns keep Python's regex semantics, as when they were checked with re.match
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", regex_engine="python-re")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Positional arguments in field order too, as the dataclasses these were took them."""
        names = list(type(self).model_fields)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
        super().__init__(**dict(zip(names, args)), **kwargs)


class ImageConfig(_Section):
    """The training image (built by flytekit's ImageSpec, or images/Dockerfile)."""

    registry: str = Field(pattern=_REGISTRY, description='a container registry such as "ghcr.io/acme" or "localhost:30000"')
    name: str = Field("fuseforge", pattern=_IMAGE_NAME, description="a lowercase image name")
    tag: str = Field("", pattern=_TAG, description='a Docker tag ("" = content hash of the sources and image settings)')
    base_image: str = Field("nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04", pattern=_NONEMPTY, description="a non-empty string")
    python_version: str = Field("3.12", pattern=r"^3\.\d+$", description='a Python version such as "3.12"')
    torch: str = Field("torch==2.11.0", pattern="^torch", description="a pip requirement for torch")
    torch_index_url: str = Field(
        "https://download.pytorch.org/whl/cu130", pattern=_URL, description='an http(s) URL of a wheel index ("" = PyPI)'
    )
    fuseforge: str = Field("checkout", pattern=_NONEMPTY, description='"checkout" or a pip requirement for fuseforge')
    extras: Annotated[Tuple[str, ...], _List] = ("hf", "platform", "deepspeed", "posttrain", "fp8", "lora")
    extra_packages: Annotated[Tuple[str, ...], _List] = ()
    apt_packages: Annotated[Tuple[str, ...], _List] = ("build-essential",)
    platform: str = Field("linux/amd64", pattern=_NONEMPTY, description="a non-empty string")


class Toleration(_Section):
    """One Kubernetes toleration of the training pods."""

    key: str = ""
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""
    toleration_seconds: Optional[int] = Field(None, ge=0)


class ClusterConfig(_Section):
    """What one training pod (one node's worth of workers) asks Kubernetes for."""

    gpus: int = Field(8, ge=0)
    accelerator: str = ""  # flytekit GPUAccelerator name, e.g. "nvidia-h200"; "" = any GPU
    cpu: Quantity = Field("32", description='a Kubernetes quantity such as "32" or "500m"')
    memory: Quantity = Field("256Gi", description='a Kubernetes quantity such as "256Gi"')
    shared_memory: str = Field(
        "64Gi", pattern=f"^({_QUANTITY})?$",
        description='a Kubernetes quantity such as "64Gi" ("" = no memory-backed /dev/shm)',
    )
    node_selector: Dict[str, str] = {}
    tolerations: Annotated[Tuple[Toleration, ...], _List] = (
        Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),
    )
    pod_template_name: str = ""


class FlyteConfig(_Section):
    """Where workflows are registered."""

    project: str = Field(pattern=_NONEMPTY, description="a non-empty string")
    domain: str = Field(pattern=_NONEMPTY, description="a non-empty string")
    endpoint: str = ""  # e.g. "dns:///flyte.example.com"; "" = flytectl/pyflyte config
    insecure: bool = False
    retries: int = Field(0, ge=0)


class ElasticConfig(_Section):
    """torch elastic launch settings (nnodes > 1 makes the task a Kubeflow PyTorchJob)."""

    nnodes: int = Field(1, ge=1)
    # 0 = one worker per GPU: [cluster].gpus (1 without GPUs), resolved when the config is loaded.
    nproc_per_node: int = Field(0, ge=0, description="an integer >= 0 (0 = one per GPU, i.e. [cluster].gpus)")
    local_nproc_per_node: int = Field(2, ge=1)  # workers for local runs (capped at the GPU count)
    max_restarts: int = Field(2, ge=0)
    start_method: Literal["spawn", "fork"] = "spawn"
    monitor_interval: int = Field(5, ge=1)
    rdzv_timeout: int = Field(900, ge=1)
    rdzv_join_timeout: int = Field(900, ge=1)
    rdzv_read_timeout: int = Field(900, ge=1)


class CheckpointConfig(_Section):
    """Where and how often training checkpoints are written (maps to TrainSpec.checkpoint_*)."""

    dir: str = ""  # local dir or fsspec URI; "": the task's own Flyte checkpoint on a cluster; "off": none
    every: int = Field(0, ge=0)
    keep_last: int = Field(2, ge=1)
    # load checkpoints not signed with the run's key (integrity-checked only, with a warning); see README
    allow_unsigned_checkpoints: bool = False


class DataConfig(_Section):
    """The CPU pod that prepares data (tokenize, mask, pack, write shards) before any GPU is asked for."""

    cpu: Quantity = Field("4", description='a Kubernetes quantity such as "4" or "500m"')
    memory: Quantity = Field("16Gi", description='a Kubernetes quantity such as "16Gi"')


class TrackingConfig(_Section):
    """Optional experiment tracking of the training metrics (rank 0 only); off by default.

    Secrets never live here: W&B reads WANDB_API_KEY from the environment.
    """

    backend: Literal["", "tensorboard", "wandb"] = ""  # "": off
    project: str = Field("fuseforge", pattern=_NONEMPTY, description="a non-empty string")  # W&B project
    entity: str = ""  # W&B team or user; "": the API key's default entity
    run_name: str = ""  # "": <model>-<UTC time>
    # TensorBoard: local dir or fsspec URI, events in <log_dir>/<run_name>
    log_dir: str = Field("runs", pattern=_NONEMPTY, description="a non-empty string")
    mode: Literal["online", "offline"] = "online"  # W&B: offline writes ./wandb, sync later


# TrainSpec fields that platform.toml sets in [checkpoint] rather than [training].
CHECKPOINT_FIELDS = {"checkpoint_dir": "dir", "checkpoint_every": "every", "keep_last": "keep_last",
                      "allow_unsigned_checkpoints": "allow_unsigned_checkpoints"}
# TrainSpec fields that are per run, never platform defaults.
_PER_RUN_FIELDS: typing.Set[str] = set()


def _training_defaults_class() -> type:
    """[training] mirrors TrainSpec (minus the checkpoint fields), so the two cannot drift apart.

    Types are checked here; values by TrainSpec.validate(), the engine's own rules (see loading.config_from_dict).
    """
    hints = typing.get_type_hints(TrainSpec)
    specs: Dict[str, Any] = {}
    for f in dataclasses.fields(TrainSpec):
        if f.name in CHECKPOINT_FIELDS or f.name in _PER_RUN_FIELDS:
            continue
        default = f.default if f.default is not dataclasses.MISSING else Field(default_factory=f.default_factory)
        specs[f.name] = (hints[f.name], default)
    return create_model(
        "TrainingDefaults", __base__=_Section, __module__=__name__,
        __doc__="Defaults for TrainSpec fields: the workflows' input defaults.", **specs,
    )


TrainingDefaults = _training_defaults_class()


class PlatformConfig(BaseModel):
    """The whole platform.toml, validated; one attribute per section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: ImageConfig
    cluster: ClusterConfig
    flyte: FlyteConfig
    elastic: ElasticConfig
    training: TrainingDefaults  # type: ignore[valid-type]
    checkpoint: CheckpointConfig
    data: DataConfig = DataConfig()
    tracking: TrackingConfig = TrackingConfig()
    source: str = "built-in defaults"  # where it was read from, for messages; not part of equality

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlatformConfig):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in SECTIONS)

    def train_spec(self, **overrides: Any) -> TrainSpec:
        """A TrainSpec with this config's defaults, then `overrides` applied."""
        values = self.training.model_dump()
        values.update(
            checkpoint_dir=self.checkpoint.dir,
            checkpoint_every=self.checkpoint.every,
            keep_last=self.checkpoint.keep_last,
            allow_unsigned_checkpoints=self.checkpoint.allow_unsigned_checkpoints,
        )
        values.update(overrides)
        return TrainSpec(**values)

    def tracking_settings(self) -> TrackingSettings:
        """[tracking] as the engine takes it (training/tracking.py), naming where it was read from."""
        return TrackingSettings(**self.tracking.model_dump(), source=self.source)

    def to_dict(self) -> dict:
        """The config as TOML-shaped plain data (tables, lists, scalars); None values are left out."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"source"})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


# The tables of platform.toml: name -> section model.
SECTIONS: Dict[str, type] = {name: info.annotation for name, info in PlatformConfig.model_fields.items() if name != "source"}


def bare_type(tp: Any) -> Tuple[Any, list]:
    """`tp` without Optional and Annotated, and the Annotated metadata."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            tp = args[0]
    if typing.get_origin(tp) is Annotated:
        return tp.__origin__, list(tp.__metadata__)
    return tp, []

