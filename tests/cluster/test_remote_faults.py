"""Faults as a cluster delivers them, and training over two pods: a training pod deleted mid-run (SIGTERM
with its grace period) resumes from the Flyte checkpoint in the next attempt with no step redone; an error
no restart can fix fails once; Flyte killed mid-run carries on; nnodes=2 becomes a PyTorchJob whose pods
rendezvous through the job's Service and train as one pod with the same global batch does."""

from __future__ import annotations

import os
import signal
import time

import pytest

from localcluster.kubectl import get_json, kubectl
from remote import (FAILED, NAMESPACE, SUCCEEDED, audited_creations, execution_error, flyte_remote, run_remote,
                    task_node, wait)
from test_flyte import _flyte_pod, _flyte_process

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

WORKFLOWS = "workflows/fuseforge_flyte/workflows.py"
# One Flyte retry, as for a preemptible node pool (the chart's default is none).
RETRY = {"flyte.retries": 1}


@pytest.fixture(scope="module")
def started(platform, tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    common = ("--batch_size", "2", "--dtype", "fp32", "--seed", "0")
    return folder, {
        "preempted": run_remote(folder, WORKFLOWS, "train", "--steps", "40", "--checkpoint_every", "5", *common,
                                settings=RETRY),
        "oom": run_remote(folder, "--env", "FUSEFORGE_FAULT_INJECT=1:1:oom", WORKFLOWS, "train", "--steps", "3",
                          *common, settings=RETRY),
        "one_pod": run_remote(folder, WORKFLOWS, "train", "--steps", "3", *common),
        "two_pods": run_remote(folder, WORKFLOWS, "train", "--steps", "3", *common,
                               settings={"elastic.nnodes": 2, "elastic.nproc_per_node": 1}),
    }


def training_pod(execution: str, timeout: float = 600) -> dict:
    """The execution's training pod (the one with the training service account) once it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pod in get_json("pods", "-n", NAMESPACE)["items"]:
            if (pod["metadata"]["name"].startswith(execution) and pod["status"].get("phase") == "Running"
                    and pod["spec"].get("serviceAccountName") == "fuseforge-training"):
                return pod
        time.sleep(2)
    raise AssertionError(f"no running training pod of {execution}")


def logged_steps(pod: str) -> int:
    """The last training step the pod's log reports ("step N/M")."""
    import re

    log = kubectl("-n", NAMESPACE, "logs", pod, check=False).stdout
    steps = [int(m) for m in re.findall(r"\bstep (\d+)/\d+", log)]
    return max(steps, default=0)


def test_deleted_training_pod_resumes_in_the_next_attempt_with_no_step_redone(started):
    name = started[1]["preempted"]
    pod = training_pod(name)["metadata"]["name"]
    deadline = time.monotonic() + 600
    while logged_steps(pod) < 8:
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(2)
    kubectl("-n", NAMESPACE, "delete", "pod", pod, "--grace-period=60", "--wait=false")
    execution = wait(name, timeout=1200)
    assert execution.closure.phase == SUCCEEDED, execution_error(execution)
    attempts = task_node(execution, "train_model").task_executions
    assert len(attempts) == 2, [a.closure.phase for a in attempts]
    metrics = execution.outputs["metrics"]
    assert metrics.resumed_from_step >= 5 and metrics.steps_redone == 0, metrics
    assert metrics.attempt == 1 and metrics.steps == 40


def test_an_error_no_restart_can_fix_fails_the_execution_once(started):
    execution = wait(started[1]["oom"], timeout=900)
    assert execution.closure.phase == FAILED
    error = execution_error(execution)
    assert "FirstStepOutOfMemory" in error and "not retried" in error, error[-3000:]
    attempts = task_node(execution, "train_model").task_executions
    assert len(attempts) == 1, "a permanent error was retried by Flyte"


def test_flyte_killed_mid_run_and_the_execution_still_completes(started):
    folder = started[0]
    name = run_remote(folder, WORKFLOWS, "train", "--steps", "12", "--batch_size", "2", "--dtype", "fp32")
    training_pod(name, timeout=900)
    before = _flyte_pod()["status"]["containerStatuses"][0]["restartCount"]
    os.kill(_flyte_process(), signal.SIGKILL)
    deadline = time.monotonic() + 300
    while _flyte_pod()["status"]["containerStatuses"][0]["restartCount"] == before:
        assert time.monotonic() < deadline, "Flyte did not restart"
        time.sleep(1)
    _admin_answers(deadline)
    execution = wait(name, timeout=900)
    assert execution.closure.phase == SUCCEEDED, execution_error(execution)


def _admin_answers(deadline: float) -> None:
    """Wait for the restarted Flyte's admin API: the console and pyflyte are refused until it serves again."""
    while True:
        try:
            flyte_remote().client.list_projects()
            return
        except Exception as error:  # grpc's UNAVAILABLE, as flytekit wraps it
            assert time.monotonic() < deadline, f"Flyte's admin API did not answer after the restart: {error}"
            time.sleep(2)


def test_two_pods_form_one_job_and_train_like_one_pod_with_the_same_global_batch(started):
    one = wait(started[1]["one_pod"], timeout=900)
    two = wait(started[1]["two_pods"], timeout=900)
    assert two.closure.phase == SUCCEEDED, execution_error(two)
    jobs = audited_creations("pytorchjobs", started[1]["two_pods"])
    assert len(jobs) == 1, jobs
    spec = jobs[0]["spec"]
    assert spec["elasticPolicy"]["minReplicas"] == spec["elasticPolicy"]["maxReplicas"] == 2
    assert spec["elasticPolicy"]["nProcPerNode"] == 1
    replicas = sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
    assert replicas == 2, spec["pytorchReplicaSpecs"]
    pods = [p for p in audited_creations("pods", jobs[0]["metadata"]["name"])]
    assert len(pods) == 2
    endpoints = {e["value"] for p in pods for e in p["spec"]["containers"][0]["env"] if e["name"] == "PET_RDZV_ENDPOINT"}
    assert len(endpoints) == 1 and endpoints.pop().split(":")[0].startswith(jobs[0]["metadata"]["name"]), endpoints
    single, double = one.outputs["metrics"], two.outputs["metrics"]
    assert single.world_size == double.world_size == 2
    assert single.loss_curve == pytest.approx(double.loss_curve, rel=1e-4), (single.loss_curve, double.loss_curve)
