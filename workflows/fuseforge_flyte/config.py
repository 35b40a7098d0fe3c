"""platform.toml: the one config file of the platform, loaded into typed, frozen dataclasses.

Where the configuration comes from (first match wins):

1. ``FUSEFORGE_RESOLVED_CONFIG``: JSON written by the training task into its own pod spec at
   registration, so that code running on the cluster sees exactly the configuration the task was
   registered with (no file needed in the image; overrides below are not re-applied).
2. ``FUSEFORGE_CONFIG=/path/to/file.toml``.
3. ``./platform.toml`` in the current directory.
4. Built-in defaults (the same values as the repository's platform.toml).

Then single keys are overridden by environment variables ``FUSEFORGE__<SECTION>__<KEY>=<value>``
(e.g. ``FUSEFORGE__CLUSTER__GPUS=4``; the value is read as a TOML value, so lists and inline tables
work, and as a plain string for string keys), and by ``--set section.key=value`` on the CLI.

Every problem (unknown key, wrong type, bad value, missing required key) is a ``ConfigError`` naming
the file (or variable) and the key path, e.g. ``platform.toml: [cluster].gpus must be an integer >= 0, got "two"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, NewType, Optional, Tuple

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fuseforge_flyte.training.spec import TrainSpec

CONFIG_FILE_NAME = "platform.toml"
CONFIG_PATH_ENV = "FUSEFORGE_CONFIG"
RESOLVED_CONFIG_ENV = "FUSEFORGE_RESOLVED_CONFIG"
OVERRIDE_ENV_PREFIX = "FUSEFORGE__"

# A Kubernetes resource quantity ("16", "500m", "64Gi"); TOML integers are accepted and kept as strings.
Quantity = NewType("Quantity", str)
_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_REGISTRY_RE = re.compile(r"^(localhost:\d{1,5}|[a-z\d._-]+(:\d{1,5})?)(/[\w.-]+)*$")
_IMAGE_NAME_RE = re.compile(r"^[a-z0-9]+([._/-][a-z0-9]+)*$")
_TAG_RE = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
_URL_RE = re.compile(r"^(https?://\S+)?$")


class ConfigError(ValueError):
    """A bad platform configuration; the message names the source file/variable and the key."""


def _setting(default: Any = MISSING, *, desc: str | None = None, check: Callable[[Any], bool] | None = None):
    """A config field: `desc` completes "must be ..." in error messages, `check` validates the value."""
    meta = {"desc": desc, "check": check}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def _one_of(*choices: Any) -> dict:
    shown = ", ".join(json.dumps(c) for c in choices)
    return {"desc": f"one of {shown}", "check": lambda v: v in choices}


def _at_least(low: int) -> dict:
    return {"desc": f"an integer >= {low}", "check": lambda v: v >= low}


_NONEMPTY = {"desc": "a non-empty string", "check": lambda v: bool(v.strip())}


@dataclass(frozen=True)
class ImageConfig:
    """The training image (built by flytekit's ImageSpec, or images/Dockerfile)."""

    registry: str = _setting(
        desc='a container registry such as "ghcr.io/acme" or "localhost:30000"',
        check=lambda v: bool(_REGISTRY_RE.match(v)),
    )
    name: str = _setting(
        "fuseforge", desc="a lowercase image name", check=lambda v: bool(_IMAGE_NAME_RE.match(v))
    )
    tag: str = _setting(
        "", desc='a Docker tag ("" = content hash of the sources and image settings)',
        check=lambda v: bool(_TAG_RE.match(v)),
    )
    base_image: str = _setting("nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04", **_NONEMPTY)
    python_version: str = _setting(
        "3.12", desc='a Python version such as "3.12"', check=lambda v: bool(re.match(r"^3\.\d+$", v))
    )
    torch: str = _setting("torch==2.11.0", desc="a pip requirement for torch", check=lambda v: v.startswith("torch"))
    torch_index_url: str = _setting(
        "https://download.pytorch.org/whl/cu130",
        desc='an http(s) URL of a wheel index ("" = PyPI)',
        check=lambda v: bool(_URL_RE.match(v)),
    )
    fuseforge: str = _setting(
        "checkout", desc='"checkout" or a pip requirement for fuseforge', check=lambda v: bool(v.strip())
    )
    extras: Tuple[str, ...] = _setting(("hf", "platform", "deepspeed", "posttrain", "fp8"))
    extra_packages: Tuple[str, ...] = _setting(())
    apt_packages: Tuple[str, ...] = _setting(("build-essential",))
    platform: str = _setting("linux/amd64", **_NONEMPTY)


@dataclass(frozen=True)
class Toleration:
    """One Kubernetes toleration of the training pods."""

    key: str = _setting("")
    operator: str = _setting("Exists", **_one_of("Exists", "Equal"))
    value: str = _setting("")
    effect: str = _setting("", **_one_of("", "NoSchedule", "PreferNoSchedule", "NoExecute"))
    toleration_seconds: Optional[int] = _setting(None, **_at_least(0))


@dataclass(frozen=True)
class ClusterConfig:
    """What one training pod (one node's worth of workers) asks Kubernetes for."""

    gpus: int = _setting(8, **_at_least(0))
    accelerator: str = _setting("")  # flytekit GPUAccelerator name, e.g. "nvidia-h200"; "" = any GPU
    cpu: Quantity = _setting("32", desc='a Kubernetes quantity such as "32" or "500m"')
    memory: Quantity = _setting("256Gi", desc='a Kubernetes quantity such as "256Gi"')
    shared_memory: str = _setting(
        "64Gi",
        desc='a Kubernetes quantity such as "64Gi" ("" = no memory-backed /dev/shm)',
        check=lambda v: v == "" or bool(_QUANTITY_RE.match(v)),
    )
    node_selector: Dict[str, str] = _setting({})
    tolerations: Tuple[Toleration, ...] = _setting(
        (Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),)
    )
    pod_template_name: str = _setting("")


