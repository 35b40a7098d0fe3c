"""Single keys overridden on top of the file: FUSEFORGE__<SECTION>__<KEY>=<value> variables (read by
pydantic-settings, names case-insensitive) and `--set section.key=value` on the CLI. A value is read as a TOML
value (lists and inline tables work), and as plain text for string keys; validation happens later, together
with the file the overrides apply to.
"""

from __future__ import annotations

import typing
from typing import Any, Dict, Literal, Mapping, Optional, Tuple

from pydantic import create_model
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fuseforge_flyte.config.schema import INT_AS_TEXT, SECTIONS, ClusterConfig, ConfigError, bare_type

OVERRIDE_ENV_PREFIX = "FUSEFORGE__"


def _is_text(info: Optional[FieldInfo]) -> bool:
    """A string key (its override is taken as is), as opposed to one whose override is read as TOML."""
    if info is None:  # unknown keys: the error shows the text given
        return True
    tp, _ = bare_type(info.annotation)
    if typing.get_origin(tp) is Literal:
        return all(isinstance(choice, str) for choice in typing.get_args(tp))
    return tp is str and INT_AS_TEXT not in info.metadata


def _toml_value(raw: str) -> Any:
    """An override as TOML reads it ("8", "true", '["a"]', '{ pool = "h200" }'); not TOML: the text itself,
    which validation then reports with the key."""
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def _decode(section: str, key: str, raw: str) -> Any:
    """String keys take the text as is; other keys read it as a TOML value."""
    cls = SECTIONS.get(section)
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
    "_OverrideVariables", __base__=_OverrideSettings, **{name: (Optional[cls], None) for name, cls in SECTIONS.items()}
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


def follow_gpus(data: Dict[str, Any], overridden: typing.Set[Tuple[str, str]]) -> None:
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

