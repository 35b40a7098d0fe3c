"""Users' own training code on the platform: @training_task, the metrics helpers and the examples.

The examples (examples/flyte/) run through Flyte locally with 2 elastic workers (gloo, kernels interpreted
on the CPU), imported as `pyflyte run` imports a loose file; the task serialization is decoded from the
protobufs, in process and through the real `pyflyte package` CLI.
"""

from __future__ import annotations

import glob
import importlib
import json
import math
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from flyteidl.admin.task_pb2 import TaskSpec
from flyteidl.plugins.kubeflow.pytorch_pb2 import DistributedPyTorchTrainingTask
from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.core.context_manager import FlyteContextManager
from flytekit.tools.module_loader import add_sys_path
from flytekit.tools.translator import get_serializable
from flytekit.types.file import FlyteFile
from google.protobuf.json_format import MessageToDict, ParseDict

from fuseforge_flyte import training_task
from fuseforge_flyte.config import RESOLVED_CONFIG_ENV, ConfigError, load_config
from fuseforge_flyte.measure import StepMeter
from fuseforge_flyte.training.spec import TrainMetrics

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "flyte"
CUDA = torch.cuda.is_available()
WORKERS = min(2, torch.cuda.device_count()) if CUDA else 2  # [elastic].local_nproc_per_node, capped at the GPUs
STEPS, BATCH, SEQ_LEN = 3, 2, 64

BASE_CONFIG = """
[image]
registry = "registry.example.com/ml"
tag = "v1"
[flyte]
project = "p"
domain = "d"
[cluster]
gpus = 8
cpu = "32"
memory = "256Gi"
shared_memory = "64Gi"
tolerations = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
[elastic]
nnodes = 1
max_restarts = 2
"""


# ------------------------------------------------------------------------------------------ helpers


def config_from(tmp_path: Path, text: str = BASE_CONFIG):
    path = tmp_path / "platform.toml"
    path.write_text(textwrap.dedent(text))
    return load_config(path, env={})


def template_of(entity) -> dict:
    """The serialized task template as JSON-shaped data (what `pyflyte register` uploads)."""
    settings = SerializationSettings(image_config=ImageConfig.auto_default_image())
    return MessageToDict(get_serializable(OrderedDict(), settings, entity).template.to_flyte_idl())


def pod_container(template: dict) -> dict:
    return template["k8sPod"]["podSpec"]["containers"][0] if "k8sPod" in template else template["container"]


def env_of(container: dict) -> dict:
    return {e["key"] if "key" in e else e["name"]: e["value"] for e in container.get("env", [])}


def my_training(steps: int) -> TrainMetrics:
    """A user's function (module level, as Flyte needs)."""
    return TrainMetrics(steps=steps)


def file_probe(notes: FlyteFile, data: str) -> str:
    """What one worker sees of its inputs and launch (module level: the spawned workers import it)."""
    with open(notes.download(), encoding="utf-8") as fh:
        text = fh.read()
    env = os.environ
    return f"{env['RANK']}/{env['WORLD_SIZE']} {text} {data} interpret={env.get('TRITON_INTERPRET')}"


def load_example(name: str):
    """Import an example as `pyflyte run` does: its directory is on sys.path only while importing, so the
    spawned workers can import it only because the task makes it importable."""
    with add_sys_path(str(EXAMPLES)):
        module = importlib.import_module(name)
    assert str(EXAMPLES) not in sys.path
    return module


def decks_written_since(start: float) -> list[str]:
    sandbox = FlyteContextManager.current_context().file_access.local_sandbox_dir
    found = glob.glob(os.path.join(sandbox, "**", "deck.html"), recursive=True)
    return [open(p, encoding="utf-8").read() for p in found if os.path.getmtime(p) >= start]


def step_tokens(m: TrainMetrics) -> list[int]:
    """Global tokens of each step, back from the tokens/s and step-time curves."""
    return [round(tps * t) for tps, t in zip(m.tokens_per_s_curve, m.step_time_curve)]


