"""Command line for the engine: one flag per TrainSpec field, metrics JSON on stdout (rank 0).

Usable without Flyte, on one machine or with torchrun on a cluster::

    python -m fuseforge_flyte.training --model tiny-llama --steps 20 --no-kernels
    torchrun --nproc-per-node 8 -m fuseforge_flyte.training --model llama-1b --strategy fsdp
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing
from typing import List, Optional

from fuseforge_flyte.training.spec import TrainSpec


def _field_type(hint):
    if typing.get_origin(hint) is typing.Union:  # Optional[str]
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fuseforge_flyte.training",
                                     description="Train a causal LM with the fuseforge engine; prints metrics JSON.")
    hints = typing.get_type_hints(TrainSpec)
    for field in dataclasses.fields(TrainSpec):
        flag = "--" + field.name.replace("_", "-")
        kind = _field_type(hints[field.name])
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, dest=field.name, type=kind, default=field.default,
                                help=f"default: {field.default}")
    parser.add_argument("--output", help="also write the metrics JSON to this file (rank 0)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = vars(build_parser().parse_args(argv))
    output, level = args.pop("output"), args.pop("log_level")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = TrainSpec(**args)
    try:
        spec.validate()
    except (TypeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from fuseforge_flyte.training.distributed import _env_int
    from fuseforge_flyte.training.engine import train

    metrics = train(spec)
    if _env_int("RANK", 0) == 0:
        text = json.dumps(dataclasses.asdict(metrics), indent=2)
        print(text)
        if output:
            with open(output, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
    return 0
