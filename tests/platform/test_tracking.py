"""Experiment tracking ([tracking] of platform.toml): TensorBoard events and W&B calls carry the engine's own
numbers, the run is closed on failure too, the config is validated, and it is off by default. The engine takes
[tracking] as TrackingSettings from whoever runs it (here: PlatformConfig.tracking_settings(), as the task does)."""

from __future__ import annotations

import math
import sys
import textwrap
import types

import pytest

from fuseforge_flyte import config as platform_config
from fuseforge_flyte.config import ConfigError, load_config
from fuseforge_flyte.training import engine, tracking
from fuseforge_flyte.training.engine import train as train_engine
from fuseforge_flyte.training.faults import FAULT_ENV, InjectedFault
from fuseforge_flyte.training.spec import TrainSpec

TINY = dict(model="tiny-llama", dataset="bench:bytes", steps=4, log_every=1, seq_len=32, batch_size=2,
            kernels=False)
TRAIN_TAGS = {"train/loss", "train/lr", "train/tokens_per_s", "train/step_time_s", "train/data_wait_fraction",
              "train/peak_memory_gib"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""


def train(spec):
    """The engine with the process's [tracking], as the Flyte task runs it."""
    return train_engine(spec, tracking_settings=platform_config.get_config().tracking_settings())


@pytest.fixture
def tracking_env(tmp_path, monkeypatch):
    """Runs in an empty directory (built-in defaults, relative log dirs land there); `set(key=value)` sets
    [tracking] keys the way a user overrides them, through FUSEFORGE__TRACKING__* variables."""
    monkeypatch.chdir(tmp_path)
    platform_config.get_config.cache_clear()

    def set_keys(**keys: str) -> None:
        for key, value in keys.items():
            monkeypatch.setenv(f"FUSEFORGE__TRACKING__{key.upper()}", value)
        platform_config.get_config.cache_clear()

    yield set_keys
    platform_config.get_config.cache_clear()


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package (not a test dependency): records every call of its API we use."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []
        self.run = types.SimpleNamespace(summary={})

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self.run

    def log(self, values, step=None):
        self.calls.append(("log", step, dict(values)))

    def finish(self, exit_code=None):
        self.calls.append(("finish", exit_code))

    def logged(self, prefix):
        return [(step, values) for name, step, values in (c for c in self.calls if c[0] == "log")
                if any(k.startswith(prefix) for k in values)]


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    # Import what probes for wandb (accelerate, via transformers) first: it would find the fake without a spec.
    import accelerate  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def test_tensorboard_events_hold_the_runs_numbers(tracking_env, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking_env(backend="tensorboard", log_dir=str(tmp_path / "tb"), run_name="tiny")
    m = train(TrainSpec(**TINY))
    events = EventAccumulator(str(tmp_path / "tb" / "tiny"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert TRAIN_TAGS <= tags
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx(m.loss_curve, rel=1e-6)  # float32 in the event file
    assert [e.value for e in events.Scalars("train/peak_memory_gib")] == pytest.approx(m.memory_gib_curve, rel=1e-6)
    summary = {tag.split("/", 1)[1]: events.Scalars(tag)[-1] for tag in tags if tag.startswith("summary/")}
    assert {"tokens_per_s", "mfu", "peak_memory_gib", "final_loss", "steps"} <= set(summary)
    assert summary["final_loss"].step == 4 and summary["final_loss"].value == pytest.approx(m.final_loss, rel=1e-6)
    assert summary["tokens_per_s"].value == pytest.approx(m.tokens_per_s, rel=1e-6)


def test_the_engine_command_line_tracks_with_platform_toml(tracking_env, tmp_path):
    """`python -m fuseforge_flyte.training` is an entry point like the task: it hands [tracking] to the engine."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fuseforge_flyte.training.cli import main

    tracking_env(backend="tensorboard", log_dir=str(tmp_path / "tb"), run_name="cli")
    args = [f"--{key}={value}" for key, value in TINY.items() if key != "kernels"] + ["--no-kernels"]
    assert main(args) == 0
    events = EventAccumulator(str(tmp_path / "tb" / "cli"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_wandb_gets_config_every_step_evals_summary_and_finish(tracking_env, fake_wandb, tmp_path):
    from fuseforge_flyte.data.prepare import prepare

    data = str(tmp_path / "chat")
    spec = TrainSpec(**dict(TINY, dataset="builtin:chat", eval_fraction=0.1, eval_every=2))
    prepare(spec.data_spec(), data)
    spec.dataset, spec.eval_fraction = data, 0.0
    tracking_env(backend="wandb", project="llm", entity="acme", mode="offline")
    m = train(spec)

    (first, init_args), *_ = fake_wandb.calls
    assert first == "init"
    assert {k: init_args[k] for k in ("project", "entity", "mode")} == {"project": "llm", "entity": "acme",
                                                                         "mode": "offline"}
    assert init_args["config"]["dataset"] == data and init_args["config"]["steps"] == 4
    assert init_args["name"].startswith("tiny-llama-")  # default run name: model and time
    steps = fake_wandb.logged("train/")
    assert [step for step, _ in steps] == [1, 2, 3, 4] and all(TRAIN_TAGS == set(v) for _, v in steps)
    assert [v["train/loss"] for _, v in steps] == m.loss_curve
    evals = fake_wandb.logged("eval/")
    assert [step for step, _ in evals] == m.eval_steps == [2, 4]
    assert [v["eval/loss"] for _, v in evals] == m.eval_loss_curve
    assert evals[-1][1]["eval/perplexity"] == pytest.approx(math.exp(m.eval_loss))
    assert fake_wandb.run.summary == {"tokens_per_s": m.tokens_per_s, "mfu": m.mfu, "peak_memory_gib":
                                      m.peak_memory_gib, "final_loss": m.final_loss, "steps": 4,
                                      "eval_loss": m.eval_loss, "eval_perplexity": m.eval_perplexity}
    assert fake_wandb.calls[-1] == ("finish", 0)
    assert sum(c[0] == "finish" for c in fake_wandb.calls) == 1


def test_a_failed_run_is_finished_as_failed(tracking_env, fake_wandb, monkeypatch):
    tracking_env(backend="wandb")
    monkeypatch.setenv(FAULT_ENV, "0:2:raise")
    with pytest.raises(InjectedFault):
        train(TrainSpec(**TINY))
    assert [step for step, _ in fake_wandb.logged("train/")] == [1, 2]
    assert fake_wandb.run.summary == {}
    assert fake_wandb.calls[-1] == ("finish", 1)


def test_a_missing_library_fails_before_training_naming_key_and_package(tracking_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed (it is not a test dependency)
    monkeypatch.setattr(engine, "_Run", lambda *a, **k: pytest.fail("training started without the library"))
    tracking_env(backend="wandb")
    with pytest.raises(tracking.TrackingUnavailable) as info:
        train(TrainSpec(**TINY))
    message = str(info.value)
    assert "[tracking].backend = 'wandb'" in message and "pip install wandb" in message
    assert message.startswith("built-in defaults (+ 1 override(s))")
    assert isinstance(info.value, ImportError)  # a permanent failure: torch elastic does not retry it


def test_only_rank_0_tracks_but_every_rank_checks_the_library(tmp_path, monkeypatch):
    config = load_config(_write_required(tmp_path), env={"FUSEFORGE__TRACKING__BACKEND": "tensorboard",
                                                         "FUSEFORGE__TRACKING__LOG_DIR": str(tmp_path / "tb")})
    assert type(tracking.start(TrainSpec(), is_main=False, settings=config.tracking_settings())) is tracking.Tracker
    assert not (tmp_path / "tb").exists()
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(tracking.TrackingUnavailable, match=r"pip install tensorboard"):
        tracking.start(TrainSpec(), is_main=False, settings=config.tracking_settings())


def test_off_by_default_writes_nothing(tracking_env, tmp_path, fake_wandb):
    assert load_config(env={}).tracking.backend == ""
    m = train(TrainSpec(**dict(TINY, steps=1)))
    assert m.steps == 1
    assert list(tmp_path.iterdir()) == [] and fake_wandb.calls == []


@pytest.mark.parametrize("body, message", [
    ('backend = "mlflow"', '[tracking].backend must be one of "", "tensorboard", "wandb", got "mlflow"'),
    ('mode = "disabled"', '[tracking].mode must be one of "online", "offline", got "disabled"'),
    ('project = " "', '[tracking].project must be a non-empty string, got " "'),
    ("log_dir = 3", "[tracking].log_dir must be a non-empty string, got 3"),
    ('logdir = "runs"', 'unknown key [tracking].logdir (known keys: backend, project, entity, run_name, log_dir, '
                        'mode); did you mean "log_dir"?'),
])
def test_bad_tracking_settings_name_file_and_key(tmp_path, body, message):
    path = tmp_path / "platform.toml"
    path.write_text(textwrap.dedent(f"""
        [image]
        registry = "ghcr.io/acme"
        [flyte]
        project = "ml"
        domain = "production"
        [tracking]
        {body}
    """))
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value) == f"{path}: {message}"


def test_override_errors_name_the_variable(tmp_path):
    with pytest.raises(ConfigError, match=r'^environment variable FUSEFORGE__TRACKING__BACKEND: \[tracking\]\.backend '
                                          r'must be one of "", "tensorboard", "wandb", got "tb"$'):
        load_config(env={"FUSEFORGE__TRACKING__BACKEND": "tb", "FUSEFORGE_CONFIG": str(_write_required(tmp_path))})


def _write_required(tmp_path):
    path = tmp_path / "platform.toml"
    path.write_text('[image]\nregistry = "ghcr.io/acme"\n[flyte]\nproject = "ml"\ndomain = "production"\n')
    return path
