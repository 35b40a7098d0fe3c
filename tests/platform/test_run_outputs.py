"""What a local run leaves and prints: the model, metrics and settings in output_dir (printed at the end), no
temporary directories, and on a clean run nothing but fuseforge's progress and summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuseforge_flyte.comparison import Comparison
from fuseforge_flyte.training.dpo import PreferenceMetrics
from fuseforge_flyte.training.spec import TrainMetrics

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = os.path.join(os.path.dirname(sys.executable), "pyflyte")
# What a third party prints that a clean run must not: warnings, deprecations, failed loads, progress bars.
NOISE = re.compile(r"warn|deprecat|failed to load|setting accelerator|it/s\]|examples/s\]|is used more than once",
                   re.IGNORECASE)


def noise_lines(text: str) -> list:
    return [line for line in text.splitlines() if NOISE.search(line)]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """`pyflyte run workflows/train.py train` as the README has it, from a fresh directory, with its own temporary
    root (so that what the run leaves there can be counted)."""
    cwd = tmp_path_factory.mktemp("run")
    temp = cwd / "tmp"
    temp.mkdir()
    env = dict(os.environ, TMPDIR=str(temp), FUSEFORGE_CACHE=str(cwd / "cache"))
    done = subprocess.run([PYFLYTE, "run", str(REPO / "workflows" / "train.py"), "train", "--steps", "2"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return cwd, temp, done


@pytest.mark.slow
def test_a_local_run_writes_model_metrics_and_settings_to_outputs(clean_run):
    cwd, _, done = clean_run
    runs = list((cwd / "outputs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("tiny-llama-")
    out = runs[0]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out / "model"))
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
    settings = json.loads((out / "settings.json").read_text())
    assert settings["steps"] == 2 and settings["output_dir"] == str(out)
    assert f"output: {out} (model/, metrics.json, settings.json)" in done.stdout  # printed at the end


@pytest.mark.slow
def test_a_finished_local_run_leaves_no_temporary_directories(clean_run):
    _, temp, _ = clean_run
    left = [name for name in os.listdir(temp) if not name.startswith("torchinductor_")]  # torch's compile cache
    assert left == []


@pytest.mark.slow
def test_a_clean_run_prints_no_warnings(clean_run):
    _, _, done = clean_run
    assert noise_lines(done.stdout + done.stderr) == []
    assert "MFU n/a" in done.stdout and "MFU 0.0" not in done.stdout


def test_the_summary_names_the_output_once():
    metrics = TrainMetrics(model="tiny-llama", model_dir="/r/model", output_dir="/r")
    text = str(metrics)
    assert "output: /r (model/, metrics.json, settings.json)" in text and text.count("/r/model") == 0
    assert "MFU n/a" in text


def test_compare_reads_in_the_order_it_names():
    text = str(Comparison(with_kernels=TrainMetrics(tokens_per_s=200.0), without_kernels=TrainMetrics(tokens_per_s=100.0)))
    assert text.startswith("without -> with fuseforge kernels")
    assert "tokens/s 100 -> 200" in text


def test_the_dpo_summary_is_readable():
    preference = PreferenceMetrics(loss_type="sigmoid", reference_model="tiny-llama", fused_loss=True,
                                   reward_accuracy=0.75, reward_margin=0.1234, accuracy_curve=[0.5] * 50,
                                   margin_curve=[0.01] * 50, eval_reward_accuracy=0.7, eval_reward_margin=0.1)
    text = repr(preference)
    assert text == ("reward accuracy 0.75   reward margin 0.1234   eval reward accuracy 0.70   eval reward margin "
                    "0.1000   loss sigmoid (fused loss)   reference tiny-llama")
    assert "[" not in text  # the curves stay in the typed outputs and the Deck


@pytest.mark.slow
def test_the_demo_settings_teach_the_tiny_model_to_answer(tmp_path, capsys, monkeypatch):
    """The demo's default steps and learning rate, in one process with the same global batch (2 workers x 4 rows)
    and the kernels off (the same math; tests/kernels check the kernels against it), so that it takes seconds:
    the answers differ per question and at least two of the three are right."""
    from fuseforge_flyte.sampling import generate
    from fuseforge_flyte.training import cli
    from fuseforge_flyte.workflows import DEMO_EXPECTED, DEMO_LR, DEMO_PROMPTS, DEMO_STEPS

    monkeypatch.setenv("FUSEFORGE_CACHE", str(tmp_path / "cache"))
    assert cli.main(["--model", "tiny-llama", "--dataset", "builtin:chat", "--steps", str(DEMO_STEPS),
                     "--batch_size", "8", "--seq_len", "128", "--lr", str(DEMO_LR), "--warmup_steps", "5",
                     "--eval_fraction", "0.1", "--dtype", "fp32", "--no_kernels", "--log_level", "WARNING",
                     "--output_dir", str(tmp_path / "demo")]) == 0
    answers = generate(str(tmp_path / "demo" / "model"), DEMO_PROMPTS)
    assert len(set(answers)) == len(answers), answers
    right = [expected in answer for expected, answer in zip(DEMO_EXPECTED, answers)]
    assert sum(right) >= 2, list(zip(DEMO_PROMPTS, answers))


def test_dpo_logs_the_engines_step_line_instead_of_trls_dict(caplog):
    from types import SimpleNamespace

    from fuseforge_flyte.training.dpo import preference_callback

    callback = preference_callback()
    state = SimpleNamespace(is_world_process_zero=True, global_step=3, max_steps=20, num_input_tokens_seen=1024)
    logs = {"loss": 0.6931, "learning_rate": 1e-3, "rewards/accuracies": 0.75, "rewards/margins": 0.0123,
            "logps/chosen": [-1.0] * 40}
    with caplog.at_level("INFO", logger="fuseforge.training"):
        callback.on_log(None, state, None, logs=logs)
    assert caplog.messages == ["step 3/20 loss 0.6931 reward accuracy 0.75 margin 0.0123 lr 0.001 | mem "
                               + caplog.messages[0].split("| mem ")[1]]
    assert callback.accuracy == [0.75] and callback.margin == [0.0123]