@dataclass(frozen=True)
class FlyteConfig:
    """Where workflows are registered."""

    project: str = _setting(**_NONEMPTY)
    domain: str = _setting(**_NONEMPTY)
    endpoint: str = _setting("")  # e.g. "dns:///flyte.example.com"; "" = flytectl/pyflyte config
    insecure: bool = _setting(False)
    retries: int = _setting(0, **_at_least(0))


@dataclass(frozen=True)
class ElasticConfig:
    """torch elastic launch settings (nnodes > 1 makes the task a Kubeflow PyTorchJob)."""

    nnodes: int = _setting(1, **_at_least(1))
    # 0 = one worker per GPU: [cluster].gpus (1 without GPUs), resolved when the config is loaded.
    nproc_per_node: int = _setting(
        0, desc="an integer >= 0 (0 = one per GPU, i.e. [cluster].gpus)", check=lambda v: v >= 0
    )
    local_nproc_per_node: int = _setting(2, **_at_least(1))  # workers for local runs (capped at the GPU count)
    max_restarts: int = _setting(2, **_at_least(0))
    start_method: str = _setting("spawn", **_one_of("spawn", "fork"))
    monitor_interval: int = _setting(5, **_at_least(1))
    rdzv_timeout: int = _setting(900, **_at_least(1))
    rdzv_join_timeout: int = _setting(900, **_at_least(1))
    rdzv_read_timeout: int = _setting(900, **_at_least(1))


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often training checkpoints are written (maps to TrainSpec.checkpoint_*)."""

    dir: str = _setting("")  # local dir or fsspec URI; "": the task's own Flyte checkpoint on a cluster; "off": none
    every: int = _setting(0, **_at_least(0))
    keep_last: int = _setting(2, **_at_least(1))


@dataclass(frozen=True)
class DataConfig:
    """The CPU pod that prepares data (tokenize, mask, pack, write shards) before any GPU is asked for."""

    cpu: Quantity = _setting("4", desc='a Kubernetes quantity such as "4" or "500m"')
    memory: Quantity = _setting("16Gi", desc='a Kubernetes quantity such as "16Gi"')


@dataclass(frozen=True)
class TrackingConfig:
    """Optional experiment tracking of the training metrics (rank 0 only); off by default.

    Secrets never live here: W&B reads WANDB_API_KEY from the environment.
    """

    backend: str = _setting("", **_one_of("", "tensorboard", "wandb"))  # "": off
    project: str = _setting("fuseforge", **_NONEMPTY)  # W&B project
    entity: str = _setting("")  # W&B team or user; "": the API key's default entity
    run_name: str = _setting("")  # "": <model>-<UTC time>
    log_dir: str = _setting("runs", **_NONEMPTY)  # TensorBoard: local dir or fsspec URI, events in <log_dir>/<run_name>
    mode: str = _setting("online", **_one_of("online", "offline"))  # W&B: offline writes ./wandb, sync later


# TrainSpec fields that platform.toml sets in [checkpoint] rather than [training].
_CHECKPOINT_FIELDS = {"checkpoint_dir": "dir", "checkpoint_every": "every", "keep_last": "keep_last"}
# TrainSpec fields that are per run, never platform defaults (the task chooses where the model goes).
_PER_RUN_FIELDS = {"output_dir"}

def _training_defaults_class() -> type:
    """[training] mirrors TrainSpec (minus the checkpoint fields), so the two cannot drift apart.

    Types are checked here; values by TrainSpec.validate(), the engine's own rules (see _check_training).
    """
    hints = typing.get_type_hints(TrainSpec)
    specs = []
    for f in fields(TrainSpec):
        if f.name in _CHECKPOINT_FIELDS or f.name in _PER_RUN_FIELDS:
            continue
        default = field(default=f.default) if f.default is not MISSING else field(default_factory=f.default_factory)
        specs.append((f.name, hints[f.name], default))
    cls = dataclasses.make_dataclass("TrainingDefaults", specs, frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = "Defaults for TrainSpec fields: the workflows' input defaults."
    return cls


TrainingDefaults = _training_defaults_class()


@dataclass(frozen=True)
class PlatformConfig:
    """The whole platform.toml, validated; one attribute per section."""

    image: ImageConfig
    cluster: ClusterConfig
    flyte: FlyteConfig
    elastic: ElasticConfig
    training: TrainingDefaults  # type: ignore[valid-type]
    checkpoint: CheckpointConfig
    data: DataConfig = DataConfig()
    tracking: TrackingConfig = TrackingConfig()
    source: str = field(default="built-in defaults", compare=False)  # where it was read from, for messages

    def train_spec(self, **overrides: Any) -> TrainSpec:
        """A TrainSpec with this config's defaults, then `overrides` applied."""
        values = dataclasses.asdict(self.training)
        values.update(
            checkpoint_dir=self.checkpoint.dir,
            checkpoint_every=self.checkpoint.every,
            keep_last=self.checkpoint.keep_last,
        )
        values.update(overrides)
        return TrainSpec(**values)

    def to_dict(self) -> dict:
        """The config as TOML-shaped plain data (tables, lists, scalars); None values are left out."""

        def plain(value: Any) -> Any:
            if is_dataclass(value):
                return {f.name: plain(getattr(value, f.name)) for f in fields(value) if getattr(value, f.name) is not None}
            if isinstance(value, (tuple, list)):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value

        return {name: plain(getattr(self, name)) for name in _SECTIONS}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


