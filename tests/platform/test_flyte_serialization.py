"""Offline serialization: what Flyte would register for the tasks, decoded from the task protobufs.

Asserts that platform.toml reaches the registered task: elastic/PyTorchJob config, GPU requests and
limits, accelerator, /dev/shm, node selector and tolerations, image, and the config carried to the pod.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
from flyteidl.admin.task_pb2 import TaskSpec
from flyteidl.plugins.kubeflow.pytorch_pb2 import DistributedPyTorchTrainingTask
from flytekit import task
from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.tools.translator import get_serializable
from google.protobuf.json_format import MessageToDict, ParseDict

from fuseforge_flyte.config import RESOLVED_CONFIG_ENV, load_config
from fuseforge_flyte.inputs import spec_values
from fuseforge_flyte.launch import CONFIG_ANNOTATION, config_digest, summary_task_options, training_task_options
from fuseforge_flyte.training.validation import CHOICES
from fuseforge_flyte.tasks import DEFAULTS, summarize_comparison, train_model
from fuseforge_flyte.training.spec import TrainSpec
from fuseforge_flyte.workflows import compare, distill, dpo, train

REPO = Path(__file__).resolve().parents[2]

MULTI_NODE = """
[image]
registry = "registry.example.com/ml"
name = "fuseforge"
tag = "v1.2.3"
[flyte]
project = "llm"
domain = "production"
retries = 1
[cluster]
gpus = 8
accelerator = "nvidia-h200"
cpu = "96"
memory = "1000Gi"
shared_memory = "128Gi"
pod_template_name = "fuseforge-gpu"
node_selector = { "nvidia.com/gpu.product" = "NVIDIA-H200" }
tolerations = [
  { key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" },
  { key = "dedicated", operator = "Equal", value = "training", effect = "NoExecute", toleration_seconds = 600 },
]
[elastic]
nnodes = 4
nproc_per_node = 8
max_restarts = 3
"""

CPU_SINGLE_NODE = """
[image]
registry = "localhost:30000"
[flyte]
project = "p"
domain = "d"
[cluster]
gpus = 0
cpu = "8"
memory = "16Gi"
shared_memory = ""
tolerations = []
[elastic]
nnodes = 1
nproc_per_node = 4
"""


def config_from(tmp_path: Path, text: str):
    path = tmp_path / "platform.toml"
    path.write_text(textwrap.dedent(text))
    return load_config(path, env={})


def template_of(entity) -> dict:
    """The serialized task template as JSON-shaped data (what `pyflyte register` uploads)."""
    settings = SerializationSettings(image_config=ImageConfig.auto_default_image())
    serialized = get_serializable(OrderedDict(), settings, entity)
    return MessageToDict(serialized.template.to_flyte_idl())


def training_task_for(config):
    """The training task as it would be defined under `config` (the module's task uses platform.toml)."""
    return task(**training_task_options(config))(train_model.task_function)


def pod_container(template: dict) -> dict:
    return template["k8sPod"]["podSpec"]["containers"][0] if "k8sPod" in template else template["container"]


def env_of(container: dict) -> dict:
    return {e["key"] if "key" in e else e["name"]: e["value"] for e in container.get("env", [])}


def test_multi_node_task_is_a_pytorchjob_with_the_configured_resources(tmp_path):
    config = config_from(tmp_path, MULTI_NODE)
    t = template_of(training_task_for(config))

    assert t["type"] == "pytorch"
    job = ParseDict(t["custom"], DistributedPyTorchTrainingTask())
    assert job.elastic_config.rdzv_backend == "c10d"
    assert (job.elastic_config.min_replicas, job.elastic_config.max_replicas) == (4, 4)
    assert job.elastic_config.nproc_per_node == 8
    assert job.elastic_config.max_restarts == 3
    assert job.worker_replicas.replicas == 4

    assert t["extendedResources"]["gpuAccelerator"]["device"] == "nvidia-h200"
    assert t["extendedResources"]["sharedMemory"]["sizeLimit"] == "128Gi"
    assert t["extendedResources"]["sharedMemory"]["mountPath"] == "/dev/shm"
    assert t["metadata"]["podTemplateName"] == "fuseforge-gpu"
    assert t["metadata"]["generatesDeck"] is True
    assert t["metadata"]["retries"]["retries"] == 1

    pod = t["k8sPod"]["podSpec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoExecute", "tolerationSeconds": 600},
    ]
    container = pod_container(t)
    assert container["resources"]["requests"] == {"gpu": "8", "cpu": "96", "memory": "1000Gi"}
    assert container["resources"]["limits"] == {"gpu": "8", "memory": "1000Gi"}
    assert container["image"] == "registry.example.com/ml/fuseforge:v1.2.3"
    assert container["args"][-4:] == ["task-module", "fuseforge_flyte.tasks", "task-name", "train_model"]
    # The pod reloads exactly this config (elastic settings included) instead of a file.
    carried = env_of(container)[RESOLVED_CONFIG_ENV]
    assert load_config(env={RESOLVED_CONFIG_ENV: carried}) == config


def test_single_node_cpu_task_is_a_plain_pod_without_gpu(tmp_path):
    config = config_from(tmp_path, CPU_SINGLE_NODE)
    t = template_of(training_task_for(config))
    assert t["type"] == "python-task"  # nnodes = 1: no training operator needed
    # No node selector or tolerations: the pod template carries only the platform.toml digest.
    assert t["k8sPod"]["metadata"]["annotations"] == {CONFIG_ANNOTATION: config_digest(config)}
    assert not {"nodeSelector", "tolerations"} & set(t["k8sPod"]["podSpec"])
    assert "extendedResources" not in t  # no accelerator, no shared memory
    container = pod_container(t)
    assert container["resources"]["requests"] == {"cpu": "8", "memory": "16Gi"}
    assert container["image"].startswith("localhost:30000/fuseforge:")
    tag = container["image"].rsplit(":", 1)[1]
    assert len(tag) == 20 and all(c in "0123456789abcdef" for c in tag)  # content hash


def test_summary_task_is_small_and_shares_the_image(tmp_path):
    config = config_from(tmp_path, MULTI_NODE)
    t = template_of(task(**summary_task_options(config))(summarize_comparison.task_function))
    assert t["type"] == "python-task"
    assert pod_container(t)["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    assert pod_container(t)["image"] == "registry.example.com/ml/fuseforge:v1.2.3"


def test_module_tasks_use_platform_toml():
    t = template_of(train_model)
    config = load_config(env={RESOLVED_CONFIG_ENV: env_of(pod_container(t))[RESOLVED_CONFIG_ENV]})
    assert pod_container(t)["image"].startswith(f"{config.image.registry}/{config.image.name}:")



def test_workflow_inputs_mirror_trainspec_with_config_defaults():
    spec_fields = [f.name for f in dataclasses.fields(TrainSpec)]
    defaults = dataclasses.asdict(DEFAULTS)
    inputs = train.python_interface.inputs_with_defaults
    assert list(inputs) == ["dataset"] + [f for f in spec_fields if f != "dataset"], "train's inputs drifted"
    assert spec_values({k: v[1] for k, v in inputs.items()}) == {k: defaults[k] for k in spec_fields}
    task_inputs = train_model.python_interface.inputs_with_defaults
    assert list(task_inputs) == ["data"] + [f for f in spec_fields if f != "dataset"]
    assert spec_values({k: v[1] for k, v in task_inputs.items() if k != "data"}) == {
        k: defaults[k] for k in task_inputs if k != "data"}
    assert list(train.python_interface.outputs) == ["metrics", "model"]
    compare_inputs = compare.python_interface.inputs_with_defaults
    assert set(spec_fields) - set(compare_inputs) == {"kernels", "output_dir", "checkpoint_dir", "checkpoint_every",
                                                      "keep_last", "resume_allow_changes", "resume_from",
                                                      "allow_unsigned_checkpoints", "eval_fraction", "eval_dataset",
                                                      "eval_every", "teacher", "distill_weight", "distill_beta",
                                                      "distill_temperature"}
    assert compare.python_interface.outputs["o0"].__name__ == "Comparison"


def test_inputs_have_help_and_choices():
    """Every input is described (the Flyte console and pyflyte --help show it); str choices are Enums."""
    for entity in (train, compare, distill, dpo, train_model):
        interface = entity.interface  # the typed interface, with the docstring's descriptions
        for name, variable in interface.inputs.items():
            assert len(variable.description) > 15, f"{entity.name}.{name} has no help: {variable.description!r}"
        for name, allowed in CHOICES.items():
            if name in interface.inputs and name != "zero_stage":
                assert variable_enum(interface.inputs[name]) == list(allowed), name
        assert ":param" not in entity.__doc__  # described once, in the options table


def variable_enum(variable) -> list:
    return list(variable.type.enum_type.values)


def test_cli_help_lists_choices_and_help_without_duplicate_warnings():
    """pyflyte's --help: allowed values, a description per option, no click warnings about duplicated bool flags."""
    result = subprocess.run(
        [str(Path(sys.executable).with_name("pyflyte")), "run", str(REPO / "workflows" / "train.py"), "train", "--help"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "used more than once" not in output
    assert "[ddp|fsdp|deepspeed]" in output and "[fp32|bf16|fp16]" in output and "[raise|skip]" in output
    assert "optimizer steps to train" in output and "TEXT|TEXT" not in output


@pytest.mark.slow
def test_pyflyte_package_offline(tmp_path):
    """The real CLI path: `pyflyte package` with a multi-node config, then decode the tarball."""
    (tmp_path / "platform.toml").write_text(textwrap.dedent(MULTI_NODE))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEFORGE")}
    env["FUSEFORGE_CONFIG"] = str(tmp_path / "platform.toml")
    out = tmp_path / "pkg.tgz"
    result = subprocess.run(
        [str(Path(sys.executable).with_name("pyflyte")), "--pkgs", "fuseforge_flyte.workflows", "package",
         "--image", "ghcr.io/flyteorg/flytekit:py3.11-latest", "-o", str(out), "--force"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with tarfile.open(out) as tar:
        names = tar.getnames()
        member = next(n for n in names if n.endswith("fuseforge_flyte.tasks.train_model_1.pb"))
        spec = TaskSpec()
        spec.ParseFromString(tar.extractfile(member).read())
    assert any("fuseforge_flyte.workflows.compare" in n for n in names)
    t = MessageToDict(spec.template)
    assert t["type"] == "pytorch"
    elastic = ParseDict(t["custom"], DistributedPyTorchTrainingTask()).elastic_config
    assert (elastic.min_replicas, elastic.max_replicas, elastic.nproc_per_node, elastic.max_restarts) == (4, 4, 8, 3)
    assert pod_container(t)["image"] == "registry.example.com/ml/fuseforge:v1.2.3"
    assert pod_container(t)["resources"]["limits"]["gpu"] == "8"
    assert json.loads(env_of(pod_container(t))[RESOLVED_CONFIG_ENV])["elastic"]["nnodes"] == 4


def test_dpo_reference_task_is_one_cached_gpu_and_the_policy_task_all_of_the_pod():
    """The reference is scored once per dataset and reference model (cached) on one GPU; the policy takes
    the pod's GPUs as platform.toml's [cluster] sets them."""
    from fuseforge_flyte.posttrain.tasks import REFERENCE_CACHE_VERSION, dpo_train, reference_logps

    ref = template_of(reference_logps)
    assert ref["metadata"]["discoverable"] is True
    assert ref["metadata"]["discoveryVersion"] == REFERENCE_CACHE_VERSION
    requests = pod_container(ref)["resources"]["requests"]
    gpus = requests["gpu"] if isinstance(requests, dict) else {r["name"]: r["value"] for r in requests}["GPU"]
    assert gpus == "1"
    policy = template_of(dpo_train)
    config = load_config(env={RESOLVED_CONFIG_ENV: env_of(pod_container(policy))[RESOLVED_CONFIG_ENV]})
    requests = pod_container(policy)["resources"]["requests"]
    gpus = requests["gpu"] if isinstance(requests, dict) else {r["name"]: r["value"] for r in requests}["GPU"]
    assert gpus == str(config.cluster.gpus)
    assert "metadata" not in policy or not policy["metadata"].get("discoverable")
