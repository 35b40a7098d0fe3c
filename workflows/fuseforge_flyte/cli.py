"""Command line for the platform: check the config, build the image, run the workflows.

    python -m fuseforge_flyte.cli config                      # where the config comes from, and its values
    python -m fuseforge_flyte.cli build-image [--no-push]     # build (and push) the training image with Docker
    python -m fuseforge_flyte.cli build-image --render DIR    # write its Dockerfile + context, no Docker needed
    python -m fuseforge_flyte.cli build-base                  # a Debian base made here, for buildah (no pulls)
    python -m fuseforge_flyte.cli requirements                # the image's pip requirements (images/requirements.txt)
    python -m fuseforge_flyte.cli run [--remote] train --model tiny-llama --steps 20
    python -m fuseforge_flyte.cli run --recipe recipes/tiny-chat.yaml train --steps 5

Global options: --config FILE (same as FUSEFORGE_CONFIG) and --set SECTION.KEY=VALUE (repeatable, same as
FUSEFORGE__SECTION__KEY); both are passed on to pyflyte by `run`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from fuseforge_flyte.config import CONFIG_PATH_ENV, OVERRIDE_ENV_PREFIX, ConfigError, PlatformConfig, load_config

REQUIREMENTS_HEADER = (
    "# Generated from pyproject.toml by `python -m fuseforge_flyte.cli requirements > images/requirements.txt`;\n"
    "# tests/deploy/test_flyte_image.py fails when it is stale. torch is installed before these, from the CUDA index.\n"
)
WORKFLOW_FILES = {name: f"workflows/{name}.py" for name in ("train", "compare", "distill", "dpo", "demo")}


def _global_overrides(args: argparse.Namespace) -> Dict[str, str]:
    """--set SECTION.KEY=VALUE pairs; --config becomes FUSEFORGE_CONFIG (also for pyflyte children)."""
    if args.config:
        os.environ[CONFIG_PATH_ENV] = str(Path(args.config).resolve())
    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item}: expected SECTION.KEY=VALUE, e.g. --set cluster.gpus=4")
        overrides[key] = value
    return overrides


def _override_env(overrides: Dict[str, str]) -> Dict[str, str]:
    """The same overrides as FUSEFORGE__SECTION__KEY variables, for processes we start."""
    env = {}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        env[f"{OVERRIDE_ENV_PREFIX}{section.upper()}__{name.upper()}"] = value
    return env


def cmd_config(args: argparse.Namespace, config: PlatformConfig) -> int:
    print(f"# source: {config.source}")
    print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
    return 0


def requirements_txt(config: PlatformConfig) -> str:
    from fuseforge_flyte.image.requirements import image_packages
    from fuseforge_flyte.image.sources import find_checkout

    packages = [p for p in image_packages(config, find_checkout()) if p != config.image.torch]
    return REQUIREMENTS_HEADER + "\n".join(packages) + "\n"


def cmd_requirements(args: argparse.Namespace, config: PlatformConfig) -> int:
    sys.stdout.write(requirements_txt(config))
    return 0


def cmd_build_image(args: argparse.Namespace, config: PlatformConfig) -> int:
    from fuseforge_flyte.image.docker import FuseforgeImageBuilder, render_docker_context
    from fuseforge_flyte.image.spec import training_image

    spec = training_image(config)
    if args.render:
        dockerfile = render_docker_context(spec, args.render)
        print(f"wrote {dockerfile} (image {spec.image_name()})")
        return 0
    name = FuseforgeImageBuilder().build(spec, push=not args.no_push)
    print(f"built {name}" + ("" if args.no_push else " and pushed it"))
    return 0


def cmd_build_base(args: argparse.Namespace, config: PlatformConfig) -> int:
    from fuseforge_flyte.image.base import make_base_image

    name = make_base_image(config.image.base_image, config.image.python_version, suite=args.suite,
                           mirror=args.mirror, replace=args.replace)
    print(f"base image {name} is in buildah's storage")
    return 0


def pyflyte_command(config: PlatformConfig, workflow: str, remote: bool, extra: List[str]) -> List[str]:
    """The pyflyte invocation for a workflow; remote runs upload the whole workflows/ tree (--copy all)."""
    from fuseforge_flyte.image.sources import find_checkout

    checkout = find_checkout()
    if checkout is None:
        raise ConfigError("`run` needs the fuseforge source checkout (it runs workflows/*.py with pyflyte)")
    command = ["pyflyte", "run"]
    if remote:
        command += ["--remote", "--copy", "all", "-p", config.flyte.project, "-d", config.flyte.domain]
    return command + [str(checkout / WORKFLOW_FILES[workflow]), workflow, *extra]


def workflow_inputs(workflow: str) -> List[str]:
    """The input names of one of the shipped workflows (what a recipe for it may hold)."""
    from fuseforge_flyte import workflows

    return list(getattr(workflows, workflow).python_interface.inputs)


def recipe_args(workflow: str, path: str) -> List[str]:
    """The recipe at `path` as pyflyte options for `workflow`, its keys checked first."""
    from fuseforge_flyte.recipes import check_keys, pyflyte_args, read_recipe

    recipe = read_recipe(path)
    check_keys(recipe, workflow_inputs(workflow), path)
    return pyflyte_args(recipe)


def cmd_run(args: argparse.Namespace, config: PlatformConfig) -> int:
    env = {**os.environ, **_override_env(args.overrides)}
    if args.remote and config.flyte.endpoint:
        env["FLYTE_PLATFORM_URL"] = config.flyte.endpoint
        env["FLYTE_PLATFORM_INSECURE"] = str(config.flyte.insecure)
    extra = (recipe_args(args.workflow, args.recipe) if args.recipe else []) + args.workflow_args  # given ones win
    command = pyflyte_command(config, args.workflow, args.remote, extra)
    if shutil.which(command[0]) is None:
        raise ConfigError("pyflyte not found: install fuseforge with the [platform] extra")
    print("+ " + " ".join(command), file=sys.stderr)
    return subprocess.call(command, env=env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fuseforge_flyte.cli", description=__doc__.split("\n")[0])
    parser.add_argument("--config", metavar="FILE", help="platform.toml to use (default: $FUSEFORGE_CONFIG, ./platform.toml)")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one config key")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("config", help="validate and print the resolved config").set_defaults(handler=cmd_config)
    sub.add_parser("requirements", help="print the image's pip requirements").set_defaults(handler=cmd_requirements)

    build = sub.add_parser("build-image", help="build and push the training image (Docker, else buildah)")
    build.add_argument("--render", metavar="DIR", help="only write the Dockerfile and build context to DIR")
    build.add_argument("--no-push", action="store_true", help="build locally without pushing")
    build.set_defaults(handler=cmd_build_image)

    base = sub.add_parser("build-base", help="make [image].base_image here: Debian with Python, in buildah's storage")
    base.add_argument("--suite", default="bookworm", help="Debian suite (bookworm: Python 3.11, trixie: 3.13)")
    base.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror for debootstrap")
    base.add_argument("--replace", action="store_true", help="import it again even when storage holds it")
    base.set_defaults(handler=cmd_build_base)

    run = sub.add_parser("run", help="run a workflow with pyflyte (locally, or on the cluster with --remote)")
    run.add_argument("--remote", action="store_true", help="register and run on the Flyte cluster of [flyte]")
    run.add_argument("--recipe", metavar="FILE", help="the workflow's inputs from a recipe (recipes/*.yaml); "
                     "inputs given after the workflow's name win")
    run.add_argument("workflow", choices=sorted(WORKFLOW_FILES))
    run.add_argument("workflow_args", nargs=argparse.REMAINDER, help="workflow inputs, e.g. --steps 20")
    run.set_defaults(handler=cmd_run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.overrides = _global_overrides(args)
        return args.handler(args, load_config(overrides=args.overrides))
    except (ConfigError, ValueError, FileNotFoundError) as exc:  # ConfigError is a ValueError; recipes raise both
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # ImageBuildError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:  # docker build/push
        print(f"error: {' '.join(map(str, exc.cmd))} failed with exit status {exc.returncode}", file=sys.stderr)
        return exc.returncode or 1


if __name__ == "__main__":
    sys.exit(main())
