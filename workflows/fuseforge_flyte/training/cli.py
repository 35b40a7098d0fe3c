"""Command line for the engine: one option per TrainSpec field, spelled as the workflows spell them
(`--batch_size`), with the field's help text and, for choices, the allowed values; the metrics JSON on stdout
(rank 0), everything else on stderr. Usable without Flyte, on one machine or with torchrun on a cluster::

    python -m fuseforge_flyte.training --model tiny-llama --steps 20 --no-kernels
    python -m fuseforge_flyte.training --recipe recipes/tiny-chat.yaml --steps 5 --output_dir out
    torchrun --nproc-per-node 8 -m fuseforge_flyte.training --model llama-1b --strategy fsdp

A user error (bad option, data, model, resume settings, a checkpoint that cannot be used or written) ends with one
line naming the option and its fix, exit status 2; the traceback goes to a log file (`--verbose` prints it). A
preemption (SIGTERM) writes the metrics up to the step it stopped after, then its one line, exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import typing
from typing import Iterator, List, Optional

from fuseforge_flyte.training.preemption import Preempted
from fuseforge_flyte.training.spec import TrainSpec
from fuseforge_flyte.training.validation import CHOICES


def _field_type(hint):
    if typing.get_origin(hint) is typing.Union:  # Optional[str]
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fuseforge_flyte.training",
                                     description="Train a causal LM with the fuseforge engine; prints the metrics "
                                                 "JSON on stdout.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(TrainSpec)
    for field in dataclasses.fields(TrainSpec):
        flag = "--" + field.name
        kind = _field_type(hints[field.name])
        help_text = field.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=field.default,
                                help=help_text)
            parser.add_argument(f"--no_{field.name}", dest=field.name, action="store_false", help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=field.name, type=kind, default=field.default, help=help_text,
                                choices=CHOICES.get(field.name), metavar=None if field.name in CHOICES else kind.__name__.upper())
    parser.add_argument("--recipe", metavar="FILE", help="a recipe (YAML, JSON or TOML, keys as the options "
                        "above); options given on the command line win over it")
    parser.add_argument("--metrics_file", metavar="FILE", help="also write the metrics JSON to this file (rank 0)")
    parser.add_argument("--log_level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level of the progress lines (stderr)")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a user error too")
    return parser


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point stdout (the file descriptor and Python's sys.stdout) at stderr while training: libraries that print
    (DeepSpeed's logger writes to stdout) cannot break the JSON that stdout carries."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: Optional[List[str]] = None) -> int:
    from fuseforge_flyte import user_errors
    from fuseforge_flyte.recipes import apply_recipe

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.recipe:
            args = apply_recipe(parser, args.recipe, argv if argv is not None else sys.argv[1:])
        values = dict(vars(args))
        for name in ("recipe", "metrics_file", "log_level", "verbose"):
            values.pop(name)
        logging.basicConfig(level=args.log_level, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        spec = TrainSpec(**values).validate()
        # The command line is an entry point, like the Flyte task: it reads platform.toml's [tracking] and hands it
        # to the engine, which never reads the config itself (pyproject's contracts name this one import).
        from fuseforge_flyte.config import get_config
        from fuseforge_flyte.training.engine import train

        with _stdout_to_stderr():
            metrics = train(spec, tracking_settings=get_config().tracking_settings())
    except Preempted as stop:  # the metrics up to the step it stopped after (`steps`), then its one line
        if stop.metrics is not None:
            _emit(stop.metrics, args.metrics_file)
        if args.verbose:
            raise
        print(f"error: {stop}", file=sys.stderr)
        return 2
    except Exception as err:
        if args.verbose or not user_errors.report(err, "--verbose"):
            raise
        return 2
    _emit(metrics, args.metrics_file)
    return 0


def _emit(metrics, metrics_file: Optional[str]) -> None:
    """Rank 0: the metrics JSON on stdout and, if asked, in `metrics_file`."""
    from fuseforge_flyte.training.distributed import _env_int

    if _env_int("RANK", 0) == 0:
        text = json.dumps(dataclasses.asdict(metrics), indent=2)
        print(text)
        if metrics_file:
            with open(metrics_file, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
