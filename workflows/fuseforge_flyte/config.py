"""platform.toml: the one config file of the platform, loaded into typed, frozen pydantic models.

Where the configuration comes from (first match wins):

1. ``FUSEFORGE_RESOLVED_CONFIG``: JSON written by the training task into its own pod spec at
   registration, so that code running on the cluster sees exactly the configuration the task was
   registered with (no file needed in the image; overrides below are not re-applied).
2. ``FUSEFORGE_CONFIG=/path/to/file.toml``.
3. ``./platform.toml`` in the current directory.
4. Built-in defaults (the same values as the repository's platform.toml).

Then single keys are overridden by environment variables ``FUSEFORGE__<SECTION>__<KEY>=<value>``
(pydantic-settings' nested variables, names case-insensitive; e.g. ``FUSEFORGE__CLUSTER__GPUS=4``; the
value is read as a TOML value, so lists and inline tables work, and as a plain string for string keys),
and by ``--set section.key=value`` on the CLI.

Every problem (unknown key, wrong type, bad value, missing required key) is a ``ConfigError`` naming
the file (or variable) and the key path, e.g. ``platform.toml: [cluster].gpus must be an integer >= 0, got "two"``;
pydantic's ValidationError is translated into it, never shown as is.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Dict, Literal, Mapping, Optional, Tuple

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StringConstraints, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fuseforge_flyte.training.spec import TrainSpec

CONFIG_FILE_NAME = "platform.toml"
CONFIG_PATH_ENV = "FUSEFORGE_CONFIG"
RESOLVED_CONFIG_ENV = "FUSEFORGE_RESOLVED_CONFIG"
OVERRIDE_ENV_PREFIX = "FUSEFORGE__"

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


_INT_AS_TEXT = BeforeValidator(_int_as_text)
# A Kubernetes resource quantity ("16", "500m", "64Gi"); TOML integers are accepted and kept as strings.
Quantity = Annotated[str, _INT_AS_TEXT, StringConstraints(pattern=f"^{_QUANTITY}$")]
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
_CHECKPOINT_FIELDS = {"checkpoint_dir": "dir", "checkpoint_every": "every", "keep_last": "keep_last",
                      "allow_unsigned_checkpoints": "allow_unsigned_checkpoints"}
# TrainSpec fields that are per run, never platform defaults.
_PER_RUN_FIELDS: typing.Set[str] = set()


def _training_defaults_class() -> type:
    """[training] mirrors TrainSpec (minus the checkpoint fields), so the two cannot drift apart.

    Types are checked here; values by TrainSpec.validate(), the engine's own rules (see _check_training).
    """
    hints = typing.get_type_hints(TrainSpec)
    specs: Dict[str, Any] = {}
    for f in dataclasses.fields(TrainSpec):
        if f.name in _CHECKPOINT_FIELDS or f.name in _PER_RUN_FIELDS:
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
        return all(getattr(self, name) == getattr(other, name) for name in _SECTIONS)

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

    def to_dict(self) -> dict:
        """The config as TOML-shaped plain data (tables, lists, scalars); None values are left out."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"source"})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


_SECTIONS: Dict[str, type] = {name: info.annotation for name, info in PlatformConfig.model_fields.items() if name != "source"}

# Values for the required keys when no config file exists at all (the repo's platform.toml has the same).
_BUILTIN_REQUIRED = {
    "image": {"registry": "localhost:30000"},
    "flyte": {"project": "flytesnacks", "domain": "development"},
}


# ----------------------------------------------------------------------------------------- validation


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _suggest(name: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f'; did you mean "{close[0]}"?' if close else ""


def _bare(tp: Any) -> Tuple[Any, list]:
    """`tp` without Optional and Annotated, and the Annotated metadata."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            tp = args[0]
    if typing.get_origin(tp) is Annotated:
        return tp.__origin__, list(tp.__metadata__)
    return tp, []


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _expected(tp: Any, info: Optional[FieldInfo]) -> str:
    """What completes "must be ...": the field's description, else said from its type."""
    if info is not None and info.description:
        return info.description
    tp, metadata = _bare(tp)
    metadata += list(info.metadata) if info is not None else []
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(c) for c in typing.get_args(tp))
    if tp is bool:
        return "true or false"
    if tp is int:
        lows = [m.ge for m in metadata if isinstance(m, annotated_types.Ge)]
        return "an integer" + (f" >= {lows[0]}" if lows else "")
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin in (tuple, list):
        elem = _bare(typing.get_args(tp)[0])[0]
        return "a list of tables" if _is_model(elem) else f"a list of {_expected(elem, None).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table of strings"
    return "a table"


