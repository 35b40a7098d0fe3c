"""pydantic's ValidationError as a ConfigError in the config's own words: the source file or variable, the
key path (`[cluster].gpus`) and what the key must be, e.g.
`platform.toml: [cluster].gpus must be an integer >= 0, got "two"`; users never see pydantic's report.
"""

from __future__ import annotations

import difflib
import json
import typing
from typing import Any, Literal, Mapping, Optional, Tuple

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from fuseforge_flyte.config.schema import SECTIONS, ConfigError, bare_type


def show(value: Any) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def suggest(name: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f'; did you mean "{close[0]}"?' if close else ""


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _expected(tp: Any, info: Optional[FieldInfo]) -> str:
    """What completes "must be ...": the field's description, else said from its type."""
    if info is not None and info.description:
        return info.description
    tp, metadata = bare_type(tp)
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
        elem = bare_type(typing.get_args(tp)[0])[0]
        return "a list of tables" if _is_model(elem) else f"a list of {_expected(elem, None).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table of strings"
    return "a table"


class KeySources:
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
    tp: Any = SECTIONS[loc[0]]
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
        elif typing.get_origin(bare_type(tp)[0]) in (tuple, list):
            rank.append((part,))
            where, tp, info = f"{where}[{part}]", typing.get_args(bare_type(tp)[0])[0], None
        else:
            break
        followed += (part,)
    return rank, where, tp, info, followed


def _value_at(data: Any, loc: Tuple[Any, ...]) -> Any:
    for part in loc:
        data = data[part]
    return data


def config_error(exc: ValidationError, data: Mapping[str, Any], order: list, sources: KeySources) -> ConfigError:
    """The first problem (the file's sections first, see _walk) as a ConfigError naming its key and source:
    users see the config's key paths, never pydantic's report."""
    errors = sorted(exc.errors(), key=lambda e: [(order.index(e["loc"][0]),)] + _walk(e["loc"])[0])
    error = errors[0]
    _, where, tp, info, followed = _walk(error["loc"])
    if error["type"] == "extra_forbidden":
        key, known = error["loc"][-1], list(tp.model_fields)
        return ConfigError(
            f"{sources.of(f'{where}.{key}')}: unknown key {where}.{key} "
            f"(known keys: {', '.join(known)}){suggest(key, known)}"
        )
    if error["type"] == "missing":
        what = f" ({info.description})" if info is not None and info.description else ""
        return ConfigError(f"{sources.of(where)}: missing required key {where}{what}")
    value = _value_at(data, followed)
    return ConfigError(f"{sources.of(where)}: {where} must be {_expected(tp, info)}, got {show(value)}")

