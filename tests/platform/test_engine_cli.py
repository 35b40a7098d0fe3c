"""The engine's command line, as the README shows it: options spelled like the workflows' with help and choices,
and stdout that holds the metrics JSON alone."""

from __future__ import annotations

import json
import os

import pytest

from fuseforge_flyte.training import cli
from fuseforge_flyte.training import engine

TINY = ["--model", "tiny-mistral", "--steps", "2", "--seq_len", "16", "--batch_size", "2", "--no_kernels",
        "--dataset", "bench:synthetic", "--log_level", "WARNING"]


def test_options_are_spelled_like_the_workflows_with_help_and_choices():
    help_text = cli.build_parser().format_help()
    for option in ("--batch_size", "--seq_len", "--grad_accum", "--eval_every", "--output_dir", "--recipe"):
        assert option in help_text
    assert "--batch-size" not in help_text
    assert "--strategy {ddp,fsdp,deepspeed}" in help_text and "--dtype {fp32,bf16,fp16}" in help_text
    assert "sequences per device per micro-batch" in help_text  # the field's own help
    assert cli.build_parser().parse_args(["--no_kernels"]).kernels is False


def test_stdout_holds_the_metrics_json_alone(capfd, monkeypatch):
    """DeepSpeed's logger writes to stdout (file descriptor 1) from inside training: it lands on stderr."""
    train = engine.train

    def noisy_train(spec, **options):  # options: what the CLI hands the engine ([tracking])
        os.write(1, b"[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.\n")
        print("a library's print")
        return train(spec, **options)

    monkeypatch.setattr(engine, "train", noisy_train)
    assert cli.main(TINY) == 0
    out, err = capfd.readouterr()
    assert out.lstrip().startswith("{"), (out[:300], err[-300:])
    metrics = json.loads(out)  # nothing but the JSON
    assert metrics["steps"] == 2
    assert "Setting accelerator to CPU" in err and "a library's print" in err


def test_output_dir_receives_model_metrics_and_settings(tmp_path, capsys):
    assert cli.main(TINY + ["--output_dir", str(tmp_path / "run")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["output_dir"] == str(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["model"] == "tiny-mistral"
    assert (tmp_path / "run" / "model" / "config.json").exists()


def test_a_user_error_is_one_line_and_verbose_raises(capsys):
    assert cli.main(["--model", "tiny-lama"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: --model: unknown model 'tiny-lama': did you mean 'tiny-llama'?"
    assert err[-2].startswith("full traceback: ") and "(--verbose prints it)" in err[-2]
    with pytest.raises(ValueError, match="did you mean 'tiny-llama'"):
        cli.main(["--model", "tiny-lama", "--verbose"])
