"""Recipes: a run's settings kept in a file instead of a 20-option command.

A recipe is a flat mapping of input names to values (YAML, JSON, or TOML with the keys at the top or in a
[training] table, as platform.toml holds them). `recipes/` ships some. They are read by
`python -m fuseforge_flyte.cli run <workflow> --recipe FILE` and the engine's `--recipe FILE` (options on the
command line win), and, YAML or JSON, by `pyflyte run ... --inputs-file FILE`. A key that is not an input of the
workflow is named with the closest one ("did you mean"), before anything runs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from typing import Any, Collection, Dict, List, Sequence

RECIPES_DIR = "recipes"


def read_recipe(path: str) -> Dict[str, Any]:
    """The recipe's keys and values (TOML: the [training] table when there is one)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--recipe: no such file {path!r}")
    with open(path, "rb") as handle:
        raw = handle.read()
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            import tomllib

            data = tomllib.loads(raw.decode("utf-8"))
            data = data.get("training", data)
        elif ext == ".json":
            data = json.loads(raw)
        else:
            import yaml

            data = yaml.safe_load(raw)
    except Exception as err:  # each parser's own error type
        raise ValueError(f"--recipe: {path} is not valid {ext.lstrip('.') or 'YAML'}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"--recipe: {path} must map input names to values (name: value), got {type(data).__name__}")
    return data


def check_keys(recipe: Dict[str, Any], known: Collection[str], path: str) -> None:
    """Every key is a known input; the first that is not is named with the closest known one."""
    for key in recipe:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
            raise ValueError(f"--recipe: {path}: unknown key {key!r}: {hint}")


def apply_recipe(parser: argparse.ArgumentParser, path: str, argv: Sequence[str]) -> argparse.Namespace:
    """The engine CLI's arguments with the recipe's values as defaults, so that options given win."""
    recipe = read_recipe(path)
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "recipe")}
    check_keys(recipe, actions, path)
    for key, value in recipe.items():  # YAML reads 3e-4 as a string: convert as the option would
        convert = actions[key].type
        if isinstance(value, str) and convert in (int, float):
            try:
                recipe[key] = convert(value)
            except ValueError:
                raise ValueError(f"--recipe: {path}: {key}: {value!r} is not a{'n' if convert is int else ''} "
                                 f"{convert.__name__}") from None
    parser.set_defaults(**recipe)
    return parser.parse_args(list(argv))


def pyflyte_args(recipe: Dict[str, Any]) -> List[str]:
    """The recipe as pyflyte options (booleans as --x / --no_x, lists and mappings as JSON)."""
    args: List[str] = []
    for key, value in recipe.items():
        if isinstance(value, bool):
            args.append(f"--{key}" if value else f"--no_{key}")
        elif isinstance(value, (list, dict)):
            args += [f"--{key}", json.dumps(value)]
        else:
            args += [f"--{key}", str(value)]
    return args
