"""Bad input as a user meets it: one line naming the option and its fix, found before any worker starts, in
seconds, and never retried.

The in-process tests call what the tasks call; the pyflyte ones run the README's commands and read the last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fuseforge_flyte import hub
from fuseforge_flyte.data.prepare import prepare
from fuseforge_flyte.data.sources import load_source
from fuseforge_flyte.training.spec import TrainSpec
from fuseforge_flyte.user_errors import user_error_line

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = os.path.join(os.path.dirname(sys.executable), "pyflyte")


def _rows(n: int) -> list:
    return [json.dumps({"prompt": f"What is {i} plus {i}?", "completion": f"{2 * i}."}) for i in range(n)]


# ---------------------------------------------------------------- the one line


def test_a_task_error_becomes_one_line_naming_the_option():
    """flytekit prefixes a task's exception (the same object) with the task's name; the library error it was raised
    from is detail. The line is ours, with TrainSpec.x / DataSpec.x named as the option --x."""
    try:
        try:
            raise KeyError("pyarrow detail")
        except KeyError as cause:
            raise ValueError("DataSpec.dataset: data.jsonl, line 3: not valid JSON; fix or remove that line") from cause
    except ValueError as err:
        err.args = ("Error encountered while executing 'fuseforge_flyte.tasks.prepare_data':\n  " + err.args[0],)
        assert user_error_line(err) == "--dataset: data.jsonl, line 3: not valid JSON; fix or remove that line"
    assert user_error_line(RuntimeError("a bug")) is None  # not a user error: pyflyte prints it as always


def test_a_workers_permanent_failure_becomes_its_recorded_error():
    from fuseforge_flyte.training.permanent import PermanentFailure

    verdict = PermanentFailure("a worker failed in a way that a restart cannot fix (not retried):\nrank 0: "
                               "ResumeMismatch: checkpoint /c/step_2 was written by a run with different settings: "
                               "lr: 0.0003 -> 0.001. To continue with the new values on purpose set "
                               "resume_allow_changes='lr'")
    verdict.args = ("Error encountered while executing 'fuseforge_flyte.tasks.train_model':\n  " + verdict.args[0],)
    assert user_error_line(verdict) == ("checkpoint /c/step_2 was written by a run with different settings: lr: "
                                        "0.0003 -> 0.001. To continue with the new values on purpose set "
                                        "resume_allow_changes='lr'")


def test_unknown_model_suggests_the_preset():
    with pytest.raises(ValueError, match=r"TrainSpec.model: unknown model 'tiny-lama': did you mean 'tiny-llama'\?"):
        TrainSpec(model="tiny-lama").validate()


def test_broken_json_line_is_named_by_its_line_number(tmp_path):
    rows = _rows(40)
    rows[35] = '{"prompt": "broken'  # line 36 of the file ("row 35" in datasets' words)
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=rf"DataSpec.dataset: {path}, line 36: not valid JSON .*fix or remove"):
        load_source(str(path), cache_dir=str(tmp_path / "cache"))


def test_non_utf8_bytes_are_named_by_file_and_line(tmp_path):
    rows = [r.encode() for r in _rows(40)]
    rows[20] = b'{"prompt": "caf\xe9", "completion": "x"}'  # Latin-1
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(ValueError, match=rf"DataSpec.dataset: {path}, line 21: not UTF-8 text .*save the file as UTF-8"):
        load_source(str(path), cache_dir=str(tmp_path / "cache"))


# ---------------------------------------------------------------- no hub, no waiting


@pytest.fixture
def unreachable_hub(tmp_path, monkeypatch):
    """A hub endpoint nothing listens on and an empty HF cache; the probe's verdict is asked afresh."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_reachable", None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", datasets_config.HF_HUB_OFFLINE)


