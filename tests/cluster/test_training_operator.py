"""PyTorchJobs as the kfpytorch backend sends them, run by the real training operator on the local node."""

from __future__ import annotations

import time

import pytest
import yaml

from localcluster.kubectl import apply, get_json, kubectl

# One xdist worker runs every cluster test (one control plane; `--dist loadgroup`).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

NAMESPACE = "fuseforge-development"

# Every rank joins the process group (gloo), checks the world size and sums its rank over all ranks.
CHECK = """
import os, socket, torch, torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == int(os.environ["EXPECTED_WORLD_SIZE"]), (world, os.environ["EXPECTED_WORLD_SIZE"])
total = torch.tensor([float(rank)])
dist.all_reduce(total)
assert total.item() == world * (world - 1) / 2
print(f"rank {rank} of {world} on {socket.gethostname()} reached the rendezvous; MASTER_ADDR={os.environ['MASTER_ADDR']}", flush=True)
dist.destroy_process_group()
"""

RESTRICTED = {
    "pod": {"runAsNonRoot": True, "runAsUser": 1001, "runAsGroup": 1001, "seccompProfile": {"type": "RuntimeDefault"}},
    "container": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
}


def _template(command: list[str], world: int) -> dict:
    return {
        "spec": {
            "securityContext": RESTRICTED["pod"],
            "restartPolicy": "Never",
            "containers": [{
                "name": "pytorch",
                "image": "127.0.0.1:15000/fuseforge:test",
                "command": command,
                "env": [{"name": "EXPECTED_WORLD_SIZE", "value": str(world)}, {"name": "OMP_NUM_THREADS", "value": "1"}],
                "securityContext": RESTRICTED["container"],
                "volumeMounts": [{"name": "check", "mountPath": "/opt/check", "readOnly": True}],
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
            }],
            "volumes": [{"name": "check", "configMap": {"name": "rendezvous-check"}}],
        }
    }


def _job(name: str, specs: dict, elastic: dict | None = None) -> str:
    spec = {"pytorchReplicaSpecs": specs, "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 0}}
    if elastic:
        spec["elasticPolicy"] = elastic
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                           "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec})


def _wait_for(name: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = get_json("pytorchjob", name, "-n", NAMESPACE)
        conditions = {c["type"]: c for c in job.get("status", {}).get("conditions", [])}
        if conditions.get("Succeeded", {}).get("status") == "True":
            return job
        if conditions.get("Failed", {}).get("status") == "True":
            pytest.fail(f"PyTorchJob {name} failed: {conditions['Failed'].get('message')}\n{_logs(name)}")
        time.sleep(2)
    pytest.fail(f"PyTorchJob {name} did not finish in {timeout} s\n{_logs(name)}")


def _pods(name: str) -> list[dict]:
    return get_json("pods", "-n", NAMESPACE, "-l", f"training.kubeflow.org/job-name={name}")["items"]


def _logs(name: str) -> str:
    out = []
    for pod in _pods(name):
        result = kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], "--all-containers", check=False)
        out.append(f"--- {pod['metadata']['name']} ({pod['status'].get('phase')})\n{result.stdout}{result.stderr}")
    return "\n".join(out)


@pytest.fixture(scope="module")
def check_script(platform):
    apply(kubectl("-n", NAMESPACE, "create", "configmap", "rendezvous-check", "--from-literal=check.py=" + CHECK,
                  "--dry-run=client", "-o", "yaml").stdout)


def test_master_and_worker_rendezvous_through_the_master_service(check_script):
    """Non-elastic (PyTorch(num_workers=...)): the workers find the master by its Service name."""
    command = ["python", "/opt/check/check.py"]
    apply(_job("masterworker", {
        "Master": {"replicas": 1, "restartPolicy": "Never", "template": _template(command, 2)},
        "Worker": {"replicas": 1, "restartPolicy": "Never", "template": _template(command, 2)},
    }))
    _wait_for("masterworker")
    pods = {p["metadata"]["labels"]["training.kubeflow.org/replica-type"]: p for p in _pods("masterworker")}
    assert set(pods) == {"master", "worker"}
    worker_env = {e["name"]: e.get("value") for e in pods["worker"]["spec"]["containers"][0]["env"]}
    assert worker_env["MASTER_ADDR"] == "masterworker-master-0"
    # The operator's init container waited for the master's name to resolve (cluster DNS on the node).
    assert [c["name"] for c in pods["worker"]["spec"].get("initContainers", [])] == ["init-pytorch"]
    logs = _logs("masterworker")
    assert "rank 0 of 2" in logs and "rank 1 of 2" in logs


def test_elastic_workers_rendezvous_as_kfpytorch_sends_them(check_script):
    """Elastic (Elastic(nnodes=2, nproc_per_node=2)): workers only, c10d rendezvous on worker 0's name."""
    command = ["torchrun", "/opt/check/check.py"]
    elastic = {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2, "nProcPerNode": 2, "maxRestarts": 0}
    apply(_job("elastic", {"Worker": {"replicas": 2, "restartPolicy": "Never", "template": _template(command, 4)}},
               elastic))
    job = _wait_for("elastic")
    assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    pods = _pods("elastic")
    assert len(pods) == 2 and all(p["status"]["phase"] == "Succeeded" for p in pods)
    env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
    assert env["PET_RDZV_ENDPOINT"].split(":")[0] == "elastic-worker-0"  # worker 0 hosts the c10d store
    logs = _logs("elastic")
    for rank in range(4):
        assert f"rank {rank} of 4" in logs, logs