def _is_text(info: Optional[FieldInfo]) -> bool:
    """A string key (its override is taken as is), as opposed to one whose override is read as TOML."""
    if info is None:  # unknown keys: the error shows the text given
        return True
    tp, _ = _bare(info.annotation)
    if typing.get_origin(tp) is Literal:
        return all(isinstance(choice, str) for choice in typing.get_args(tp))
    return tp is str and _INT_AS_TEXT not in info.metadata


class _Sources:
    """Which file or variable each key path came from, so errors name the right one."""

    def __init__(self, default: str, per_key: Optional[Mapping[str, str]] = None):
        self.default = default
        self.per_key = dict(per_key or {})

    def of(self, where: str) -> str:
        for path, source in self.per_key.items():
            if where == path or where.startswith(path + ".") or where.startswith(path + "["):
                return source
        return self.default


def _walk(loc: Tuple[Any, ...]) -> Tuple[list, str, Any, Optional[FieldInfo], Tuple[Any, ...]]:
    """Follow a pydantic error location through the section types.

    Returns a sort key (per table: unknown keys first, then the keys in field order; list items in order),
    the key path, the type and field reached, and the part of `loc` followed (a table of strings is
    reported whole)."""
    tp: Any = _SECTIONS[loc[0]]
    info: Optional[FieldInfo] = None
    where, rank, followed = f"[{loc[0]}]", [], loc[:1]
    for part in loc[1:]:
        if _is_model(tp):
            if part not in tp.model_fields:
                rank.append((0,))
                break
            rank.append((1, list(tp.model_fields).index(part)))
            info = tp.model_fields[part]
            where, tp = f"{where}.{part}", info.annotation
        elif typing.get_origin(_bare(tp)[0]) in (tuple, list):
            rank.append((part,))
            where, tp, info = f"{where}[{part}]", typing.get_args(_bare(tp)[0])[0], None
        else:
            break
        followed += (part,)
    return rank, where, tp, info, followed


def _value_at(data: Any, loc: Tuple[Any, ...]) -> Any:
    for part in loc:
        data = data[part]
    return data


def _config_error(exc: ValidationError, data: Mapping[str, Any], order: list, sources: _Sources) -> ConfigError:
    """The first problem (the file's sections first, see _walk) as a ConfigError naming its key and source:
    users see the config's key paths, never pydantic's report."""
    errors = sorted(exc.errors(), key=lambda e: [(order.index(e["loc"][0]),)] + _walk(e["loc"])[0])
    error = errors[0]
    _, where, tp, info, followed = _walk(error["loc"])
    if error["type"] == "extra_forbidden":
        key, known = error["loc"][-1], list(tp.model_fields)
        return ConfigError(
            f"{sources.of(f'{where}.{key}')}: unknown key {where}.{key} "
            f"(known keys: {', '.join(known)}){_suggest(key, known)}"
        )
    if error["type"] == "missing":
        what = f" ({info.description})" if info is not None and info.description else ""
        return ConfigError(f"{sources.of(where)}: missing required key {where}{what}")
    value = _value_at(data, followed)
    return ConfigError(f"{sources.of(where)}: {where} must be {_expected(tp, info)}, got {_show(value)}")


def _training_key(field_name: str) -> str:
    """The platform.toml key path of a TrainSpec field."""
    if field_name in _CHECKPOINT_FIELDS:
        return f"[checkpoint].{_CHECKPOINT_FIELDS[field_name]}"
    return f"[training].{field_name}"


def _check_training(config: PlatformConfig, sources: _Sources) -> None:
    """The training defaults must make a valid TrainSpec; the engine's message is re-pointed at the key."""
    try:
        config.train_spec().validate()
    except (TypeError, ValueError) as exc:
        fields_named = re.findall(r"TrainSpec\.(\w+)", str(exc))
        where = _training_key(fields_named[0]) if fields_named else "[training]"
        message = re.sub(r"TrainSpec\.(\w+)", lambda m: _training_key(m.group(1)), str(exc))
        raise ConfigError(f"{sources.of(where)}: {message}") from exc


def _resolve_workers(config: PlatformConfig) -> PlatformConfig:
    """[elastic].nproc_per_node = 0 (the default) follows [cluster].gpus: one worker process per GPU."""
    if config.elastic.nproc_per_node:
        return config
    elastic = config.elastic.model_copy(update={"nproc_per_node": max(config.cluster.gpus, 1)})
    return config.model_copy(update={"elastic": elastic})


