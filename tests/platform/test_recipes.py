"""recipes/: every shipped recipe names only its workflow's inputs, runs for a few steps, and a typo in one is
named with the key it was meant to be; platform.toml's [training] holds the same keys as the train workflow."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuseforge_flyte import cli as platform_cli
from fuseforge_flyte.config import TrainingDefaults
from fuseforge_flyte.recipes import check_keys, pyflyte_args, read_recipe
from fuseforge_flyte.training import cli as engine_cli

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
# The training engine runs these workflows' recipes; dpo has its own trainer.
ENGINE_WORKFLOWS = ("train", "distill")


def workflow_of(recipe: Path) -> str:
    first = recipe.read_text().splitlines()[0]
    match = re.fullmatch(r"# workflow: (\w+)", first)
    assert match, f"{recipe.name}: the first line names its workflow (# workflow: train)"
    return match.group(1)


def test_the_recipes_the_issue_asks_for_are_shipped():
    names = {r.name for r in RECIPES}
    assert {"sft-chat.yaml", "pretrain-text.yaml", "dpo.yaml", "distill.yaml", "llama3-8b-gpu.yaml"} <= names
    assert {workflow_of(r) for r in RECIPES} == {"train", "distill", "dpo"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_key_is_an_input_of_its_workflow(recipe):
    keys = read_recipe(str(recipe))
    check_keys(keys, platform_cli.workflow_inputs(workflow_of(recipe)), str(recipe))
    assert all(value is not False for value in keys.values()), \
        "pyflyte --inputs-file drops false booleans: a recipe states only what it turns on"


def test_platform_toml_training_holds_the_train_workflows_keys():
    """Recipes and [training] speak one language: every train input is a [training] key (or [checkpoint]'s)."""
    checkpoint = {"checkpoint_dir", "checkpoint_every", "keep_last", "allow_unsigned_checkpoints"}
    assert set(platform_cli.workflow_inputs("train")) - checkpoint == set(TrainingDefaults.model_fields)


def test_a_typo_in_a_recipe_is_named_with_a_suggestion(tmp_path, capsys):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("model: tiny-llama\nstpes: 3\n")
    with pytest.raises(ValueError, match=r"typo.yaml: unknown key 'stpes': did you mean 'steps'\?"):
        check_keys(read_recipe(str(recipe)), platform_cli.workflow_inputs("train"), str(recipe))
    assert engine_cli.main(["--recipe", str(recipe)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"error: --recipe: {recipe}: unknown key 'stpes': did you mean 'steps'?"
    assert platform_cli.main(["run", "--recipe", str(recipe), "train"]) == 2
    assert "unknown key 'stpes': did you mean 'steps'?" in capsys.readouterr().err


def test_recipes_become_pyflyte_options_and_given_options_win(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny-llama\nlr: 3e-4\npacking: false\nsteps: 9\n")
    assert pyflyte_args(read_recipe(str(recipe))) == ["--model", "tiny-llama", "--lr", "3e-4", "--no_packing",
                                                     "--steps", "9"]
    ran = []
    monkeypatch.setattr(platform_cli.subprocess, "call", lambda command, env: ran.append(command) or 0)
    monkeypatch.setattr(platform_cli.shutil, "which", lambda name: name)
    assert platform_cli.main(["run", "--recipe", str(recipe), "train", "--steps", "2"]) == 0
    assert ran[0][-2:] == ["--steps", "2"] and ran[0].index("--model") < ran[0].index("--steps")


# Each engine recipe for a few steps on the CPU: its own settings but the model (hub ids are not reachable in
# tests) and what a CPU step needs small.
CPU_OVERRIDES = ["--model", "tiny-llama", "--steps", "2", "--seq_len", "64", "--batch_size", "1", "--grad_accum",
                 "1", "--dtype", "fp32", "--eval_every", "0", "--log_level", "WARNING"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [r for r in RECIPES if workflow_of(r) in ENGINE_WORKFLOWS], ids=lambda p: p.name)
def test_each_engine_recipe_trains_a_few_steps(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FUSEFORGE_CACHE", str(tmp_path / "cache"))
    extra = ["--teacher", "tiny-llama"] if workflow_of(recipe) == "distill" else []
    rc = engine_cli.main(["--recipe", str(recipe), *CPU_OVERRIDES, *extra, "--output_dir", str(tmp_path / "out")])
    assert rc == 0
    metrics = json.loads(capsys.readouterr().out)
    recipe_values = read_recipe(str(recipe))
    assert metrics["steps"] == 2 and len(metrics["loss_curve"]) == 2
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    kept = {k: v for k, v in recipe_values.items() if f"--{k}" not in CPU_OVERRIDES + extra}
    assert {k: settings[k] for k in kept} == {k: (float(v) if isinstance(settings[k], float) else v)
                                              for k, v in kept.items()}  # the recipe's own values ran


@pytest.mark.slow
def test_the_dpo_recipe_runs_a_few_steps(tmp_path, monkeypatch):
    """Through the local dpo workflow (reference task, then the policy's workers), as pyflyte runs it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FUSEFORGE_CACHE", str(tmp_path / "cache"))
    from fuseforge_flyte.workflows import dpo

    values = dict(read_recipe(str(REPO / "recipes" / "dpo.yaml")), model="tiny-llama", steps=2, max_length=64,
                  batch_size=2, grad_accum=1, lr=1e-3, output_dir=str(tmp_path / "dpo"))
    out = dpo(**values)
    assert out.metrics.steps == 2 and out.preference.loss_type == "sigmoid"
    assert (tmp_path / "dpo" / "model" / "config.json").exists()