@pytest.mark.parametrize("option, load", [
    ("model", lambda: __import__("fuseforge_flyte.model_names", fromlist=["x"]).load_config("acme/not-cached")),
    ("tokenizer", lambda: __import__("fuseforge_flyte.data.tokenizer", fromlist=["x"]).load_tokenizer(
        "acme/not-cached", "tiny-llama")),
    ("dataset", lambda: load_source("acme/not-cached")),
])
def test_unreachable_hub_fails_in_seconds_naming_the_input(unreachable_hub, option, load):
    start = time.perf_counter()
    with pytest.raises(ValueError) as raised:
        load()
    elapsed = time.perf_counter() - start
    assert f"--{option}: 'acme/not-cached' is a Hugging Face hub" in str(raised.value)
    assert "cannot be reached (http://127.0.0.1:9 did not answer within 3 s)" in str(raised.value)
    assert "give a local path" in str(raised.value)
    assert elapsed < 10, f"{elapsed:.1f} s to fail"
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # what follows in this process reads the cache, never retries


# ---------------------------------------------------------------- checks before any worker starts


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A 35-row prompt/completion set, prepared: 4 packed rows of 128 tokens (the issue's example)."""
    root = tmp_path_factory.mktemp("small")
    (root / "small.jsonl").write_text("\n".join(_rows(35)) + "\n")
    out = str(root / "prepared")
    prepare(TrainSpec(model="tiny-llama", dataset=str(root / "small.jsonl"), seq_len=128).data_spec(), out)
    return out


def test_a_dataset_too_small_for_one_global_step_shrinks_the_batch_with_a_message(small_data, caplog):
    from fuseforge_flyte.training.training_data import fit_batch_to_data

    spec = TrainSpec(model="tiny-llama", dataset=small_data, seq_len=128, batch_size=4)
    with caplog.at_level("WARNING", logger="fuseforge.training"):
        assert fit_batch_to_data(spec, world_size=2) == 2
    assert "holds 4 training sequences" in caplog.text and "2 workers x batch_size 4 x grad_accum 1 = 8" in caplog.text
    assert "training with batch_size 2 (global batch 4)" in caplog.text
    with pytest.raises(ValueError, match=r"holds 4 training sequences .* 2 workers x batch_size 4 x grad_accum 4 = "
                                         r"32 needs, even with batch_size 1 \(8\)"):
        fit_batch_to_data(TrainSpec(model="tiny-llama", dataset=small_data, seq_len=128, grad_accum=4), world_size=2)


def test_eval_every_without_eval_data_is_refused_for_prepared_data(small_data):
    """The task gets the prepared directory and the workflow's eval settings: checked there, before workers."""
    with pytest.raises(ValueError, match=r"TrainSpec.eval_every=5 needs eval data: set eval_fraction"):
        TrainSpec(model="tiny-llama", dataset=small_data, seq_len=128, eval_every=5).validate()


def test_a_resume_settings_mismatch_is_not_retried():
    from fuseforge_flyte.training import permanent
    from fuseforge_flyte.training.checkpoint import ResumeMismatch

    assert permanent.is_permanent(ResumeMismatch("checkpoint step_4 was written by a run with different settings"))


def test_a_resume_settings_mismatch_is_found_before_any_worker_starts(small_data, monkeypatch, tmp_path):
    """A checkpoint_dir written with lr 1e-3, resumed with lr 2e-3: one error in the launching process (run_local
    and the training task's launcher), naming the setting and the opt-in; the same settings pass the check."""
    from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

    from fuseforge_flyte.tasks import train_model
    from fuseforge_flyte.training import local
    from fuseforge_flyte.training.checkpoint import ResumeMismatch, check_resume_settings
    from fuseforge_flyte.training.engine import train

    run = dict(model="tiny-llama", dataset=small_data, seq_len=128, batch_size=2, steps=2, lr=1e-3,
               checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1)
    train(TrainSpec(**run))
    check_resume_settings(TrainSpec(**run))  # the same settings: nothing to say
    check_resume_settings(TrainSpec(**dict(run, lr=2e-3, resume_allow_changes="lr")))  # an allowed change
    launches = []
    monkeypatch.setattr(local, "launch_local", lambda *a, **k: launches.append(a))
    monkeypatch.setattr(PytorchElasticFunctionTask, "execute", lambda self, **inputs: launches.append(inputs))
    expected = r"different settings: lr: 0\.001 -> 0\.002\. .*resume_allow_changes='lr'"
    with pytest.raises(ResumeMismatch, match=expected):
        local.run_local(TrainSpec(**dict(run, lr=2e-3)), 2)
    task_inputs = {k: v for k, v in run.items() if k != "dataset"}
    with pytest.raises(ResumeMismatch, match=expected):
        train_model(data=small_data, output_dir=str(tmp_path / "out"), **dict(task_inputs, lr=2e-3))
    with pytest.raises(ResumeMismatch, match=r"at step 2, beyond this run's steps=1"):
        local.run_local(TrainSpec(**dict(run, steps=1)), 2)
    assert launches == []


def test_too_small_data_fails_in_the_launcher_before_any_worker_starts(small_data, monkeypatch, tmp_path):
    """The training task's launcher decides the batch from the data: no worker process is started for a run
    that cannot make one step."""
    from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

    from fuseforge_flyte.tasks import train_model

    launches = []

    def launch(self, **inputs):
        launches.append(inputs)
        raise RuntimeError("workers launched")

    monkeypatch.setattr(PytorchElasticFunctionTask, "execute", launch)
    run = dict(data=small_data, model="tiny-llama", seq_len=128, steps=1, output_dir=str(tmp_path / "out"))
    with pytest.raises(Exception, match=r"even with batch_size 1"):
        train_model(grad_accum=4, **run)
    assert launches == []
    with pytest.raises(Exception, match="workers launched"):
        train_model(batch_size=4, **run)  # fits once the batch is shrunk
    assert len(launches) == 1 and launches[0]["batch_size"] == 2


# ---------------------------------------------------------------- pyflyte, as a user runs it


def _pyflyte(tmp_path, *args, timeout=300):
    env = dict(os.environ, FUSEFORGE_CACHE=str(tmp_path / "cache"), HF_ENDPOINT="http://127.0.0.1:9")
    start = time.perf_counter()
    done = subprocess.run([PYFLYTE, "run", str(REPO / "workflows" / "train.py"), "train", "--steps", "1", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.parametrize("args, last_line", [
    (["--model", "tiny-lama"], "error: --model: unknown model 'tiny-lama': did you mean 'tiny-llama'?"),
    (["--model", "acme/not-cached"], "error: --model: 'acme/not-cached' is a Hugging Face hub model id, but the hub "
                                     "cannot be reached"),
])
def test_pyflyte_ends_a_user_error_with_one_line(tmp_path, args, last_line):
    done, _ = _pyflyte(tmp_path, *args)
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines[-1].startswith(last_line), lines[-3:]
    assert lines[-2].startswith("full traceback: ") and "pyflyte --verbose run" in lines[-2]
    assert not any("Traceback" in line or line.startswith("│") for line in lines), lines  # no rich traceback
    log_file = lines[-2].split()[2]
    assert "Traceback (most recent call last)" in Path(log_file).read_text()


@pytest.mark.slow
def test_a_worker_found_error_ends_with_one_line_and_no_worker_traceback(tmp_path, monkeypatch):
    """An OOM in the first step, found by a worker: torch elastic's copy of the worker's traceback goes to a log
    file that one line names; the run ends with the error line, no traceback above it."""
    monkeypatch.setenv("FUSEFORGE_FAULT_INJECT", "1:1:oom")
    done, _ = _pyflyte(tmp_path, "--batch_size", "2")
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines[-1].startswith("error: out of memory in the first step of training tiny-llama"), lines[-3:]
    noise = [line for line in lines if "Traceback" in line or line.startswith(("│", "E1", "W1"))]
    assert not noise, noise
    reports = [line for line in lines if "torch elastic's report with its traceback:" in line]
    assert len(reports) == 1, lines
    assert "Traceback (most recent call last)" in Path(reports[0].split()[-1]).read_text()
