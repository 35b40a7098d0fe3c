"""Where the platform config comes from, and its checks beyond one key's type (first match wins):

1. ``FUSEFORGE_RESOLVED_CONFIG``: JSON written by the training task into its own pod spec at
   registration, so that code running on the cluster sees exactly the configuration the task was
   registered with (no file needed in the image; overrides are not re-applied).
2. ``FUSEFORGE_CONFIG=/path/to/file.toml``.
3. ``./platform.toml`` in the current directory.
4. Built-in defaults (the same values as the repository's platform.toml).

Then single keys are overridden by FUSEFORGE__<SECTION>__<KEY> variables and `--set section.key=value`
(overrides.py). Every problem is a ConfigError naming the file (or variable) and the key path.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from pydantic import ValidationError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fuseforge_flyte.config.messages import KeySources, config_error, show, suggest
from fuseforge_flyte.config.overrides import collect_overrides, follow_gpus
from fuseforge_flyte.config.schema import CHECKPOINT_FIELDS, SECTIONS, ConfigError, PlatformConfig

CONFIG_FILE_NAME = "platform.toml"
CONFIG_PATH_ENV = "FUSEFORGE_CONFIG"
RESOLVED_CONFIG_ENV = "FUSEFORGE_RESOLVED_CONFIG"

# Values for the required keys when no config file exists at all (the repo's platform.toml has the same).
_BUILTIN_REQUIRED = {
    "image": {"registry": "localhost:30000"},
    "flyte": {"project": "flytesnacks", "domain": "development"},
}


def _training_key(field_name: str) -> str:
    """The platform.toml key path of a TrainSpec field."""
    if field_name in CHECKPOINT_FIELDS:
        return f"[checkpoint].{CHECKPOINT_FIELDS[field_name]}"
    return f"[training].{field_name}"


def _check_training(config: PlatformConfig, sources: KeySources) -> None:
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


def _check_consistency(config: PlatformConfig, sources: KeySources) -> None:
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
    sources = KeySources(source, key_sources)
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"{sources.of(f'[{section}]')}: unknown section [{section}] "
                f"(known sections: {', '.join(SECTIONS)}){suggest(section, SECTIONS)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{sources.of(f'[{section}]')}: [{section}] must be a table, got {show(table)}")
    tables = {name: data.get(name, {}) for name in SECTIONS}
    try:
        config = PlatformConfig.model_validate({**tables, "source": source})
    except ValidationError as exc:
        # Sections the file has first, so a typo there is reported before a key missing elsewhere.
        order = [s for s in data] + [s for s in SECTIONS if s not in data]
        raise config_error(exc, tables, order, sources) from None
    config = _resolve_workers(config)
    _check_consistency(config, sources)
    _check_training(config, sources)
    return config


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
    follow_gpus(data, {(section, key) for section, key, _, _ in overrides_found})
    for section, key, value, origin in overrides_found:
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section}] must be a table, got {show(table)}")
        table[key] = value
        key_sources[f"[{section}].{key}"] = origin
        if section not in SECTIONS:
            key_sources[f"[{section}]"] = origin
    label = source + (f" (+ {len(key_sources)} override(s))" if key_sources else "")
    config = config_from_dict(data, source, key_sources)
    return config.model_copy(update={"source": label})


@functools.lru_cache(maxsize=1)
def get_config() -> PlatformConfig:
    """The process-wide config, read once: tasks and workflows read it when they are defined (at import)."""
    return load_config()