def _check_consistency(config: PlatformConfig, sources: _Sources) -> None:
    gpus, nproc = config.cluster.gpus, config.elastic.nproc_per_node
    if gpus > 0 and nproc > gpus:
        nproc_from, gpus_from = sources.of("[elastic].nproc_per_node"), sources.of("[cluster].gpus")
        hint = ""
        if nproc_from == sources.default and gpus_from != sources.default:
            hint = (
                f" ([cluster].gpus comes from {gpus_from}: override [elastic].nproc_per_node too, or leave it "
                f"out of {nproc_from} so that it follows [cluster].gpus)"
            )
        raise ConfigError(
            f"{nproc_from}: [elastic].nproc_per_node ({nproc}) must be <= "
            f"[cluster].gpus ({gpus}): each worker process drives one GPU{hint}"
        )


def config_from_dict(data: Mapping[str, Any], source: str, key_sources: Optional[Mapping[str, str]] = None) -> PlatformConfig:
    """Validate TOML-shaped data into a PlatformConfig; errors name `source` (or the key's own source)."""
    sources = _Sources(source, key_sources)
    for section, table in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{sources.of(f'[{section}]')}: unknown section [{section}] "
                f"(known sections: {', '.join(_SECTIONS)}){_suggest(section, _SECTIONS)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{sources.of(f'[{section}]')}: [{section}] must be a table, got {_show(table)}")
    tables = {name: data.get(name, {}) for name in _SECTIONS}
    try:
        config = PlatformConfig.model_validate({**tables, "source": source})
    except ValidationError as exc:
        # Sections the file has first, so a typo there is reported before a key missing elsewhere.
        order = [s for s in data] + [s for s in _SECTIONS if s not in data]
        raise _config_error(exc, tables, order, sources) from None
    config = _resolve_workers(config)
    _check_consistency(config, sources)
    _check_training(config, sources)
    return config


# ----------------------------------------------------------------------------------------- loading


