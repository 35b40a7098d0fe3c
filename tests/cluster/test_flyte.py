"""Flyte as the chart configures it, on the live cluster: projects, the plugins propeller loaded, admin's
limits, `pyflyte register` of the project's workflows, and restarts that carry on from stored state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from localcluster import cluster as local
from localcluster import processes
from localcluster.cluster import FLYTE_NAMESPACE, flyte_config_path
from localcluster.kubectl import get_json, kubectl

# One xdist worker runs every cluster test (one control plane; `--dist loadgroup`).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

ROOT = Path(__file__).resolve().parents[2]
VERSION = "v1"
# Profiling servers of the Flyte services, which also serve each one's effective configuration
# (ports set by cluster/flyte/start.go; admin keeps Flyte's default).
ADMIN_CONFIG = "http://127.0.0.1:10254/config"
PROPELLER_CONFIG = "http://127.0.0.1:10265/config"


def effective_config(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def remote():
    from flytekit.configuration import Config
    from flytekit.remote import FlyteRemote

    return FlyteRemote(Config.auto(config_file=str(flyte_config_path())), default_project="fuseforge",
                       default_domain="development")


@pytest.fixture(scope="module")
def registered(platform, tmp_path_factory):
    """`pyflyte register workflows/` with the platform.toml the chart rendered for this cluster."""
    folder = tmp_path_factory.mktemp("register")
    toml = kubectl("-n", "fuseforge-development", "get", "configmap", "fuseforge-platform",
                   "-o", "jsonpath={.data.platform\\.toml}").stdout
    (folder / "cluster.toml").write_text(toml)
    env = dict(os.environ, FUSEFORGE_CONFIG=str(folder / "cluster.toml"), FUSEFORGE__IMAGE__TAG="local",
               FUSEFORGE_IMAGE_CHECK="off")
    pyflyte = Path(sys.executable).parent / "pyflyte"
    result = subprocess.run(
        [str(pyflyte), "--config", str(flyte_config_path()), "register", "--project", "fuseforge",
         "--domain", "development", "--version", VERSION, str(ROOT / "workflows")],
        cwd=folder, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_seeded_project_has_its_domains(platform):
    projects = {p.id: p for p in remote().client.list_projects().projects}  # flyteidl's Projects message
    assert "fuseforge" in projects
    assert {d.id for d in projects["fuseforge"].domains} == {"development", "staging", "production"}


def test_propeller_runs_with_the_charts_plugins(platform):
    config = effective_config(PROPELLER_CONFIG)
    plugins = config["tasks"]["task-plugins"]
    assert "pytorch" in plugins["enabled-plugins"] and plugins["default-for-task-types"]["pytorch"] == "pytorch"
    k8s = config["plugins"]["k8s"]
    assert k8s["gpu-resource-name"] == "nvidia.com/gpu"
    assert k8s["default-pod-template-name"] == "fuseforge-base"
    assert k8s["resource-tolerations"]["nvidia.com/gpu"][0]["key"] == "nvidia.com/gpu"
    # Variable names keep their case (a plain map in the values would arrive lower-cased).
    assert k8s["default-env-vars"] == {"FLYTE_AWS_ENDPOINT": "http://127.0.0.1:19000", "TRITON_INTERPRET": "1"}


def test_admin_accepts_tasks_that_ask_for_a_gpu_node(platform):
    limits = effective_config(ADMIN_CONFIG)["task_resources"]["limits"]
    assert int(limits["gpu"]) >= 8 and limits["memory"].endswith("Ti")


def test_pyflyte_register_registers_every_workflow(registered):
    assert "Successfully registered" in registered
    flyte = remote()
    for name in ("demo", "train", "compare", "dpo", "distill"):
        workflow = flyte.fetch_workflow(name=f"workflows.fuseforge_flyte.workflows.{name}", version=VERSION)
        assert workflow.id.version == VERSION
    task = flyte.fetch_task(name="workflows.fuseforge_flyte.tasks.train_model", version=VERSION)
    template = task.template  # a pod template (the GPU PodTemplate's settings), so the image is in its spec
    images = [c["image"] for c in template.k8s_pod.pod_spec["containers"]] if template.k8s_pod else [template.container.image]
    assert images and all(i == "127.0.0.1:15000/fuseforge:local" for i in images), images


def _flyte_pod() -> dict:
    return get_json("pods", "-n", FLYTE_NAMESPACE, "-l", "app.kubernetes.io/name=flyte-binary")["items"][0]


def _flyte_process() -> int:
    """The pid of the Flyte pod's main process (`flyte start ...`), which the node runs on this machine."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if len(argv) > 2 and argv[0].endswith(b"/flyte") and argv[1] == b"start":
                return int(entry.name)
    raise AssertionError("no flyte process")


def test_flyte_killed_comes_back_with_its_state(registered):
    before = _flyte_pod()["status"]["containerStatuses"][0]["restartCount"]
    os.kill(_flyte_process(), signal.SIGKILL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status = _flyte_pod()["status"]["containerStatuses"][0]
        if status["restartCount"] > before and status.get("ready"):
            break
        time.sleep(1)
    else:
        pytest.fail(f"Flyte did not come back: {status}")
    # What was registered before the kill is still there (PostgreSQL, not the process, holds it).
    workflow = remote().fetch_workflow(name="workflows.fuseforge_flyte.workflows.demo", version=VERSION)
    assert workflow.id.version == VERSION


def test_training_operator_killed_and_restarted_finishes_the_job_it_left(platform):
    from test_training_operator import CHECK, NAMESPACE, _job, _pods, _template, _wait_for
    from localcluster.kubectl import apply

    apply(kubectl("-n", NAMESPACE, "create", "configmap", "rendezvous-check", "--from-literal=check.py=" + CHECK,
                  "--dry-run=client", "-o", "yaml").stdout)
    command = ["python", "-c", "import time; time.sleep(10)"]
    apply(_job("outlives", {"Master": {"replicas": 1, "restartPolicy": "Never", "template": _template(command, 1)}}))
    deadline = time.monotonic() + 120
    while not any(p["status"].get("phase") == "Running" for p in _pods("outlives")):
        assert time.monotonic() < deadline, "the job's pod never ran"
        time.sleep(0.5)
    os.kill(processes.running_pid("training-operator"), signal.SIGKILL)
    # The pod finishes while no operator watches; the job still says it runs.
    while not all(p["status"].get("phase") == "Succeeded" for p in _pods("outlives")):
        assert time.monotonic() < deadline, "the job's pod did not finish"
        time.sleep(0.5)
    job = get_json("pytorchjob", "outlives", "-n", NAMESPACE)
    assert not any(c["type"] == "Succeeded" and c["status"] == "True" for c in job["status"].get("conditions", []))
    local.up()  # starts what is not running: the operator, which reads the job and its pod from the API server
    _wait_for("outlives", timeout=120)