_SECTIONS: Dict[str, type] = {
    "image": ImageConfig,
    "cluster": ClusterConfig,
    "flyte": FlyteConfig,
    "elastic": ElasticConfig,
    "training": TrainingDefaults,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
    "tracking": TrackingConfig,
}

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


def _type_desc(tp: Any) -> str:
    tp = _unwrap_optional(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp in (str, Quantity):
        return "a string"
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        (elem,) = typing.get_args(tp)[:1]
        return "a list of tables" if is_dataclass(elem) else f"a list of {_type_desc(elem).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table of strings"
    return "a table"


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _suggest(name: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f'; did you mean "{close[0]}"?' if close else ""


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


def _coerce(tp: Any, value: Any, where: str, sources: _Sources, meta: Mapping[str, Any]) -> Any:
    desc = meta.get("desc") or _type_desc(tp)

    def fail() -> typing.NoReturn:
        raise ConfigError(f"{sources.of(where)}: {where} must be {desc}, got {_show(value)}")

    optional = _unwrap_optional(tp) is not tp
    tp = _unwrap_optional(tp)
    if value is None and optional:
        return None
    origin = typing.get_origin(tp)
    if tp is bool:
        if not isinstance(value, bool):
            fail()
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail()
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail()
        value = float(value)
    elif tp is Quantity:
        if isinstance(value, bool) or not isinstance(value, (str, int)) or not _QUANTITY_RE.match(str(value)):
            fail()
        value = str(value)
    elif tp is str:
        if not isinstance(value, str):
            fail()
    elif origin in (tuple, list):
        elem = typing.get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            fail()
        value = origin(_coerce(elem, v, f"{where}[{i}]", sources, {}) for i, v in enumerate(value))
    elif origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            fail()
        value = dict(value)
    elif is_dataclass(tp):
        if not isinstance(value, dict):
            fail()
        return _build(tp, value, where, sources)
    check = meta.get("check")
    if check is not None and not check(value):
        fail()
    return value


def _build(cls: type, table: Mapping[str, Any], where: str, sources: _Sources) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    for key in table:
        if key not in known:
            raise ConfigError(
                f"{sources.of(f'{where}.{key}')}: unknown key {where}.{key} "
                f"(known keys: {', '.join(known)}){_suggest(key, known)}"
            )
    kwargs = {}
    for f in fields(cls):
        key_path = f"{where}.{f.name}"
        if f.name in table:
            kwargs[f.name] = _coerce(hints[f.name], table[f.name], key_path, sources, f.metadata)
        elif f.default is MISSING and f.default_factory is MISSING:
            what = f" ({f.metadata['desc']})" if f.metadata.get("desc") else ""
            raise ConfigError(f"{sources.of(key_path)}: missing required key {key_path}{what}")
    return cls(**kwargs)


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
    elastic = dataclasses.replace(config.elastic, nproc_per_node=max(config.cluster.gpus, 1))
    return dataclasses.replace(config, elastic=elastic)


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
    # Sections the file has first, so a typo there is reported before a key missing elsewhere.
    order = [s for s in data] + [s for s in _SECTIONS if s not in data]
    built = {name: _build(_SECTIONS[name], data.get(name, {}), f"[{name}]", sources) for name in order}
    config = _resolve_workers(PlatformConfig(**built, source=source))
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


def _field_type(section: str, key: str) -> Any:
    cls = _SECTIONS.get(section)
    if cls is None:
        return None
    return typing.get_type_hints(cls).get(key)


def _parse_override(section: str, key: str, raw: str) -> Any:
    """String keys take the text as is; other keys read it as a TOML value ("8", "true", '["a"]')."""
    if _unwrap_optional(_field_type(section, key)) in (str, None):
        return raw
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def _split_key(dotted: str, source: str) -> Tuple[str, str]:
    section, _, key = dotted.strip().partition(".")
    if not section or not key:
        raise ConfigError(f"{source}: expected SECTION.KEY=VALUE, e.g. cluster.gpus=4")
    return section.lower(), key.lower()


def collect_overrides(
    env: Mapping[str, str], cli: Optional[Mapping[str, str]] = None
) -> list[Tuple[str, str, str, str]]:
    """(section, key, raw value, source) from FUSEFORGE__SECTION__KEY variables, then CLI --set pairs."""
    found = []
    for name in sorted(env):
        if not name.startswith(OVERRIDE_ENV_PREFIX):
            continue
        section, _, key = name[len(OVERRIDE_ENV_PREFIX):].partition("__")
        if not section or not key:
            raise ConfigError(f"environment variable {name}: expected {OVERRIDE_ENV_PREFIX}<SECTION>__<KEY>")
        found.append((section.lower(), key.lower(), env[name], f"environment variable {name}"))
    for dotted, raw in (cli or {}).items():
        source = f"--set {dotted}={raw}"
        section, key = _split_key(dotted, source)
        found.append((section, key, raw, source))
    return found


def _follow_gpus(data: Dict[str, Any], overridden: typing.Set[Tuple[str, str]]) -> None:
    """A file whose [elastic].nproc_per_node equals its [cluster].gpus means "one worker per GPU": when only
    the GPU count is overridden (FUSEFORGE__CLUSTER__GPUS=4, --set cluster.gpus=4), the workers follow it."""
    if ("cluster", "gpus") not in overridden or ("elastic", "nproc_per_node") in overridden:
        return
    cluster, elastic = data.get("cluster"), data.get("elastic")
    if not isinstance(cluster, dict) or not isinstance(elastic, dict):
        return
    file_gpus = cluster.get("gpus", ClusterConfig.gpus)
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
    for section, key, raw, origin in overrides_found:
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section}] must be a table, got {_show(table)}")
        table[key] = _parse_override(section, key, raw)
        key_sources[f"[{section}].{key}"] = origin
        if section not in _SECTIONS:
            key_sources[f"[{section}]"] = origin
    label = source + (f" (+ {len(key_sources)} override(s))" if key_sources else "")
    config = config_from_dict(data, source, key_sources)
    return dataclasses.replace(config, source=label)


@functools.lru_cache(maxsize=1)
def get_config() -> PlatformConfig:
    """The process-wide config, read once: tasks and workflows read it when they are defined (at import)."""
    return load_config()