def find_config_file(env: Mapping[str, str] = os.environ) -> Optional[Path]:
    """FUSEFORGE_CONFIG, else ./platform.toml, else None (built-in defaults)."""
    explicit = env.get(CONFIG_PATH_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ConfigError(f"{CONFIG_PATH_ENV}={explicit}: no such config file")
        return path
    local = Path(CONFIG_FILE_NAME)
    return local if local.is_file() else None


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc


def _toml_value(raw: str) -> Any:
    """An override as TOML reads it ("8", "true", '["a"]', '{ pool = "h200" }'); not TOML: the text itself,
    which validation then reports with the key."""
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def _decode(section: str, key: str, raw: str) -> Any:
    """String keys take the text as is; other keys read it as a TOML value."""
    cls = _SECTIONS.get(section)
    return raw if cls is None or _is_text(cls.model_fields.get(key)) else _toml_value(raw)


class _OverrideSettings(BaseSettings):
    # max split 1 (pydantic-settings >= 2.8): a key is one name after its section, so that
    # FUSEFORGE__CLUSTER__NODE_SELECTOR__X is an unknown key (older versions: see collect_overrides' keys)
    model_config = SettingsConfigDict(
        env_prefix=OVERRIDE_ENV_PREFIX, env_nested_delimiter="__", env_nested_max_split=1, case_sensitive=False
    )


# Where FUSEFORGE__SECTION__KEY values go. Never instantiated: overrides are partial, and are validated
# together with the file they override.
_OverrideVariables = create_model(
    "_OverrideVariables", __base__=_OverrideSettings, **{name: (Optional[cls], None) for name, cls in _SECTIONS.items()}
)


class _EnvOverrides(EnvSettingsSource):
    """pydantic-settings' reading of the override variables of `env` (not necessarily os.environ), decoded as
    platform.toml would hold them: every key that is not a string key is read as TOML (not JSON, and not only
    lists and tables), and a value that does not parse is kept as text for validation to report."""

    def __init__(self, env: Mapping[str, str]):
        self._env = env
        super().__init__(_OverrideVariables)

    def _load_env_vars(self) -> Mapping[str, Optional[str]]:
        # sorted, like _override_variables: of names that differ only in case, the same one wins
        return {name.lower(): value for name, value in sorted(self._env.items())}

    def field_is_complex(self, field: FieldInfo) -> bool:
        return not _is_text(field)

    def decode_complex_value(self, field_name: str, field: Optional[FieldInfo], value: Any) -> Any:
        return _toml_value(value)


def _override_variables(env: Mapping[str, str]) -> Dict[Tuple[str, str], str]:
    """{(section, key): variable name}. pydantic-settings reads the values, but silently drops variables it
    cannot place (FUSEFORGE__GPUS, an unknown section) and lower-cases names; errors must name them as set."""
    found: Dict[Tuple[str, str], str] = {}
    for name in sorted(env):
        if not name.lower().startswith(OVERRIDE_ENV_PREFIX.lower()):
            continue
        section, _, key = name[len(OVERRIDE_ENV_PREFIX):].partition("__")
        if not section or not key:
            raise ConfigError(f"environment variable {name}: expected {OVERRIDE_ENV_PREFIX}<SECTION>__<KEY>")
        found[(section.lower(), key.lower())] = name
    return found


def _split_key(dotted: str, source: str) -> Tuple[str, str]:
    section, _, key = dotted.strip().partition(".")
    if not section or not key:
        raise ConfigError(f"{source}: expected SECTION.KEY=VALUE, e.g. cluster.gpus=4")
    return section.lower(), key.lower()


def collect_overrides(
    env: Mapping[str, str], cli: Optional[Mapping[str, str]] = None
) -> list[Tuple[str, str, Any, str]]:
    """(section, key, value, source) from FUSEFORGE__SECTION__KEY variables, then CLI --set pairs; values are
    decoded (TOML for non-string keys)."""
    found = []
    names = _override_variables(env)
    values = _EnvOverrides(env)() if names else {}
    for (section, key), name in names.items():
        # pydantic-settings leaves out an unknown section's (or, before 2.8, a nested) variable: the error shows its text
        value = values.get(section, {}).get(key, env[name])
        found.append((section, key, value, f"environment variable {name}"))
    for dotted, raw in (cli or {}).items():
        source = f"--set {dotted}={raw}"
        section, key = _split_key(dotted, source)
        found.append((section, key, _decode(section, key, raw), source))
    return found


def _follow_gpus(data: Dict[str, Any], overridden: typing.Set[Tuple[str, str]]) -> None:
    """A file whose [elastic].nproc_per_node equals its [cluster].gpus means "one worker per GPU": when only
    the GPU count is overridden (FUSEFORGE__CLUSTER__GPUS=4, --set cluster.gpus=4), the workers follow it."""
    if ("cluster", "gpus") not in overridden or ("elastic", "nproc_per_node") in overridden:
        return
    cluster, elastic = data.get("cluster"), data.get("elastic")
    if not isinstance(cluster, dict) or not isinstance(elastic, dict):
        return
    file_gpus = cluster.get("gpus", ClusterConfig.model_fields["gpus"].default)
    nproc = elastic.get("nproc_per_node")
    if type(nproc) is int and type(file_gpus) is int and nproc == file_gpus:
        del elastic["nproc_per_node"]


def load_config(
    path: Optional[os.PathLike | str] = None,
    *,
    env: Optional[Mapping[str, str]] = None,
    overrides: Optional[Mapping[str, str]] = None,
) -> PlatformConfig:
    """Load and validate the platform config (see the module docstring for the precedence)."""
    env = os.environ if env is None else env
    resolved = env.get(RESOLVED_CONFIG_ENV)
    if path is None and resolved:
        try:
            data = json.loads(resolved)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{RESOLVED_CONFIG_ENV}: invalid JSON: {exc}") from exc
        return config_from_dict(data, RESOLVED_CONFIG_ENV)

    file = Path(path) if path is not None else find_config_file(env)
    if file is not None:
        if not file.is_file():
            raise ConfigError(f"{file}: no such config file")
        data, source = _read_toml(file), str(file)
    else:
        data, source = json.loads(json.dumps(_BUILTIN_REQUIRED)), "built-in defaults"

    key_sources: Dict[str, str] = {}
    overrides_found = collect_overrides(env, overrides)
    _follow_gpus(data, {(section, key) for section, key, _, _ in overrides_found})
    for section, key, value, origin in overrides_found:
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section}] must be a table, got {_show(table)}")
        table[key] = value
        key_sources[f"[{section}].{key}"] = origin
        if section not in _SECTIONS:
            key_sources[f"[{section}]"] = origin
    label = source + (f" (+ {len(key_sources)} override(s))" if key_sources else "")
    config = config_from_dict(data, source, key_sources)
    return config.model_copy(update={"source": label})


@functools.lru_cache(maxsize=1)
def get_config() -> PlatformConfig:
    """The process-wide config, read once: tasks and workflows read it when they are defined (at import)."""
    return load_config()
