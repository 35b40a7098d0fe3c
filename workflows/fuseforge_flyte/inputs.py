"""The training settings as flat Flyte inputs, from one source: TrainSpec's fields.

The `train_model` task and the `train`, `distill` and `compare` workflows take the same ~30 settings as separate inputs,
so `pyflyte run ... --steps 40 --strategy fsdp` stays flat. Rather than spelling them out in each
signature, `training_inputs` gives a function `def f(<own inputs>, **settings)` the TrainSpec fields as
keyword inputs: the type (str-valued choices become Enums, i.e. click choices), the default (platform.toml's
[training] and [checkpoint], read at import) and the help text (the field's `help`, as a `:param:` line,
which pyflyte --help and the Flyte console show). `spec_values` turns the received inputs back into
TrainSpec values.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import typing
from typing import Any, Callable, Collection, Dict, TypeVar

from fuseforge_flyte.training.spec import TrainSpec
from fuseforge_flyte.training.validation import CHOICES

F = TypeVar("F", bound=Callable[..., Any])

# Per-run values that the tasks set themselves; never inputs.
NOT_INPUTS = frozenset({"dataset"})


def _choice_enum(class_name: str, field_name: str) -> type:
    """An Enum of the allowed string values of `field_name` (its members' values are the strings)."""
    values = CHOICES[field_name]
    choice = enum.Enum(class_name, {value.upper(): value for value in values}, module=__name__)
    choice.__doc__ = f"Allowed values of TrainSpec.{field_name}."
    return choice


Strategy = _choice_enum("Strategy", "strategy")
Dtype = _choice_enum("Dtype", "dtype")
NonfinitePolicy = _choice_enum("NonfinitePolicy", "nonfinite_policy")
DataFormat = _choice_enum("DataFormat", "data_format")
PlanMode = _choice_enum("PlanMode", "plan")
CHOICE_TYPES: Dict[str, type] = {"strategy": Strategy, "dtype": Dtype, "nonfinite_policy": NonfinitePolicy,
                                 "data_format": DataFormat, "plan": PlanMode}

_HINTS = typing.get_type_hints(TrainSpec)
_FIELDS = {f.name: f for f in dataclasses.fields(TrainSpec)}


def input_type(name: str) -> type:
    return CHOICE_TYPES.get(name, _HINTS[name])


def input_default(name: str, defaults: TrainSpec) -> Any:
    value = getattr(defaults, name)
    return CHOICE_TYPES[name](value) if name in CHOICE_TYPES else value


def help_text(name: str) -> str:
    return _FIELDS[name].metadata.get("help", "")


def training_inputs(defaults: TrainSpec, *, exclude: Collection[str] = ()) -> Callable[[F], F]:
    """Give `fn(<own inputs>, **settings)` every TrainSpec field (but `exclude` and NOT_INPUTS) as a keyword input.

    The function's own parameters keep their place and annotations; the settings follow in TrainSpec's order.
    """
    unknown = set(exclude) - set(_FIELDS)
    if unknown:
        raise ValueError(f"training_inputs(exclude=...): not TrainSpec fields: {sorted(unknown)}")

    def decorate(fn: F) -> F:
        own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
        names = [name for name in _FIELDS if name not in NOT_INPUTS and name not in exclude]
        clash = {p.name for p in own} & set(names)
        if clash:
            raise ValueError(f"{fn.__qualname__}: parameters {sorted(clash)} are also training inputs; exclude them")
        own_hints = typing.get_type_hints(fn)
        settings = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=input_default(name, defaults),
                                      annotation=input_type(name)) for name in names]
        fn.__signature__ = inspect.Signature(own + settings, return_annotation=own_hints.get("return"))
        fn.__annotations__ = {**{p.name: own_hints[p.name] for p in own}, **{p.name: p.annotation for p in settings},
                              "return": own_hints.get("return")}
        fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n\n" + "\n".join(
            f"    :param {name}: {help_text(name)}" for name in names) + "\n"
        return fn

    return decorate


def summary_only(*entities: Any) -> None:
    """Drop the `:param` lines from tasks'/workflows' __doc__ once flytekit has read them into the input
    descriptions: pyflyte prints __doc__ above the options table, which already shows each input's help."""
    for entity in entities:
        entity.__doc__ = re.split(r"\n\s*:param ", entity.__doc__ or "", maxsplit=1)[0].rstrip() + "\n"


def spec_values(inputs: Dict[str, Any]) -> Dict[str, Any]:
    """Inputs as TrainSpec values: Enum members become their strings."""
    return {name: value.value if isinstance(value, enum.Enum) else value for name, value in inputs.items()}