def assert_real_run(m: TrainMetrics, losses: int = STEPS) -> None:
    assert isinstance(m, TrainMetrics)
    assert (m.steps, m.world_size, m.kernels) == (STEPS, WORKERS, True)
    assert m.kernels_patched, "the example applies the kernels: the report must list them"
    assert m.tokens_per_s > 0 and m.samples_per_s > 0 and m.peak_memory_gib > 0
    assert 0 < m.step_time_p50_s <= m.step_time_p90_s <= m.step_time_p99_s
    assert m.num_params > 0 and m.flops_per_token > 6 * m.num_params * 0.5
    assert len(m.loss_curve) == losses and all(math.isfinite(x) for x in m.loss_curve)
    assert m.final_loss == pytest.approx(m.loss_curve[-1])
    for curve in (m.tokens_per_s_curve, m.step_time_curve, m.memory_gib_curve):
        assert len(curve) == STEPS
    # the warm-up (first) step is left out of the throughput
    steady = sum(step_tokens(m)[1:]) / sum(m.step_time_curve[1:])
    assert m.tokens_per_s == pytest.approx(steady, rel=1e-6)


@pytest.fixture(scope="module")
def short_chats(tmp_path_factory):
    """WORKERS x BATCH x STEPS conversations that fit SEQ_LEN untruncated (one epoch exactly: every one is
    seen once), and their token count under the tokenizer's chat template, counted here independently."""
    from fuseforge_flyte.data.builtin import CHAT_FILE, asset_path
    from fuseforge_flyte.data.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:tiny-bpe", "")
    chosen, tokens = [], 0
    with open(asset_path(CHAT_FILE), encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            n = len(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
            if n <= SEQ_LEN:
                chosen.append(line)
                tokens += n
            if len(chosen) == WORKERS * BATCH * STEPS:
                break
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(chosen))
    return str(path), tokens


# ------------------------------------------------------------------------------------------ the examples


@pytest.mark.slow
def test_trainer_example_runs_on_two_workers_and_counts_the_tokens_seen(short_chats):
    path, expected_tokens = short_chats
    example = load_example("trainer_sft")
    start = time.time()
    m = example.sft_workflow(dataset=path, steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN)
    assert_real_run(m)
    assert (m.model, m.dataset, m.strategy) == ("tiny-llama", path, "ddp")
    assert sum(step_tokens(m)) == expected_tokens  # every conversation once, over both ranks, no padding
    decks = [d for d in decks_written_since(start) if "Training metrics" in d and path in d]  # this run's
    assert decks, "rank 0 added no Training metrics Deck"
    assert "data:image/png;base64," in decks[0]


@pytest.mark.slow
def test_trl_example_runs_on_two_workers_and_counts_the_tokens_seen(short_chats):
    pytest.importorskip("trl")
    path, expected_tokens = short_chats
    example = load_example("trl_sft")
    m = example.trl_workflow(dataset=path, steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN)
    assert_real_run(m)
    assert sum(step_tokens(m)) == expected_tokens


@pytest.mark.slow
def test_plain_pytorch_example_runs_on_two_workers_and_counts_the_tokens_seen():
    example = load_example("torch_loop")
    m = example.pretrain_workflow(steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN)
    assert_real_run(m)
    # packed full rows: each step sees batch x seq_len tokens on each rank
    assert step_tokens(m) == [WORKERS * BATCH * SEQ_LEN] * STEPS
    assert m.tokens_per_step == WORKERS * BATCH * SEQ_LEN
    assert m.loss_tokens_per_step == WORKERS * BATCH * (SEQ_LEN - 1)


@pytest.mark.slow
def test_registered_multi_node_task_runs_locally_as_one_node_with_its_inputs(tmp_path, monkeypatch):
    """Registered for 3 nodes x 8 GPUs; locally one node of local_nproc_per_node workers. A file input reaches
    every worker, and an input named `data` need not be a directory (the built-in task's is)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    config = config_from(tmp_path, BASE_CONFIG.replace("nnodes = 1", "nnodes = 3"))
    probe = training_task(config=config, rdzv_timeout=60, rdzv_join_timeout=60)(file_probe)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest sets it; the task must do so itself
    expected = f"0/{WORKERS} hello plain text interpret={None if CUDA else 1}"
    assert probe(notes=FlyteFile(str(notes)), data="plain text") == expected
    assert probe.task_config.nnodes == 3 and probe.task_config.nproc_per_node == 8  # registration unchanged


# ------------------------------------------------------------------------------------------ StepMeter


def test_step_meter_counts_non_padding_tokens_and_leaves_out_the_warmup_step():
    model = torch.nn.Linear(4, 4)
    meter = StepMeter(model, dataset="d", model_name="m")
    masks = [torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]),
             torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]])]
    for i, mask in enumerate(masks):
        labels = torch.where(mask.bool(), torch.ones_like(mask), torch.full_like(mask, -100))
        time.sleep(0.01 * (i + 1))
        meter.step(loss=torch.tensor(3.0 - i), batch={"input_ids": torch.ones_like(mask), "attention_mask": mask,
                                                       "labels": labels})
    m = meter.metrics()
    assert step_tokens(m) == [5, 5, 8]
    assert (m.steps, m.world_size, m.model, m.dataset, m.kernels) == (3, 1, "m", "d", False)
    assert m.loss_curve == [3.0, 2.0, 1.0] and m.final_loss == 1.0
    assert m.tokens_per_s == pytest.approx((5 + 8) / sum(m.step_time_curve[1:]))
    assert m.samples_per_s == pytest.approx(4 / sum(m.step_time_curve[1:]))
    assert m.loss_tokens_per_step == pytest.approx((3 + 3 + 6) / 3)  # labels after the causal shift
    assert m.flops_per_token == 6 * m.num_params  # not a causal LM: 6 x parameters


def test_step_meter_refuses_unclear_input():
    meter = StepMeter()
    with pytest.raises(ValueError, match="batch=... or tokens=..."):
        meter.step(tokens=3, batch={"input_ids": torch.ones(1, 3)})
    with pytest.raises(ValueError, match="neither input_ids nor attention_mask"):
        meter.step(batch={"labels": torch.ones(1, 3)})
    with pytest.raises(ValueError, match="no step recorded"):
        meter.metrics()
    with pytest.raises(ValueError, match="dtype"):
        StepMeter(dtype="float32")


# ------------------------------------------------------------------------------------------ serialization


def test_decorator_registers_platform_toml_settings(tmp_path):
    config = config_from(tmp_path)
    t = template_of(training_task(config=config)(my_training))
    assert t["type"] == "python-task"  # nnodes = 1: one pod, no training operator
    container = pod_container(t)
    assert container["resources"]["requests"] == {"gpu": "8", "cpu": "32", "memory": "256Gi"}
    assert container["resources"]["limits"] == {"gpu": "8", "memory": "256Gi"}
    assert t["k8sPod"]["podSpec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                      "effect": "NoSchedule"}]
    assert t["extendedResources"]["sharedMemory"]["sizeLimit"] == "64Gi"
    assert container["image"] == "registry.example.com/ml/fuseforge:v1"
    assert container["args"][-2:] == ["task-name", "my_training"]  # resolved by the user's function name
    assert t["metadata"]["generatesDeck"] is True
    assert load_config(env={RESOLVED_CONFIG_ENV: env_of(container)[RESOLVED_CONFIG_ENV]}) == config


def test_decorator_overrides_reach_the_registered_pytorchjob(tmp_path):
    config = config_from(tmp_path)
    decorated = training_task(
        config=config, gpus=4, nnodes=2, cpu=48, memory="500Gi", shared_memory="32Gi", max_restarts=1,
        accelerator="nvidia-h200", node_selector={"pool": "train"}, retries=3, image="ghcr.io/acme/train:v7",
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}],
        environment={"HF_HOME": "/cache/hf"}, timeout=3600,
    )(my_training)
    t = template_of(decorated)
    assert t["type"] == "pytorch"
    job = ParseDict(t["custom"], DistributedPyTorchTrainingTask())
    assert (job.elastic_config.min_replicas, job.elastic_config.max_replicas) == (2, 2)
    assert job.elastic_config.nproc_per_node == 4  # follows gpus, as platform.toml's default does
    assert job.elastic_config.max_restarts == 1 and job.worker_replicas.replicas == 2
    pod = t["k8sPod"]["podSpec"]
    container = pod_container(t)
    assert container["resources"]["requests"] == {"gpu": "4", "cpu": "48", "memory": "500Gi"}
    assert container["resources"]["limits"] == {"gpu": "4", "memory": "500Gi"}
    assert pod["nodeSelector"] == {"pool": "train"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}]
    assert t["extendedResources"]["sharedMemory"]["sizeLimit"] == "32Gi"
    assert t["extendedResources"]["gpuAccelerator"]["device"] == "nvidia-h200"
    assert t["metadata"]["retries"]["retries"] == 3 and t["metadata"]["timeout"] == "3600s"
    assert container["image"] == "ghcr.io/acme/train:v7"
    env = env_of(container)
    assert env["HF_HOME"] == "/cache/hf"
    carried = load_config(env={RESOLVED_CONFIG_ENV: env[RESOLVED_CONFIG_ENV]})  # the pod launches as registered
    assert (carried.cluster.gpus, carried.elastic.nnodes, carried.elastic.nproc_per_node) == (4, 2, 4)
    # the platform-wide config is untouched: other tasks keep platform.toml's settings
    assert template_of(training_task(config=config)(my_training))["type"] == "python-task"


@pytest.mark.slow
def test_pyflyte_package_of_an_example_file_offline(tmp_path):
    """The real CLI path on a user's loose file: `pyflyte package` with a multi-node platform.toml."""
    (tmp_path / "platform.toml").write_text(textwrap.dedent(BASE_CONFIG).replace("nnodes = 1", "nnodes = 3"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEFORGE")}
    env["FUSEFORGE_CONFIG"] = str(tmp_path / "platform.toml")
    out = tmp_path / "pkg.tgz"
    result = subprocess.run(
        [str(Path(sys.executable).with_name("pyflyte")), "--pkgs", "torch_loop", "package",
         "--image", "ghcr.io/flyteorg/flytekit:py3.11-latest", "-o", str(out), "--force"],
        cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with tarfile.open(out) as tar:
        member = next(n for n in tar.getnames() if n.endswith("torch_loop.pretrain_1.pb"))
        spec = TaskSpec()
        spec.ParseFromString(tar.extractfile(member).read())
    t = MessageToDict(spec.template)
    assert t["type"] == "pytorch"
    elastic = ParseDict(t["custom"], DistributedPyTorchTrainingTask()).elastic_config
    assert (elastic.min_replicas, elastic.max_replicas, elastic.nproc_per_node, elastic.max_restarts) == (3, 3, 8, 2)
    assert pod_container(t)["resources"]["requests"] == {"gpu": "8", "cpu": "32", "memory": "256Gi"}
    assert t["extendedResources"]["sharedMemory"]["sizeLimit"] == "64Gi"


# ------------------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize("arguments,error,match", [
    (dict(gpus="two"), ConfigError, r"@training_task\(gpus='two'\): \[cluster\]\.gpus must be an integer >= 0"),
    (dict(gpus=2, nproc_per_node=4), ConfigError, r"nproc_per_node=4.*must be <= \[cluster\]\.gpus \(2\)"),
    (dict(nnodes=0), ConfigError, r"@training_task\(nnodes=0\).*must be an integer >= 1"),
    (dict(memory="64GB"), ConfigError, r"@training_task\(memory='64GB'\).*Kubernetes quantity"),
    (dict(shared_memory=True), ConfigError, r"@training_task\(shared_memory=True\)"),
    (dict(tolerations=[{"key": "a", "operator": "Sometimes"}]), ConfigError, r"tolerations\[0\]\.operator"),
    (dict(node_selector={"pool": 1}), ConfigError, r"@training_task\(node_selector="),
    (dict(start_method="forkserver"), ConfigError, r"start_method.*\"spawn\", \"fork\""),
    (dict(max_restarts=-1), ConfigError, r"@training_task\(max_restarts=-1\)"),
    (dict(gpu=2), TypeError, r"unexpected keyword argument 'gpu'; did you mean 'gpus'"),
    (dict(requests={"gpu": "2"}), TypeError, r"sets requests= itself.*gpus=, cpu=, memory="),
    (dict(task_config=None), TypeError, r"sets task_config= itself"),
    (dict(image=""), TypeError, r"image=''"),
    (dict(environment={"A": 1}), TypeError, r"environment=.*dict of strings"),
    (dict(check_inputs="yes"), TypeError, r"check_inputs="),
])
def test_bad_decorator_arguments_fail_at_decoration_naming_the_argument(tmp_path, arguments, error, match):
    config = config_from(tmp_path)
    with pytest.raises(error, match=match):
        training_task(config=config, **arguments)(my_training)


def test_decorator_needs_a_function():
    with pytest.raises(TypeError, match="decorates a function"):
        training_task("not a function")
